"""DMI, the Dual-transfer Matching Index (seed 001, Sec. 3.1, Eq. 5-7), from probe representations.

At stage i (the model right after task i), the representations x^(i) of all N probe
utterances are clustered by k-means into K clusters, K = the number of distinct labels
among them (Eq. 5). The Hungarian algorithm maps clusters one-to-one onto labels so that
the most utterances agree (maximum matching; scipy's linear_sum_assignment). A[i][j] is
the share of task j's utterances whose matched cluster label is their true label (Eq. 6):
a class-agnostic accuracy that exists for tasks not learned yet. Then (Eq. 7)

    DMI_stab = mean of A[i][j] over j < i   (2 / (T (T - 1)) times the lower-triangle sum)
    DMI_plas = mean of A[i][i]
    DMI_gen  = mean of A[i][j] over j > i

In a stream a task is a class (language or domain), in first-seen order, and stage i is
the probe taken when task i's first fragment ended (the end-of-run probe for a task whose
first fragment closes the stream). Task j's utterances are the probe utterances of class j;
when tasks share labels (the same intents in every language) each utterance still counts
for its own task only. k-means is seeded (k-means++ starts, `n_init` restarts, the lowest
inertia kept), so a run's DMI is reproducible. Torch-free: numpy and scipy.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from scipy.cluster.vq import kmeans2
from scipy.optimize import linear_sum_assignment

from monitor.forgetting import probe_rows

__all__ = ["FEATURES_DIR", "kmeans", "matched_correct", "dmi_matrix", "dmi_scores", "dmi", "dmi_from_run"]

FEATURES_DIR = "probe_features"  # streamer.classifier_probe writes batch-<batch>.npz here


def kmeans(x: np.ndarray, k: int, *, seed: int = 0, n_init: int = 10, iterations: int = 100) -> np.ndarray:
    """Cluster index per row of x (N, D): k-means++ starts, Lloyd iterations, best of n_init by inertia."""
    x = np.asarray(x, dtype=np.float64)
    if not 1 <= k <= len(x):
        raise ValueError(f"k must be in 1..{len(x)} (the number of samples), got {k}")
    rng = np.random.default_rng(seed)
    best, best_inertia = None, math.inf
    for _ in range(n_init):
        with warnings.catch_warnings():  # an emptied cluster keeps its centroid; another restart may do better
            warnings.simplefilter("ignore")
            centroids, assignment = kmeans2(x, k, iter=iterations, minit="++", seed=rng)
        inertia = float(((x - centroids[assignment]) ** 2).sum())
        if inertia < best_inertia:
            best, best_inertia = assignment, inertia
    return best


def matched_correct(assignment: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per sample, whether its cluster's matched label is its label (Hungarian maximum matching)."""
    clusters, cluster_index = np.unique(assignment, return_inverse=True)
    names, label_index = np.unique(labels, return_inverse=True)
    counts = np.zeros((len(clusters), len(names)), dtype=np.int64)
    np.add.at(counts, (cluster_index, label_index), 1)
    rows, cols = linear_sum_assignment(counts, maximize=True)
    mapped = np.full(len(clusters), -1)
    mapped[rows] = cols
    return mapped[cluster_index] == label_index


def dmi_matrix(stages: Sequence[np.ndarray | None], tasks: np.ndarray, labels: np.ndarray,
               task_order: Sequence[str], *, seed: int = 0, n_init: int = 10) -> list[list[float | None]]:
    """A[i][j] for every stage i (representations (N, D) or None: not scored) and task j in task_order."""
    tasks, labels = np.asarray(tasks), np.asarray(labels)
    k = len(np.unique(labels))
    matrix = []
    for x in stages:
        if x is None:
            matrix.append([None] * len(task_order))
            continue
        correct = matched_correct(kmeans(x, min(k, len(x)), seed=seed, n_init=n_init), labels)
        matrix.append([float(correct[tasks == task].mean()) if (tasks == task).any() else None
                       for task in task_order])
    return matrix


def _mean(values) -> float | None:
    kept = [v for v in values if v is not None]
    return math.fsum(kept) / len(kept) if kept else None


def dmi_scores(matrix: Sequence[Sequence[float | None]]) -> dict:
    """Stability, plasticity, generalizability (Eq. 7) of the square block of T stages x T tasks."""
    n = len(matrix)
    block = [list(row[:n]) for row in matrix]
    return {
        "stability": _mean(block[i][j] for i in range(n) for j in range(i)),
        "plasticity": _mean(block[i][i] for i in range(n)),
        "generalizability": _mean(block[i][j] for i in range(n) for j in range(i + 1, n)),
    }


def dmi(stages: Sequence[np.ndarray | None], tasks: np.ndarray, labels: np.ndarray, task_order: Sequence[str],
        *, seed: int = 0, n_init: int = 10) -> dict:
    """DMI from representations per stage (stage i = after task_order[i]) with the matrix behind it."""
    matrix = dmi_matrix(stages, tasks, labels, task_order, seed=seed, n_init=n_init)
    return {**dmi_scores(matrix), "matrix": matrix, "tasks": list(task_order), "samples": int(len(labels)),
            "clusters": int(min(len(np.unique(labels)), len(labels)))}


def _stage_rows(rows: Iterable[dict], order: list[str]) -> dict[str, dict]:
    """Per task, the first probe row that ended it (a true switch, or the end of the run); read once."""
    stages: dict[str, dict] = {}
    for row in rows:
        ended = row.get("ended_class")
        if row.get("trigger") in ("switch", "end") and ended in order and (
                ended not in stages or row["batch"] < stages[ended]["batch"]):
            stages[ended] = row
    return stages


def dmi_from_run(run_dir: str | Path, records: Sequence[Mapping], *, seed: int = 0) -> dict | None:
    """DMI of a classifier run from its probes.jsonl and probe_features/*.npz; None when it saved none."""
    run_dir = Path(run_dir)
    probe_log, features = run_dir / "probes.jsonl", run_dir / FEATURES_DIR
    if not probe_log.is_file() or not features.is_dir():
        return None
    order = list(dict.fromkeys(r["domain_name"] for r in records))
    stage_rows = _stage_rows(probe_rows(probe_log), order)  # (a torn last row, a kill -9's, is left out)
    notes = []
    n_stages = max((order.index(name) + 1 for name in stage_rows), default=0)
    if n_stages == 0:
        return {"stability": None, "plasticity": None, "generalizability": None, "matrix": [], "tasks": order,
                "stages": [], "notes": ["no probe row ended a task: no stage to evaluate"]}
    stages, batches, tasks, labels = [], [], None, None
    for name in order[:n_stages]:
        row = stage_rows.get(name)
        path = None if row is None else features / f"batch-{int(row['batch']):08d}.npz"
        if path is None or not path.is_file():
            notes.append(f"task {name!r}: no saved representations at the end of its first fragment")
            stages.append(None)
            batches.append(None)
            continue
        with np.load(path) as saved:
            stages.append(saved["features"])
            tasks, labels = saved["classes"], saved["labels"]
        batches.append(int(row["batch"]))
    if tasks is None:
        return {"stability": None, "plasticity": None, "generalizability": None, "matrix": [], "tasks": order,
                "stages": batches, "notes": notes}
    result = dmi(stages, tasks, labels, order, seed=seed)
    if n_stages < len(order):
        notes.append(f"{len(order) - n_stages} task(s) never ended a first fragment: DMI uses the first "
                     f"{n_stages} tasks")
    per_task = {name: int((tasks == name).sum()) for name in order}
    labels_per_task = {name: len(set(labels[tasks == name].tolist())) for name in order}
    if min(per_task.values(), default=0) < 2 * max(labels_per_task.values(), default=0):
        notes.append("few probe utterances per label (fewer than 2 per label in some task): the clustering "
                     "accuracies are noisy; raise --probe-examples")
    result.update(stages=batches, probe_utterances=per_task, labels_per_task=labels_per_task, notes=notes)
    return result
