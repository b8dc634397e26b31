"""Task-matrix metrics on small matrices whose values are worked out by hand in the comments.

Notation: S[i][j] = score of class j after stage i (1-based in the comments), S = R for
accuracy and S = -R for a loss.
"""

import pytest

from monitor.forgetting import (
    ProbeMatrix, aultc, bwt, chaudhry_forgetting, cur_acc, final_performance, forgetting_mhamdi,
    forgetting_summary, fwt, intransigence, last_acc, matrix_from_probe_log, transfer, zero_shot_transfer,
)

approx = pytest.approx

# --- 3x3 accuracy --------------------------------------------------------------------
#            a     b     c
# stage 1  0.9   0.3   0.2
# stage 2  0.6   0.8   0.4
# stage 3  0.5   0.7   0.9
# before   0.1   0.2   0.1     reference  0.95  0.85  0.95
ACC3 = ProbeMatrix(classes=("a", "b", "c"), stages=(1, 2, 3), higher_is_better=True,
                   values=[[0.9, 0.3, 0.2], [0.6, 0.8, 0.4], [0.5, 0.7, 0.9]])
ACC3_BEFORE = {"a": 0.1, "b": 0.2, "c": 0.1}
ACC3_REF = {"a": 0.95, "b": 0.85, "c": 0.95}


def test_accuracy_3x3_mhamdi():
    # Eq. 1: j=2: F_a = max(S1a=.9) - S2a=.6 = .3                    -> F_<=2 = .3
    #        j=3: F_a = max(.9, .6) - .5 = .4; F_b = max(.3, .8) - .7 = .1 -> F_<=3 = .25
    #        F = (.3 + .25) / 2 = .275
    assert forgetting_mhamdi(ACC3) == approx(0.275)
    # Eq. 2: T_b = S2b - ref_b = .8 - .85 = -.05; T_c = .9 - .95 = -.05 -> T = -.05
    assert transfer(ACC3, ACC3_REF) == approx(-0.05)
    # Eq. 3: T0_b = mean(S1b) - before_b = .3 - .2 = .1; T0_c = mean(.2, .4) - .1 = .2 -> T0 = .15
    assert zero_shot_transfer(ACC3, ACC3_BEFORE) == approx(0.15)
    # Eq. 4: FP = (.5 + .7 + .9) / 3 = .7
    assert final_performance(ACC3) == approx(0.7)


def test_accuracy_3x3_yang_and_chaudhry():
    # cur-ACC = (.9 + .8 + .9) / 3 = .866667; last-ACC = (.5 + .7 + .9) / 3 = .7
    assert cur_acc(ACC3) == approx(2.6 / 3)
    assert cur_acc(ACC3, t=2) == approx(0.85)
    assert last_acc(ACC3) == approx(0.7)
    # BWT_3 = 2/(3*2) * [(S2a-S1a) + (S3a-S1a) + (S3b-S2b)] = (-.3 - .4 - .1) / 3 = -.266667
    assert bwt(ACC3) == approx(-0.8 / 3)
    assert bwt(ACC3, t=2) == approx(-0.3)
    # FWT_3 = [(S1b - before_b) + (S2c - before_c)] / 2 = (.1 + .3) / 2 = .2
    assert fwt(ACC3, ACC3_BEFORE) == approx(0.2)
    # Chaudhry F_3 = [(max(.9, .6) - .5) + (max(.3, .8) - .7)] / 2 = (.4 + .1) / 2 = .25
    assert chaudhry_forgetting(ACC3) == approx(0.25)
    # I = [(.95 - .9) + (.85 - .8) + (.95 - .9)] / 3 = .05
    assert intransigence(ACC3, ACC3_REF) == approx(0.05)


# --- 3x3 loss (lower is better, S = -loss) ---------------------------------------------
#            a     b     c
# stage 1  2.0   4.0   5.0
# stage 2  3.0   1.5   4.5
# stage 3  3.5   2.5   1.0
# before   5.0   5.0   5.0     reference  1.8  1.4  1.2
LOSS3_VALUES = [[2.0, 4.0, 5.0], [3.0, 1.5, 4.5], [3.5, 2.5, 1.0]]
LOSS3 = ProbeMatrix(classes=("a", "b", "c"), stages=(3, 6, 8), values=LOSS3_VALUES, higher_is_better=False)
LOSS3_BEFORE = [5.0, 5.0, 5.0]
LOSS3_REF = {"a": 1.8, "b": 1.4, "c": 1.2}
LOSS3_EXPECTED = {
    # Eq. 1: j=2: F_a = max(-2) - (-3) = 1                                  -> F_<=2 = 1
    #        j=3: F_a = max(-2, -3) + 3.5 = 1.5; F_b = max(-4, -1.5) + 2.5 = 1 -> F_<=3 = 1.25
    #        F = (1 + 1.25) / 2 = 1.125   (positive: the losses went up)
    "forgetting": 1.125,
    # Eq. 2: T_b = -1.5 - (-1.4) = -.1; T_c = -1.0 - (-1.2) = .2 -> T = .05
    "transfer": 0.05,
    # Eq. 3: T0_b = -4 - (-5) = 1; T0_c = mean(-5, -4.5) - (-5) = .25 -> T0 = .625
    "zero_shot_transfer": 0.625,
    # Eq. 4: FP = -(3.5 + 2.5 + 1.0) / 3 = -7/3 (minus the mean final loss)
    "final_performance": -7 / 3,
    "last_acc": -7 / 3,
    # cur-ACC = -(2 + 1.5 + 1) / 3 = -1.5
    "cur_acc": -1.5,
    # BWT = [(-3 + 2) + (-3.5 + 2) + (-2.5 + 1.5)] / 3 = (-1 - 1.5 - 1) / 3 = -3.5/3
    "bwt": -3.5 / 3,
    # FWT = [(-4 + 5) + (-4.5 + 5)] / 2 = .75
    "fwt": 0.75,
    # Chaudhry F_3 = (1.5 + 1) / 2 = 1.25
    "chaudhry_forgetting": 1.25,
    # I = [(-1.8 + 2) + (-1.4 + 1.5) + (-1.2 + 1)] / 3 = (.2 + .1 - .2) / 3 = .1/3
    "intransigence": 0.1 / 3,
}


def test_loss_3x3_signs_flipped():
    notes = []
    assert forgetting_mhamdi(LOSS3, notes=notes) == approx(LOSS3_EXPECTED["forgetting"])
    assert transfer(LOSS3, LOSS3_REF) == approx(LOSS3_EXPECTED["transfer"])
    assert zero_shot_transfer(LOSS3, LOSS3_BEFORE) == approx(LOSS3_EXPECTED["zero_shot_transfer"])
    assert final_performance(LOSS3) == approx(LOSS3_EXPECTED["final_performance"])
    assert last_acc(LOSS3) == approx(LOSS3_EXPECTED["last_acc"])
    assert cur_acc(LOSS3) == approx(LOSS3_EXPECTED["cur_acc"])
    assert bwt(LOSS3) == approx(LOSS3_EXPECTED["bwt"])
    assert fwt(LOSS3, LOSS3_BEFORE) == approx(LOSS3_EXPECTED["fwt"])
    assert chaudhry_forgetting(LOSS3) == approx(LOSS3_EXPECTED["chaudhry_forgetting"])
    assert intransigence(LOSS3, LOSS3_REF) == approx(LOSS3_EXPECTED["intransigence"])
    assert notes == []


# --- 4x4 accuracy: class c scores higher at stage 2 (before it is trained) than at stage 3 ---
#            a     b     c     d
# stage 1  0.8   0.5   0.1   0.2
# stage 2  0.4   0.9   0.75  0.2
# stage 3  0.6   0.3   0.7   0.4
# stage 4  0.5   0.6   0.2   0.9
# before   0.1   0.2   0.1   0.3
ACC4_VALUES = [[0.8, 0.5, 0.1, 0.2], [0.4, 0.9, 0.75, 0.2], [0.6, 0.3, 0.7, 0.4], [0.5, 0.6, 0.2, 0.9]]
ACC4 = ProbeMatrix(classes=("a", "b", "c", "d"), stages=(1, 2, 3, 4), values=ACC4_VALUES,
                   higher_is_better=True, before=(0.1, 0.2, 0.1, 0.3))


def test_accuracy_4x4():
    # Eq. 1: j=2: F_a = .8 - .4 = .4                                     -> F_<=2 = .4
    #        j=3: F_a = max(.8, .4) - .6 = .2; F_b = max(.5, .9) - .3 = .6 -> F_<=3 = .4
    #        j=4: F_a = .8 - .5 = .3; F_b = .9 - .6 = .3;
    #             F_c = max(.1, .75, .7) - .2 = .55 (k runs over 1..j-1, stage 2 included)
    #                                                                    -> F_<=4 = 1.15/3
    #        F = (.4 + .4 + 1.15/3) / 3 = 3.55/9
    assert forgetting_mhamdi(ACC4) == approx(3.55 / 9)
    # Chaudhry F_4 = F_<=4 = 1.15/3
    assert chaudhry_forgetting(ACC4) == approx(1.15 / 3)
    # BWT_4 = 2/(4*3) * [(.4-.8) + (.6-.8) + (.3-.9) + (.5-.8) + (.6-.9) + (.2-.7)] = -2.3/6
    assert bwt(ACC4) == approx(-2.3 / 6)
    # BWT_3 = (-.4 - .2 - .6) / 3 = -.4
    assert bwt(ACC4, t=3) == approx(-0.4)
    # FWT_4 = [(S1b - .2) + (S2c - .1) + (S3d - .3)] / 3 = (.3 + .65 + .1) / 3 = .35 (before from the matrix)
    assert fwt(ACC4) == approx(0.35)
    # T0: b: .5 - .2 = .3; c: (.1 + .75)/2 - .1 = .325; d: (.2 + .2 + .4)/3 - .3 = .8/3 - .3
    #     T0 = (.3 + .325 + .8/3 - .3) / 3 = (.325 + .8/3) / 3
    assert zero_shot_transfer(ACC4) == approx((0.325 + 0.8 / 3) / 3)
    # FP = (.5 + .6 + .2 + .9) / 4 = .55; cur-ACC = (.8 + .9 + .7 + .9) / 4 = .825
    assert final_performance(ACC4) == approx(0.55)
    assert cur_acc(ACC4) == approx(0.825)


def test_loss_4x4_is_the_accuracy_matrix_rescaled():
    # loss = 10 * (1 - acc), so S = -loss = 10 * acc - 10: every difference-based metric is
    # 10x its accuracy value above, the level metrics 10x minus 10.
    loss = ProbeMatrix(classes=ACC4.classes, stages=ACC4.stages, higher_is_better=False,
                       values=[[10 * (1 - v) for v in row] for row in ACC4_VALUES],
                       before=tuple(10 * (1 - v) for v in ACC4.before))
    assert forgetting_mhamdi(loss) == approx(35.5 / 9)       # 10 * 3.55/9
    assert chaudhry_forgetting(loss) == approx(11.5 / 3)     # 10 * 1.15/3
    assert bwt(loss) == approx(-23 / 6)                      # 10 * -2.3/6
    assert fwt(loss) == approx(3.5)                          # 10 * .35
    assert final_performance(loss) == approx(-4.5)           # 10 * .55 - 10
    assert cur_acc(loss) == approx(-1.75)                    # 10 * .825 - 10


def test_summary_and_per_class():
    summary = forgetting_summary(ACC4, reference={"a": 0.9, "b": 0.9, "c": 0.9, "d": 0.9})
    # per-class forgetting at the last stage (f_j^4 of both papers): a .3, b .3, c .55, d None (last)
    assert {name: row["forgetting"] for name, row in summary["per_class"].items()} == {
        "a": approx(0.3), "b": approx(0.3), "c": approx(0.55), "d": None}
    # intransigence: [(.9-.8) + (.9-.9) + (.9-.7) + (.9-.9)] / 4 = .3/4 = .075
    # transfer: [(S2b - .9) + (S3c - .9) + (S4d - .9)] / 3 = (0 - .2 + 0) / 3
    assert summary["intransigence"] == approx(0.075)
    assert summary["transfer"] == approx(-0.2 / 3)
    assert summary["per_class"]["c"]["backward"] == approx(-0.5)   # .2 - .7
    assert summary["per_class"]["b"]["forward"] == approx(0.3)     # S1b - before_b
    assert summary["aultc"] is None and any("aultc" in note for note in summary["notes"])
    assert summary["score"] == "value" and summary["n_stages"] == 4


def test_none_with_notes_for_one_stage():
    one = ProbeMatrix(classes=("a", "b"), stages=(5,), values=[[2.0, 4.0]], higher_is_better=False)
    summary = forgetting_summary(one)
    for metric in ("forgetting", "transfer", "zero_shot_transfer", "bwt", "fwt", "chaudhry_forgetting",
                   "intransigence", "aultc"):
        assert summary[metric] is None
        assert any(note.startswith(f"{metric} is None") for note in summary["notes"]), metric
    # only class a has a stage: FP = last-ACC = cur-ACC = -2.0; b is left out with a note
    assert summary["final_performance"] == summary["last_acc"] == summary["cur_acc"] == approx(-2.0)
    assert any("no stage yet" in note and "b" in note for note in summary["notes"])
    assert summary["per_class"] == {"a": {
        "stage": 1, "forgetting": None, "just_learned": -2.0, "final": -2.0, "backward": None,
        "forward": None, "zero_shot_transfer": None, "intransigence": None}}


def test_none_without_before_or_reference():
    notes = []
    assert fwt(ACC3, notes=notes) is None
    assert zero_shot_transfer(ACC3, notes=notes) is None
    assert intransigence(ACC3, None, notes=notes) is None
    assert transfer(ACC3, None, notes=notes) is None
    assert [note.split(" is None")[0] for note in notes] == [
        "fwt", "zero_shot_transfer", "intransigence", "transfer"]
    assert "before row" in notes[0] and "reference" in notes[2]


def test_missing_entry_drops_its_terms_with_a_note():
    # ACC3 with S3b unknown: F_<=3 keeps only F_a = .4 -> F = (.3 + .4) / 2 = .35
    gap = ProbeMatrix(classes=ACC3.classes, stages=ACC3.stages, higher_is_better=True,
                      values=[[0.9, 0.3, 0.2], [0.6, 0.8, 0.4], [0.5, None, 0.9]])
    notes = []
    assert forgetting_mhamdi(gap, notes=notes) == approx(0.35)
    assert notes == ["forgetting F_<=3: 1 of 2 terms left out (class not scored)"]
    # FP = (.5 + .9) / 2 = .7
    assert final_performance(gap) == approx(0.7)


def test_aultc_hand_made_curve():
    # trapezoids: (10-0)*(.2+.6)/2 = 4; (20-10)*(.6+.4)/2 = 5 -> area 9; span 20 -> .45
    curve = [(0, 0.2), (10, 0.6), (20, 0.4)]
    assert aultc(curve) == approx(0.45)
    assert aultc(curve, span=30) == approx(0.3)
    # a loss curve is negated: losses 2, 1, 1 -> area 10*1.5 + 10*1 = 25; -25/20
    assert aultc([(0, 2.0), (10, 1.0), (20, 1.0)], higher_is_better=False) == approx(-1.25)
    notes = []
    assert aultc([(0, 0.5)], notes=notes) is None and "needs 2 evaluations" in notes[0]


# --- probe log: the 3x3 loss matrix above, with a revisit and periodic rows ----------------
PROBE_LOG = [
    {"batch": 0, "trigger": "periodic", "ended_class": None, "scores": {"a": 5.0, "b": 5.0, "c": 5.0}},
    {"batch": 3, "trigger": "switch", "ended_class": "a", "scores": {"a": 2.0, "b": 4.0, "c": 5.0}},
    {"batch": 4, "trigger": "periodic", "ended_class": None, "scores": {"a": 2.5, "b": 3.5, "c": 5.0}},
    {"batch": 6, "trigger": "switch", "ended_class": "b", "scores": {"a": 3.0, "b": 1.5, "c": 4.5}},
    {"batch": 8, "trigger": "switch", "ended_class": "c", "scores": {"a": 3.5, "b": 2.5, "c": 1.0}},
    {"batch": 10, "trigger": "switch", "ended_class": "a", "scores": {"a": 1.0, "b": 3.0, "c": 2.0}},
    {"batch": 12, "trigger": "periodic", "ended_class": None, "scores": {"a": 1.5, "b": 3.0, "c": 2.5}},
    {"batch": 16, "trigger": "periodic", "ended_class": None, "scores": {"a": 1.0}},
]


def test_matrix_from_probe_log_takes_first_endings_only():
    matrix = matrix_from_probe_log(reversed(PROBE_LOG), ["a", "b", "c"], probe_every=4)
    # the revisit of a at batch 10 is not a stage: stages are the first endings 3, 6, 8
    assert matrix.stages == (3, 6, 8)
    assert matrix.values == LOSS3_VALUES
    assert matrix.before == (5.0, 5.0, 5.0)  # the batch-0 row
    # curve: means of periodic rows (+ batch 0, + the switch at 8 = 2*4); batch 16 lacks b and c
    #   0: 5.0;  4: (2.5+3.5+5)/3 = 11/3;  8: (3.5+2.5+1)/3 = 7/3;  12: (1.5+3+2.5)/3 = 7/3
    assert [b for b, _ in matrix.curve] == [0, 4, 8, 12]
    assert [v for _, v in matrix.curve] == approx([5.0, 11 / 3, 7 / 3, 7 / 3])
    assert matrix.notes == ("1 curve evaluations left out: not every class scored",)
    summary = forgetting_summary(matrix, reference=LOSS3_REF)
    for metric, value in LOSS3_EXPECTED.items():
        assert summary[metric] == approx(value), metric
    # AULTC: 4*(5 + 11/3)/2 + 4*(11/3 + 7/3)/2 + 4*(7/3 + 7/3)/2 = 52/3 + 12 + 28/3 = 116/3;
    # / span 12 = 29/9, negated (loss)
    assert summary["aultc"] == approx(-29 / 9)


def test_of_probe_rows_at_one_batch_the_first_read_counts():
    # as the docstring says; the before row or a curve point taken from the last row read at its batch passed
    first = [{"batch": 0, "trigger": "periodic", "ended_class": None, "scores": {"a": 5.0, "b": 5.0}},
             {"batch": 4, "trigger": "periodic", "ended_class": None, "scores": {"a": 3.0, "b": 4.0}}]
    again = [{**row, "scores": {"a": 9.0, "b": 9.0}} for row in first]
    matrix = matrix_from_probe_log(first + again, ["a", "b"])
    assert matrix.before == (5.0, 5.0) and matrix.curve == ((0, 5.0), (4, 3.5))


def test_probe_log_without_probe_every_and_last_class_unended():
    rows = [row for row in PROBE_LOG if row["ended_class"] != "c"]
    matrix = matrix_from_probe_log(rows, ["a", "b", "c"])
    # c's first fragment never ended in this log: 2 stages, c kept as a column only
    assert matrix.stages == (3, 6) and len(matrix.values[0]) == 3
    assert [b for b, _ in matrix.curve] == [0, 4, 12]  # the switch at 8 is gone with the c row
    # F = F_<=2 = F_a = max(-2) - (-3) = 1
    assert forgetting_mhamdi(matrix) == approx(1.0)
    summary = forgetting_summary(matrix)
    assert any("no stage yet" in note and "c" in note for note in summary["notes"])
    with pytest.raises(ValueError, match="first-seen order"):
        matrix_from_probe_log(PROBE_LOG, ["b", "a", "c"])


def test_probe_log_missing_middle_stage_is_a_none_row():
    rows = [row for row in PROBE_LOG if row["ended_class"] != "b"]
    matrix = matrix_from_probe_log(rows, ["a", "b", "c"])
    assert matrix.stages == (3, None, 8)
    assert matrix.values[1] == [None, None, None]
    assert any("'b' has no switch row" in note for note in matrix.notes)


def test_shape_is_checked():
    with pytest.raises(ValueError):
        ProbeMatrix(classes=("a",), stages=(1, 2), values=[[1.0], [1.0]], higher_is_better=True)
    with pytest.raises(ValueError):
        ProbeMatrix(classes=("a", "b"), stages=(1,), values=[[1.0]], higher_is_better=True)
