"""Which class comes when: the class orders and fragment lengths of each schedule.

All draws come from one seeded numpy Generator, so a seed fixes the stream.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ScheduleError", "SCHEDULES", "SEQUENCE_ORDERS", "calm_lengths", "calm_order",
           "sequence_order", "balanced_permutations", "recurring_order"]

SCHEDULES = ("calm", "sequence", "recurring", "independent")
SEQUENCE_ORDERS = ("given", "h2l", "l2h", "permutation")


class ScheduleError(ValueError):
    pass


def calm_lengths(n: int, mean_chunks: float, rng: np.random.Generator) -> list[int]:
    """CALM's fragment lengths in chunks: truncated exponential on [0.1 s, 10.1 s], scale s,
    rounded, at least one chunk (realised mean about 1.1 s)."""
    u = rng.random(n)
    draws = 0.1 * mean_chunks - mean_chunks * np.log1p(-u * (1.0 - np.exp(-10.0)))
    return [int(x) for x in np.maximum(1, np.rint(draws))]


def _fix_repeats(order: list[str], rng: np.random.Generator) -> list[str]:
    for _ in range(100 * max(1, len(order))):
        repeats = [i for i in range(1, len(order)) if order[i] == order[i - 1]]
        if not repeats:
            return order
        i, j = repeats[0], int(rng.integers(len(order)))
        order[i], order[j] = order[j], order[i]
    raise ScheduleError("could not order the classes without repeats; use more classes or fragments")


def calm_order(classes: list[str], n_fragments: int, rng: np.random.Generator) -> list[str]:
    """Balanced, shuffled, with no class twice in a row (CALM)."""
    if len(classes) < 2 and n_fragments > 1:
        raise ScheduleError("a CALM stream needs at least two classes")
    order = [classes[i % len(classes)] for i in range(n_fragments)]
    rng.shuffle(order)
    return _fix_repeats(order, rng)


def balanced_permutations(classes: list[str]) -> list[list[str]]:
    """N orders of N classes with every class in every position once (a cyclic Latin square)."""
    n = len(classes)
    return [[classes[(start + k) % n] for k in range(n)] for start in range(n)]


def sequence_order(classes: list[str], how: str, sizes: dict[str, int], *, given=(), permutation: int = 0):
    """Each class once: in the given order, by size high-to-low or low-to-high, or the
    `permutation`-th of the balanced permutations."""
    if how == "given":
        unknown = [c for c in given if c not in classes]
        if unknown or sorted(given) != sorted(classes):
            raise ScheduleError(f"--given-order must name each class once ({', '.join(classes)}); "
                                f"got {', '.join(given) or 'nothing'}"
                                + (f", unknown {', '.join(unknown)}" if unknown else ""))
        return list(given)
    if how in ("h2l", "l2h"):
        return sorted(classes, key=lambda c: (-sizes[c], c) if how == "h2l" else (sizes[c], c))
    if how == "permutation":
        orders = balanced_permutations(classes)
        if not 0 <= permutation < len(orders):
            raise ScheduleError(f"--permutation must be in 0..{len(orders) - 1}, got {permutation}")
        return orders[permutation]
    raise ScheduleError(f"unknown sequence order {how!r}; choose from {', '.join(SEQUENCE_ORDERS)}")


def recurring_order(classes: list[str], repeats: int, rng: np.random.Generator) -> list[str]:
    """R rounds, each a seeded permutation of all classes, no class twice in a row."""
    if len(classes) < 2:
        raise ScheduleError("a recurring stream needs at least two classes")
    order: list[str] = []
    for _ in range(repeats):
        round_ = list(classes)
        rng.shuffle(round_)
        if order and round_[0] == order[-1]:
            round_[0], round_[-1] = round_[-1], round_[0]
        order += round_
    return order
