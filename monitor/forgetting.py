"""Task-matrix ("forgetting family") metrics of continual learning, without torch.

``R[i][j]`` is the performance on class ``j`` after training up to stage ``i``.
Classes are listed in the order they were first trained, and stage ``i`` is the
model right after class ``i``'s first fragment ended (the stream's ``i``-th true
switch), so ``R[i][i]`` is the class just learned, ``R[i][j]`` with ``j < i`` an
earlier class and ``j > i`` a class not trained yet (zero-shot).

Sign convention: every metric is computed on a score ``S`` where higher is
better. Accuracy is used as it is (``S = R``); a loss (held-out loss per class,
the stream's probe scoring) is negated (``S = -R``). So forgetting, intransigence
and -BWT are positive when things get worse for accuracy and loss alike (a rise
of the loss counts as a drop of accuracy), and the level metrics (final
performance, cur-ACC, last-ACC, AULTC) come out as minus a mean loss for language
modelling: their absolute value is the mean loss. ``before``, ``reference`` and
the AULTC curve are given in the matrix's own units and flipped the same way.

Papers (``/work/shared/seeds``): M'hamdi et al. 2023 Eq. 1-4 (forgetting F,
transfer T, zero-shot transfer T0, final performance FP); Yang et al. 2024 Eq.
1-4 (cur-ACC, last-ACC, BWT, FWT after Lopez-Paz & Ranzato); Hussain et al. Sec.
4.2 (forgetting and intransigence after Chaudhry et al. 2018, AULTC).

A value that cannot be computed is ``None`` and a note (``notes=`` list) says why;
an entry of ``R`` that is ``None`` (a class not scored) drops the terms that need
it from their average, with a note counting them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ProbeMatrix", "aultc", "bwt", "chaudhry_forgetting", "cur_acc", "final_performance",
    "forgetting_mhamdi", "forgetting_summary", "fwt", "intransigence", "last_acc",
    "matrix_from_probe_log", "probe_rows", "transfer", "zero_shot_transfer",
]

Value = float | None
PerClass = Mapping[str, Value] | Sequence[Value]


@dataclass(frozen=True)
class ProbeMatrix:
    """Per-class performance at each stage; raw units (accuracy, or loss when not higher_is_better).

    ``values[i][j]``: class ``classes[j]`` scored at stage ``i``; stage ``i`` is the end of the
    first fragment of ``classes[i]``, so there are at most as many stages as classes (a class
    whose first fragment never ended, e.g. the stream's last, has no stage; its column is kept
    but the metrics use the square block of staged classes). ``before``: the untrained model's
    values per class; ``curve``: ``(batch, mean value over all classes)`` of periodic probes.
    """

    classes: tuple[str, ...]
    stages: tuple[int | str | None, ...]
    values: list[list[Value]]
    higher_is_better: bool
    before: tuple[Value, ...] | None = None
    curve: tuple[tuple[int, float], ...] = ()
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if len(set(self.classes)) != len(self.classes):
            raise ValueError("classes must be distinct")
        if len(self.values) != len(self.stages):
            raise ValueError(f"{len(self.values)} rows of values for {len(self.stages)} stages")
        if len(self.stages) > len(self.classes):
            raise ValueError(f"{len(self.stages)} stages for {len(self.classes)} classes: one stage per class at most")
        for row in self.values:
            if len(row) != len(self.classes):
                raise ValueError(f"a row of {len(row)} values for {len(self.classes)} classes")
        if self.before is not None and len(self.before) != len(self.classes):
            raise ValueError(f"before has {len(self.before)} values for {len(self.classes)} classes")

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def score(self, value: Value) -> Value:
        """The value as a higher-is-better score (negated loss)."""
        if value is None:
            return None
        return float(value) if self.higher_is_better else -float(value)

    def scores(self) -> list[list[Value]]:
        """S: the square block (stages x staged classes) as scores."""
        n = self.n_stages
        return [[self.score(v) for v in row[:n]] for row in self.values]

    def per_class(self, given: PerClass | None, what: str) -> list[Value] | None:
        """A per-class mapping or sequence (raw units) as scores of the staged classes."""
        if given is None:
            return None
        if isinstance(given, Mapping):
            raw = [given.get(name) for name in self.classes]
        else:
            raw = list(given)
            if len(raw) != len(self.classes):
                raise ValueError(f"{what} has {len(raw)} values for {len(self.classes)} classes")
        return [self.score(v) for v in raw[:self.n_stages]]


def _mean(terms: Iterable[Value], notes: list[str] | None, metric: str) -> Value:
    """Mean of the terms that exist; a note counts the ones left out."""
    terms = list(terms)
    kept = [t for t in terms if t is not None]
    if notes is not None and len(kept) < len(terms):
        notes.append(f"{metric}: {len(terms) - len(kept)} of {len(terms)} terms left out (class not scored)")
    return math.fsum(kept) / len(kept) if kept else None


def _none(notes: list[str] | None, metric: str, why: str) -> None:
    if notes is not None:
        notes.append(f"{metric} is None: {why}")
    return None


def _diff(a: Value, b: Value) -> Value:
    return None if a is None or b is None else a - b


def _best(values: Iterable[Value]) -> Value:
    kept = [v for v in values if v is not None]
    return max(kept) if kept else None


def _stage_limit(R: ProbeMatrix, t: int | None) -> int:
    if t is None:
        return R.n_stages
    if not 1 <= t <= R.n_stages:
        raise ValueError(f"t must be in 1..{R.n_stages}, got {t}")
    return t


# --- M'hamdi et al., 000 -------------------------------------------------------------

def class_forgetting(S: list[list[Value]], i: int, j: int) -> Value:
    """F_{i,<=j} = max_{k in [1, j-1]} R_{i,<=k} - R_{i,<=j} (0-based: stages 0..j-1, then j)."""
    return _diff(_best(S[k][i] for k in range(j)), S[j][i])


# Eq. 1: F = 1/(N-1) sum_{j=2..N} F_{<=j},  F_{<=j} = 1/(j-1) sum_{i=1..j-1} F_{i,<=j},
#        F_{i,<=j} = max_{k in [1, j-1]} R_{i,<=k} - R_{i,<=j}.
def forgetting_mhamdi(R: ProbeMatrix, *, notes: list[str] | None = None) -> Value:
    """M'hamdi et al. Eq. 1: forgetting averaged over earlier classes i < j, then over stages j = 2..N."""
    S, n = R.scores(), R.n_stages
    if n < 2:
        return _none(notes, "forgetting", f"needs 2 stages, have {n}")
    per_stage = [_mean((class_forgetting(S, i, j) for i in range(j)), notes, f"forgetting F_<={j + 1}")
                 for j in range(1, n)]
    return _mean(per_stage, notes, "forgetting")


# Eq. 2: T = 1/(N-1) sum_{i=2..N} T_i,  T_i = R_{i,<=i} - R_i  (R_i: a model fine-tuned on D_i only).
def transfer(R: ProbeMatrix, reference: PerClass | None, *, notes: list[str] | None = None) -> Value:
    """M'hamdi et al. Eq. 2: diagonal minus the class's reference (single-class) score, classes 2..N."""
    ref, S, n = R.per_class(reference, "reference"), R.scores(), R.n_stages
    if n < 2:
        return _none(notes, "transfer", f"needs 2 stages, have {n}")
    if ref is None:
        return _none(notes, "transfer", "no reference score per class (a model trained on that class alone)")
    return _mean((_diff(S[i][i], ref[i]) for i in range(1, n)), notes, "transfer")


# Eq. 3: T0 = 1/(N-1) sum_{i=2..N} T0_i,  T0_i = 1/(i-1) sum_{j=1..i-1} R_{i,<=j} - R0_i
#        (R0_i: the model before any fine-tuning).
def zero_shot_transfer(R: ProbeMatrix, before: PerClass | None = None, *,
                       notes: list[str] | None = None) -> Value:
    """M'hamdi et al. Eq. 3: mean score on class i at the stages before it, minus its untrained score."""
    base = R.per_class(before if before is not None else R.before, "before")
    S, n = R.scores(), R.n_stages
    if n < 2:
        return _none(notes, "zero_shot_transfer", f"needs 2 stages, have {n}")
    if base is None:
        return _none(notes, "zero_shot_transfer", "no before row (the untrained model's scores)")
    per_class = [_diff(_mean((S[j][i] for j in range(i)), None, ""), base[i]) for i in range(1, n)]
    return _mean(per_class, notes, "zero_shot_transfer")


# Eq. 4: FP = 1/N sum_{i=1..N} R_{i,<=N}.
def final_performance(R: ProbeMatrix, *, notes: list[str] | None = None) -> Value:
    """M'hamdi et al. Eq. 4: mean over the classes of the last stage's row (equals last-ACC)."""
    if R.n_stages < 1:
        return _none(notes, "final_performance", "no stage yet")
    return _mean(R.scores()[-1], notes, "final_performance")


# --- Yang et al., 001 (Lopez-Paz & Ranzato; FWT as in the Continuum library) ----------

# Eq. 1: cur-ACC_t = 1/t sum_{i=1..t} A_{i,i}.
def cur_acc(R: ProbeMatrix, t: int | None = None, *, notes: list[str] | None = None) -> Value:
    """001 Eq. 1: mean of the diagonal up to stage t (default: all stages)."""
    if R.n_stages < 1:
        return _none(notes, "cur_acc", "no stage yet")
    S, t = R.scores(), _stage_limit(R, t)
    return _mean((S[i][i] for i in range(t)), notes, "cur_acc")


# Eq. 2: last-ACC = 1/T sum_{i=1..T} A_{T,i}.
def last_acc(R: ProbeMatrix, *, notes: list[str] | None = None) -> Value:
    """001 Eq. 2: mean of the last stage's row."""
    if R.n_stages < 1:
        return _none(notes, "last_acc", "no stage yet")
    return _mean(R.scores()[-1], notes, "last_acc")


# Eq. 3: BWT_t = 2/(t(t-1)) sum_{i=2..t} sum_{j=1..i-1} (A_{i,j} - A_{j,j}).
def bwt(R: ProbeMatrix, t: int | None = None, *, notes: list[str] | None = None) -> Value:
    """001 Eq. 3: mean over all pairs j < i <= t of (score of j at stage i - score of j just after j)."""
    if R.n_stages < 2:
        return _none(notes, "bwt", f"needs 2 stages, have {R.n_stages}")
    S, t = R.scores(), _stage_limit(R, t)
    if t < 2:
        return _none(notes, "bwt", "t must be at least 2")
    return _mean((_diff(S[i][j], S[j][j]) for i in range(1, t) for j in range(i)), notes, "bwt")


# Eq. 4: FWT_t = 1/(t-1) sum_{i=2..t} (A_{i-1,i} - Abar_i)  (Abar_i: zero-shot score of the untrained model).
def fwt(R: ProbeMatrix, before: PerClass | None = None, t: int | None = None, *,
        notes: list[str] | None = None) -> Value:
    """001 Eq. 4: score on class i at the stage just before it, minus the untrained model's score."""
    base = R.per_class(before if before is not None else R.before, "before")
    if R.n_stages < 2:
        return _none(notes, "fwt", f"needs 2 stages, have {R.n_stages}")
    if base is None:
        return _none(notes, "fwt", "no before row (the untrained model's scores)")
    S, t = R.scores(), _stage_limit(R, t)
    if t < 2:
        return _none(notes, "fwt", "t must be at least 2")
    return _mean((_diff(S[i - 1][i], base[i]) for i in range(1, t)), notes, "fwt")


# --- Chaudhry et al. 2018 as used by Hussain et al., 004 Sec. 4.2 ---------------------

# f_j^k = max_{l in 1..k-1} a_{l,j} - a_{k,j} for j < k;  F_k = 1/(k-1) sum_{j=1..k-1} f_j^k;  reported at k = N.
def chaudhry_forgetting(R: ProbeMatrix, *, notes: list[str] | None = None) -> Value:
    """Forgetting F_N: best earlier score minus final score, averaged over the classes before the last.

    (Equals M'hamdi's F_<=N. The 004 code takes the max over its dense periodic curve instead.)
    """
    S, n = R.scores(), R.n_stages
    if n < 2:
        return _none(notes, "chaudhry_forgetting", f"needs 2 stages, have {n}")
    return _mean((class_forgetting(S, j, n - 1) for j in range(n - 1)), notes, "chaudhry_forgetting")


# I_k = a*_k - a_{k,k};  I = 1/N sum_{k=1..N} I_k  (the mean over classes, as the 004 code reports it).
def intransigence(R: ProbeMatrix, reference: PerClass | None, *, notes: list[str] | None = None) -> Value:
    """Reference score minus the score right after learning the class, averaged over all classes.

    a*_k: 004 uses a model trained on class k alone (Fig. 4, its code); Chaudhry et al. a model
    trained jointly on classes 1..k. Pass whichever was measured as ``reference``.
    """
    ref, S, n = R.per_class(reference, "reference"), R.scores(), R.n_stages
    if n < 1:
        return _none(notes, "intransigence", "no stage yet")
    if ref is None:
        return _none(notes, "intransigence", "no reference score per class (single-class or joint model)")
    return _mean((_diff(ref[k], S[k][k]) for k in range(n)), notes, "intransigence")


# AULTC = (1/span) * integral of the average score over all classes, evaluated every b examples
# (trapezoid; the 004 code: sklearn.metrics.auc(x, y) / x[-1] per class, then the mean over classes).
def aultc(curve: Sequence[tuple[float, Value]], span: float | None = None, *,
          higher_is_better: bool = True, notes: list[str] | None = None) -> Value:
    """Area under the lifelong test curve over its span, ``curve = [(batch, mean score over classes)]``.

    ``span`` defaults to last batch - first batch (the 004 code divides by the last x, the same
    when the curve starts at 0). With ``higher_is_better=False`` the curve holds losses and is negated.
    """
    points = sorted((float(x), float(y)) for x, y in curve if y is not None)
    if len(points) < 2:
        return _none(notes, "aultc", f"needs 2 evaluations on the curve, have {len(points)}")
    sign = 1.0 if higher_is_better else -1.0
    area = math.fsum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))
    width = points[-1][0] - points[0][0] if span is None else float(span)
    if width <= 0:
        return _none(notes, "aultc", f"span must be positive, got {width}")
    return sign * area / width


def _per_class(R: ProbeMatrix, before: list[Value] | None, reference: list[Value] | None) -> dict:
    """Per staged class, at the last stage: forgetting (both papers' f_i^N), backward, intransigence, ..."""
    S, n, out = R.scores(), R.n_stages, {}
    for i in range(n):
        out[R.classes[i]] = {
            "stage": i + 1,
            "forgetting": class_forgetting(S, i, n - 1) if i < n - 1 else None,
            "just_learned": S[i][i],
            "final": S[n - 1][i],
            "backward": _diff(S[n - 1][i], S[i][i]) if i < n - 1 else None,
            "forward": _diff(S[i - 1][i], before[i]) if i > 0 and before else None,
            "zero_shot_transfer": (_diff(_mean((S[j][i] for j in range(i)), None, ""), before[i])
                                   if i > 0 and before else None),
            "intransigence": _diff(reference[i], S[i][i]) if reference else None,
        }
    return out


def forgetting_summary(matrix: ProbeMatrix, *, before: PerClass | None = None, reference: PerClass | None = None,
                       curve: Sequence[tuple[float, Value]] | None = None, span: float | None = None) -> dict:
    """Every metric of this module, ``per_class`` (for streamer_forgetting{class}) and ``notes``.

    ``before`` defaults to ``matrix.before`` and ``curve`` to ``matrix.curve`` (both raw units).
    A per-class ``forgetting`` is None for the last staged class (no later stage yet).
    """
    notes: list[str] = list(matrix.notes)
    before = before if before is not None else matrix.before
    curve = curve if curve is not None else matrix.curve
    unstaged = matrix.classes[matrix.n_stages:]
    if unstaged:
        notes.append(f"classes with no stage yet (first fragment not ended), left out: {', '.join(unstaged)}")
    base, ref = matrix.per_class(before, "before"), matrix.per_class(reference, "reference")
    return {
        "score": "value" if matrix.higher_is_better else "-loss",
        "n_stages": matrix.n_stages,
        "forgetting": forgetting_mhamdi(matrix, notes=notes),
        "transfer": transfer(matrix, reference, notes=notes),
        "zero_shot_transfer": zero_shot_transfer(matrix, before, notes=notes),
        "final_performance": final_performance(matrix, notes=notes),
        "bwt": bwt(matrix, notes=notes),
        "fwt": fwt(matrix, before, notes=notes),
        "cur_acc": cur_acc(matrix, notes=notes),
        "last_acc": last_acc(matrix, notes=notes),
        "chaudhry_forgetting": chaudhry_forgetting(matrix, notes=notes),
        "intransigence": intransigence(matrix, reference, notes=notes),
        "aultc": aultc(curve, span, higher_is_better=matrix.higher_is_better, notes=notes),
        "per_class": _per_class(matrix, base, ref),
        "notes": notes,
    }


def probe_rows(probe_log: Path) -> Iterator[dict]:
    """The rows of probes.jsonl, one at a time (a run left for weeks probes at every switch); a last line torn
    by a crash is left out, as a resume drops it (the report failed with a bare JSON error); a bad line
    before it is a ValueError naming the file and line."""
    with probe_log.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                if not line.endswith("\n"):  # (only the last line can lack one)
                    return
                raise ValueError(f"{probe_log}:{number}: not JSON ({exc})") from None
            yield row


def matrix_from_probe_log(rows: Iterable[Mapping], classes_in_first_seen_order: Sequence[str],
                          higher_is_better: bool = False, *, probe_every: int | None = None) -> ProbeMatrix:
    """The ProbeMatrix of a probes.jsonl log written by streamer.learner.

    Each row is ``{"batch", "trigger": "switch"|"periodic", "ended_class", "scores": {class: loss}}``,
    ``batch`` being the number of batches learned before the probe. The stage of a class is the
    FIRST switch row whose ``ended_class`` is that class (later endings, revisits, are not stages).
    A row at batch 0 (the untrained model) gives ``before``. The curve is the periodic rows, the
    batch-0 row and, with ``probe_every``, the switch rows at a multiple of it (the learner labels a
    probe "switch" when both apply); each point is the mean over all classes (skipped if one is missing).
    The rows may come in any order and are read once, one at a time (a weeks-long run's log is not held):
    of rows at one batch, the first read counts.
    """
    classes = tuple(classes_in_first_seen_order)
    notes: list[str] = []
    stage_rows: dict[str, Mapping] = {}
    before, curve, skipped = None, {}, 0
    for row in rows:
        batch, trigger, scores = int(row["batch"]), row.get("trigger"), row.get("scores") or {}
        if batch == 0 and before is None:
            before = tuple(scores.get(name) for name in classes)
        ended = row.get("ended_class")
        if trigger == "switch" and ended is not None:
            if ended not in classes:
                notes.append(f"switch at batch {batch}: ended class {ended!r} is not in the class list")
            elif ended not in stage_rows or batch < int(stage_rows[ended]["batch"]):
                stage_rows[ended] = row
        on_grid = trigger == "periodic" or batch == 0 or (
            probe_every and trigger == "switch" and batch % probe_every == 0)
        if on_grid and batch not in curve:
            values = [scores.get(name) for name in classes]
            if classes and all(v is not None for v in values):
                curve[batch] = math.fsum(values) / len(values)
            else:
                skipped += 1
    if skipped:
        notes.append(f"{skipped} curve evaluations left out: not every class scored")
    n_stages = max((classes.index(name) + 1 for name in stage_rows), default=0)
    stages, values, latest = [], [], -1
    for name in classes[:n_stages]:
        row = stage_rows.get(name)
        if row is None:
            notes.append(f"class {name!r} has no switch row ending its first fragment: its stage is all None")
        elif int(row["batch"]) < latest:
            raise ValueError(f"class {name!r} first ended at batch {row['batch']}, before a class listed "
                             "ahead of it: classes must be in first-seen order")
        else:
            latest = int(row["batch"])
        stages.append(None if row is None else int(row["batch"]))
        scores = {} if row is None else row.get("scores") or {}
        values.append([scores.get(other) for other in classes])
    return ProbeMatrix(classes=classes, stages=tuple(stages), values=values, higher_is_better=higher_is_better,
                       before=before, curve=tuple(sorted(curve.items())), notes=tuple(notes))
