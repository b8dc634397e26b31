"""Schedules: distributions, orders, independence, probe splits, loops and the truth sidecar."""

import asyncio
import itertools
import json
import math

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer

from producers.orders import (ScheduleError, balanced_permutations, calm_lengths, recurring_order,
                              sequence_order)
from producers.schedule import Schedule, build_stream, plan_streams, split_probe
from producers.stream import looped, prepare_stream, produce_stream

CLASSES = ["cs", "de", "en", "es", "fr"]


def numbered_corpus(lines=600):
    """Every line unique, so a held-out line can be looked for in the stream."""
    return {c: "\n".join(f"{c} line {i} žluťoučký" for i in range(lines)) for c in CLASSES[:3]}


def test_calm_lengths_pass_a_kolmogorov_smirnov_test_against_the_shifted_truncated_exponential():
    s = 40.0
    draws = np.sort(np.array(calm_lengths(5000, s, np.random.default_rng(7)), dtype=float))
    # rounding to integers: compare against the CDF of the rounded variable at each integer
    def cdf(x):  # P(rint(X) <= x), X ~ loc 0.1 s + truncated exponential(scale s) on [0, 10 s]
        upper = x + 0.5 - 0.1 * s
        if upper <= 0:
            return 0.0
        return min(1.0, (1 - math.exp(-upper / s)) / (1 - math.exp(-10.0)))
    n = len(draws)
    values = np.unique(draws)
    at_or_below = np.searchsorted(draws, values, side="right") / n
    below = np.searchsorted(draws, values, side="left") / n
    d = max(max(abs(a - cdf(v)), abs(b - cdf(v - 1))) for v, a, b in zip(values, at_or_below, below))
    assert d < 1.36 / math.sqrt(n)  # 5% critical value (conservative for a discrete distribution)
    assert abs(draws.mean() - 1.1 * s) < 0.05 * s


def test_balanced_permutations_put_every_class_in_every_position_once():
    orders = balanced_permutations(CLASSES)
    assert len(orders) == len(CLASSES)
    for position in range(len(CLASSES)):
        assert sorted(order[position] for order in orders) == CLASSES
    assert all(sorted(order) == CLASSES for order in orders)


def test_sequence_orders():
    sizes = {"cs": 3, "de": 5, "en": 9, "es": 1, "fr": 7}
    assert sequence_order(CLASSES, "h2l", sizes) == ["en", "fr", "de", "cs", "es"]
    assert sequence_order(CLASSES, "l2h", sizes) == ["es", "cs", "de", "fr", "en"]
    assert sequence_order(CLASSES, "given", sizes, given=["fr", "en", "de", "es", "cs"])[0] == "fr"
    with pytest.raises(ScheduleError, match="each class once"):
        sequence_order(CLASSES, "given", sizes, given=["fr", "en"])
    with pytest.raises(ScheduleError, match="0..4"):
        sequence_order(CLASSES, "permutation", sizes, permutation=5)


def test_recurring_visits_each_class_r_times_never_twice_in_a_row():
    for seed in range(20):
        order = recurring_order(CLASSES, 3, np.random.default_rng(seed))
        assert sorted(order) == sorted(CLASSES * 3)
        assert all(a != b for a, b in zip(order, order[1:]))


@pytest.mark.parametrize("kind", ["sequence", "recurring", "independent"])
def test_every_schedule_cuts_fragments_of_lambda_tokens_over_all_streams(kind):
    """lambda (mean_tokens) counts tokens over all b streams: a fragment is about lambda / (b w) windows (CALM's
    draws average 1.1 times their scale). Only calm's lengths were checked: recurring's, sequence's or
    independent's scaled by lambda / w (b times too long) passed the suite."""
    schedule = Schedule(kind=kind, n_fragments=1000, mean_tokens=6000, streams=3, window=10, repeats=600, seed=0,
                        order="h2l")
    plans = plan_streams(schedule, CLASSES, dict(zip(CLASSES, range(5))), np.random.default_rng(0))
    lengths = [n for plan in plans for _, n in plan[:-1]]  # (independent: each stream's last is cut to the shortest)
    if kind == "sequence":  # each class once, lambda / (b w) windows each
        assert [n for _, n in plans[0]] == [200] * 5
    else:
        assert abs(np.mean(lengths) - 1.1 * 200) < 0.1 * 1.1 * 200


@pytest.mark.parametrize("kind", ["calm", "sequence", "recurring", "independent"])
def test_every_schedule_is_reproducible_and_leaks_no_class_information(kind):
    corpus = numbered_corpus()
    schedule = Schedule(kind=kind, n_fragments=6, mean_tokens=900, streams=3, window=10, seed=1,
                        order="h2l", probe_tokens=300)
    a, manifest = build_stream(corpus, schedule)
    b, _ = build_stream(corpus, schedule)
    assert a == b
    c, _ = build_stream(corpus, Schedule(**{**schedule.__dict__, "seed": 2}))
    assert kind == "sequence" or a != c
    for record in a:  # values are the class's own text or padding spaces, nothing else
        piece = record.text.strip()
        assert not piece or piece in corpus[record.truth.class_name] or record.text == "\n"
    streamed = {name: "".join(r.text for r in a if r.truth.class_name == name) for name in corpus}
    for name, probe in manifest["probe"]["classes"].items():
        held_out = probe["text"].splitlines()
        assert held_out and all(line not in streamed[name] for line in held_out)


def test_independent_streams_switch_at_different_moments():
    schedule = Schedule(kind="independent", n_fragments=8, mean_tokens=600, streams=3, window=10, seed=3)
    records, manifest = build_stream(numbered_corpus(), schedule)
    starts = [{f["start_batch"] for f in stream[1:]} for stream in manifest["stream_fragments"]]
    assert starts[0] != starts[1] or starts[1] != starts[2]
    totals = {sum(f["n_batches"] for f in stream) for stream in manifest["stream_fragments"]}
    assert totals == {manifest["total_batches"]}
    # numbered in the order they start, 0..N-1 over all streams (numbered k*b + s, N/2 was not the middle of
    # the stream: a stream of long fragments stopped at small numbers while another's went on)
    fragments = sorted((f["start_batch"], f["index"]) for stream in manifest["stream_fragments"] for f in stream)
    assert [index for _, index in fragments] == list(range(manifest["n_fragments"]))
    assert {r.truth.fragment for r in records} == set(range(manifest["n_fragments"]))
    for stream in manifest["stream_fragments"]:
        classes = [f["class"] for f in stream]
        assert all(x != y for x, y in zip(classes, classes[1:]))


def test_probe_split_takes_whole_lines_from_the_end():
    text = "\n".join(f"line {i}" for i in range(100))
    kept, probe = split_probe(text, 50)
    assert kept + "\n" + probe == text
    assert probe.startswith("line ") and len(probe.encode()) >= 40
    with pytest.raises(ScheduleError, match="half"):
        split_probe("short text", 100)


def test_loop_continues_positions_and_fragments(tmp_path):
    schedule = Schedule(n_fragments=3, mean_tokens=300, streams=2, window=10, seed=0)
    records, manifest = prepare_stream(_write(tmp_path, numbered_corpus()), schedule, tmp_path / "m.json")
    two_laps = list(itertools.islice(looped(records, manifest), 2 * len(records)))
    lap = len(records)
    for first, second in zip(two_laps[:lap], two_laps[lap:]):
        assert second.text == first.text
        assert second.truth.fragment == first.truth.fragment + 3
        per_stream = sum(len(r.text.encode()) for r in records if r.stream == first.stream)
        assert second.truth.position == first.truth.position + per_stream
    assert json.loads((tmp_path / "m.json").read_text())["probe"]["classes"] == {}


def _write(tmp_path, corpus):
    directory = tmp_path / "corpus"
    directory.mkdir()
    for name, text in corpus.items():
        (directory / f"{name}.txt").write_text(text, encoding="utf-8")
    return directory


def test_probe_files_are_written_beside_the_manifest(tmp_path):
    schedule = Schedule(n_fragments=3, mean_tokens=300, streams=2, window=10, probe_tokens=200)
    _, manifest = prepare_stream(_write(tmp_path, numbered_corpus()), schedule, tmp_path / "s.json")
    saved = json.loads((tmp_path / "s.json").read_text())["probe"]
    assert saved["dir"].endswith("s.probe") and set(saved["classes"]) == {"cs", "de", "en"}
    for name, probe in saved["classes"].items():
        assert "text" not in probe
        assert (tmp_path / "s.probe" / probe["file"]).read_text().startswith(f"{name} line ")


def test_truth_sidecar_announces_every_fragment_of_every_stream(broker):
    schedule = Schedule(n_fragments=4, mean_tokens=300, streams=2, window=10, seed=5)
    records, manifest = build_stream(numbered_corpus(), schedule)
    asyncio.run(produce_stream(records, broker.bootstrap_servers, "sidecar"))

    async def read():
        consumer = AIOKafkaConsumer("sidecar.truth", bootstrap_servers=broker.bootstrap_servers,
                                    auto_offset_reset="earliest", group_id="truth-reader")
        await consumer.start()
        try:
            batch = await consumer.getmany(timeout_ms=5000)
            return [json.loads(m.value) for ms in batch.values() for m in ms]
        finally:
            await consumer.stop()
    events = asyncio.run(read())
    expected = {(str(s), f["index"], f["class"]) for f in manifest["fragments"] for s in range(2)}
    assert {(e["stream"], e["fragment"], e["class_name"]) for e in events} == expected


def test_a_jsonl_file_of_utterances_streams_one_labelled_utterance_per_record(tmp_path):
    path = tmp_path / "utterances.jsonl"
    lines = [{"text": f"turn on the light number {i}", "class": "en", "label": "HassTurnOn"} for i in range(300)]
    lines += [{"text": f"allume la lumière numéro {i}", "class": "fr", "label": "HassTurnOff"} for i in range(300)]
    path.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines), encoding="utf-8")
    schedule = Schedule(n_fragments=6, mean_tokens=40, streams=2, window=10, seed=3)
    records, manifest = prepare_stream(path, schedule, tmp_path / "u.json", probe_examples=20)
    assert manifest["classes"] == ["en", "fr"] and manifest["level"] == "utterance"
    texts = {x["text"]: x for x in lines}
    for record in records:  # one utterance per record, its label and class in the headers
        source = texts[record.text.rstrip("\n")]
        assert record.truth.label == source["label"] and record.truth.class_name == source["class"]
    per_fragment = {}
    for record in records:
        per_fragment[record.truth.fragment] = per_fragment.get(record.truth.fragment, 0) + 1
    assert per_fragment == {f["index"]: 2 * f["n_utterances"] for f in manifest["fragments"]}
    held_out = set((tmp_path / "u.probe" / "en.txt").read_text().splitlines())
    assert len(held_out) == 20 and not held_out & {r.text.rstrip("\n") for r in records}
    as_text, text_manifest = prepare_stream(path, schedule, None, utterances=False)
    assert text_manifest["level"] == "byte" and all(r.truth.label is None for r in as_text)


def test_a_stream_too_large_for_memory_is_one_line_before_it_is_built(tmp_path):
    """Every record is made before the first is sent: --fragments 100000000 took 1.2 GB in 25 s without a
    word, on its way to exhausting the machine."""
    import time

    from tests.conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    started = time.monotonic()
    with pytest.raises(ScheduleError, match=r"^a stream of 100,000,000 fragments of about 2,000 tokens would take "
                                            r"about [\d,]+ GB of memory to build .* give fewer --fragments or a "
                                            r"smaller --lambda$"):
        prepare_stream(corpus, Schedule(n_fragments=100_000_000, mean_tokens=2000, streams=2, window=10))
    assert time.monotonic() - started < 10
    records, _ = prepare_stream(corpus, Schedule(n_fragments=4, mean_tokens=200, streams=2, window=10))
    assert records  # (a stream of the usual size is built)


def test_a_word_level_corpus_counts_lambda_in_words_and_a_learner_rebuilds_the_same_stream(tmp_path):
    """Lambda of a word-level corpus is in words: 2 words at 16 bytes / 5 words = 3.2 bytes a word is
    round(6.4) = 6 bytes, 2 windows of 3. The manifest keeps 3.2, which records_from_manifest divides by to
    rebuild the producer's stream (stored as 1.0, it rebuilt 19 bytes a fragment: another stream)."""
    from streamer.multitask import records_from_manifest

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(json.dumps({"level": "word"}))
    (corpus / "a.txt").write_text("ab cd efg", encoding="utf-8")  # 9 bytes, 3 words
    (corpus / "b.txt").write_text("hij klm", encoding="utf-8")  # 7 bytes, 2 words
    schedule = Schedule(kind="sequence", order="given", given_order=("a", "b"), streams=1, window=3, mean_tokens=2)
    records, manifest = prepare_stream(corpus, schedule, tmp_path / "m.json")
    assert (manifest["corpus_level"], manifest["bytes_per_corpus_token"], manifest["mean_tokens"]) == ("word", 3.2, 6)
    assert [f["n_batches"] for f in manifest["fragments"]] == [2, 2]
    assert "".join(r.text for r in records) == "ab cd " + "hij kl" + "\n"
    assert records_from_manifest(json.loads((tmp_path / "m.json").read_text())) == records


def test_a_built_corpus_whose_manifest_names_no_level_is_bytes(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text("{}")
    (corpus / "a.txt").write_text("ab cd efg", encoding="utf-8")
    (corpus / "b.txt").write_text("hij klm", encoding="utf-8")
    schedule = Schedule(kind="sequence", order="given", given_order=("a", "b"), streams=1, window=3, mean_tokens=6)
    _, manifest = prepare_stream(corpus, schedule)
    assert (manifest["corpus_level"], manifest["mean_tokens"], manifest["bytes_per_corpus_token"]) == ("byte", 6, 1.0)


def _memory_bytes():
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("kind, fragments, window, share", [
    ("calm", 4, 10, 0.3),  # 4 fragments x lambda x 1.1 / w records of 1,000 bytes: 0.3 of the memory
    ("sequence", 1000, 10, 0.3),  # a sequence has a fragment a class (3), whatever --fragments says
    ("calm", 4, 1, 0.45),  # (w = 1: a record a byte)
])
def test_a_stream_that_fits_in_half_the_memory_is_not_refused(tmp_path, kind, fragments, window, share):
    """The guard's estimate is checked where its errors would refuse a user's stream: the schedule's own
    refusal (a negative seed, raised by build_stream after the guard, before any record is made) is what a
    stream that fits gets; the guard's line is what one of 0.6 of the memory gets."""
    from tests.conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    counted = 3 if kind == "sequence" else fragments
    for part, refused in ((share, False), (0.6, True)):
        mean = round(part * _memory_bytes() / (counted * 1.1 / window * 1000))
        schedule = Schedule(kind=kind, n_fragments=fragments, mean_tokens=mean, streams=2, window=window, seed=-1)
        with pytest.raises(ScheduleError, match="GB of memory" if refused else "seed must be >= 0"):
            prepare_stream(corpus, schedule)


def test_the_manifest_gives_each_probe_file_its_size_and_sha256(tmp_path):
    import hashlib

    schedule = Schedule(n_fragments=3, mean_tokens=300, streams=2, window=10, probe_tokens=200)
    prepare_stream(_write(tmp_path, numbered_corpus()), schedule, tmp_path / "s.json")
    saved = json.loads((tmp_path / "s.json").read_text())["probe"]["classes"]
    for probe in saved.values():
        data = (tmp_path / "s.probe" / probe["file"]).read_bytes()
        assert (probe["bytes"], probe["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
