"""Sums over a stream in O(1) memory, each with its count and mean: the CALM bookkeeping of monitor.calm adds
losses and intensities into them.

:class:`ExactSum` is ``math.fsum`` bit for bit (the offline metrics, equal to the CALM authors' code);
:class:`CompensatedSum` is a Neumaier sum whose state is three plain numbers (the live tracker's, which a
checkpoint carries). Both have ``count``, ``add(x)`` and ``mean()``.
"""

from __future__ import annotations

import math

__all__ = ["CompensatedSum", "ExactSum"]


class ExactSum:
    """``math.fsum`` over a stream in O(1) memory: Shewchuk's non-overlapping partials (the algorithm
    inside ``math.fsum``), so :meth:`value` equals ``math.fsum`` of every value added, bit for bit."""

    __slots__ = ("count", "_partials", "_specials", "_overflowed")

    def __init__(self) -> None:
        self.count = 0
        self._partials: list[float] = []
        self._specials: list[float] = []  # inf, -inf, nan: at most one of each
        self._overflowed = False  # finite values whose partial sum overflowed: fsum raises

    def add(self, x: float) -> None:
        self.count += 1
        if self._overflowed:
            return
        if not math.isfinite(x):
            if not any(x == s or (x != x and s != s) for s in self._specials):
                self._specials.append(x)
            self._partials.clear()  # as fsum: the specials decide the sum, later finite values may still overflow
            return
        partials, i = self._partials, 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            high = x + y
            low = y - (high - x)
            if low:
                partials[i] = low
                i += 1
            x = high
        partials[i:] = [x]
        self._overflowed = not math.isfinite(x)

    def value(self) -> float:
        """The correctly rounded sum (``math.fsum`` raises on inf + -inf and on an intermediate overflow,
        as here)."""
        if self._overflowed:
            raise OverflowError("intermediate overflow in fsum")
        return math.fsum(self._partials + self._specials)

    def mean(self) -> float | None:
        return self.value() / self.count if self.count else None


class CompensatedSum:
    """Count and Neumaier-compensated sum, so a mean over a long stream stays exact to rounding."""

    __slots__ = ("count", "_sum", "_compensation")

    def __init__(self) -> None:
        self.count = 0
        self._sum = 0.0
        self._compensation = 0.0

    def add(self, value: float) -> None:
        total = self._sum + value
        if math.isfinite(total):
            if abs(self._sum) >= abs(value):
                self._compensation += (self._sum - total) + value
            else:
                self._compensation += (value - total) + self._sum
        self._sum = total
        self.count += 1

    def mean(self) -> float | None:
        return (self._sum + self._compensation) / self.count if self.count else None

    def state(self) -> list:
        """``[count, sum, compensation]``, the form a checkpoint holds."""
        return [self.count, self._sum, self._compensation]

    @classmethod
    def from_state(cls, state: list) -> "CompensatedSum":
        restored = cls()
        restored.count, restored._sum, restored._compensation = state
        return restored
