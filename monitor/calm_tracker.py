"""The CALM metrics of monitor.calm, live: updated one batch at a time in O(classes) memory.

The tracker's state is plain values (``state_dict``/``load_state_dict``), so a checkpoint
can carry it and a resumed tracker continues with exactly the numbers of an uninterrupted one.
"""

from __future__ import annotations

import math

from monitor.calm import Summary, calm_result, check_params

__all__ = ["CalmTracker"]


class _RunningMean:
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

    @property
    def mean(self) -> float | None:
        return (self._sum + self._compensation) / self.count if self.count else None

    def state(self) -> list:
        return [self.count, self._sum, self._compensation]

    @classmethod
    def from_state(cls, state: list) -> "_RunningMean":
        running = cls()
        running.count, running._sum, running._compensation = state
        return running


class _ClassState:
    __slots__ = ("name", "loss", "n_fragments", "intensity", "rec_total", "previous_mean")

    def __init__(self, name: str) -> None:
        self.name = name
        self.loss = _RunningMean()
        self.n_fragments = 0
        self.intensity = _RunningMean()  # count = number of finalized revisits
        self.rec_total = 0
        self.previous_mean: float | None = None

    def summary(self) -> Summary:
        n_revisits = self.intensity.count
        return Summary(
            name=self.name,
            loss=self.loss.mean,
            n_batches=self.loss.count,
            n_fragments=self.n_fragments,
            n_revisits=n_revisits,
            intensity=self.intensity.mean,
            rec=self.rec_total / n_revisits if n_revisits else None,
        )

    def state(self) -> dict:
        return {"name": self.name, "loss": self.loss.state(), "n_fragments": self.n_fragments,
                "intensity": self.intensity.state(), "rec_total": self.rec_total, "previous_mean": self.previous_mean}

    @classmethod
    def from_state(cls, state: dict) -> "_ClassState":
        restored = cls(state["name"])
        restored.loss, restored.intensity = _RunningMean.from_state(state["loss"]), _RunningMean.from_state(state["intensity"])
        restored.n_fragments, restored.rec_total = state["n_fragments"], state["rec_total"]
        restored.previous_mean = state["previous_mean"]
        return restored


class _OpenFragment:
    """The fragment being received: its mean, its first-k mean and its recovery count so far."""

    __slots__ = ("domain", "previous_mean", "loss", "head", "duration", "recovered")

    def __init__(self, domain: int, previous_mean: float | None) -> None:
        self.domain = domain
        self.previous_mean = previous_mean  # None: not a revisit
        self.loss = _RunningMean()
        self.head = _RunningMean()
        self.duration = 0
        self.recovered = False

    def add(self, loss: float, k: int) -> None:
        self.loss.add(loss)
        if self.head.count < k:
            self.head.add(loss)
        if self.previous_mean is not None and not self.recovered:
            if loss < self.previous_mean:
                self.recovered = True
            else:
                self.duration += 1

    def state(self) -> dict:
        return {"domain": self.domain, "previous_mean": self.previous_mean, "loss": self.loss.state(),
                "head": self.head.state(), "duration": self.duration, "recovered": self.recovered}

    @classmethod
    def from_state(cls, state: dict) -> "_OpenFragment":
        restored = cls(state["domain"], state["previous_mean"])
        restored.loss, restored.head = _RunningMean.from_state(state["loss"]), _RunningMean.from_state(state["head"])
        restored.duration, restored.recovered = state["duration"], state["recovered"]
        return restored


class CalmTracker:
    """The CALM metrics of :func:`calm_metrics`, updated one batch at a time in O(classes) memory.

    ``snapshot()`` equals ``calm_metrics(records_so_far, k=k, from_fragment=from_fragment)``
    (the still-open fragment is the last one, so it counts for loss only), plus a
    ``"live"`` sub-dict about the most recent switches.
    """

    def __init__(self, k: int = 10, from_fragment: int = 0) -> None:
        check_params(k, from_fragment)
        self.k = k
        self.from_fragment = from_fragment
        # whole stream
        self._switches = 0
        self._sequence: int | None = None
        self._class_name: str | None = None
        self._batches_in_fragment = 0
        # evaluated span
        self._span_sequence: int | None = None
        self._classes: dict[int, _ClassState] = {}
        self._open: _OpenFragment | None = None
        self._loss = _RunningMean()
        self._n_fragments = 0
        self._intensity = _RunningMean()
        self._rec_total = 0
        self._last_intensity: float | None = None
        self._last_rec: int | None = None
        self._last_revisit_class: str | None = None

    def __repr__(self) -> str:
        return f"CalmTracker(k={self.k}, from_fragment={self.from_fragment})"

    def update(self, loss: float, domain: int, domain_name: str, sequence: int) -> None:
        """Record the (pre-update) loss of one batch."""
        loss = float(loss)
        if self._sequence is None or sequence != self._sequence:
            if self._sequence is not None:
                self._switches += 1
            self._sequence = sequence
            self._class_name = domain_name
            self._batches_in_fragment = 0
        self._batches_in_fragment += 1
        if sequence < self.from_fragment:
            return
        if self._open is None or sequence != self._span_sequence:
            self._close_fragment()
            self._open_fragment(domain, domain_name)
            self._span_sequence = sequence
        self._open.add(loss, self.k)
        self._loss.add(loss)
        self._classes[self._open.domain].loss.add(loss)

    def _open_fragment(self, domain: int, domain_name: str) -> None:
        state = self._classes.setdefault(domain, _ClassState(domain_name))
        state.n_fragments += 1
        self._n_fragments += 1
        self._open = _OpenFragment(domain, state.previous_mean)

    def _close_fragment(self) -> None:
        fragment = self._open
        if fragment is None:
            return
        state = self._classes[fragment.domain]
        if fragment.previous_mean is not None:
            intensity = fragment.head.mean
            state.intensity.add(intensity)
            state.rec_total += fragment.duration
            self._intensity.add(intensity)
            self._rec_total += fragment.duration
            self._last_intensity = intensity
            self._last_rec = fragment.duration
            self._last_revisit_class = state.name
        state.previous_mean = fragment.loss.mean
        self._open = None

    _SCALARS = ("_switches", "_sequence", "_class_name", "_batches_in_fragment", "_span_sequence",
                "_n_fragments", "_rec_total", "_last_intensity", "_last_rec", "_last_revisit_class")

    def state_dict(self) -> dict:
        """Everything the tracker has accumulated, as plain values (see :meth:`load_state_dict`)."""
        return {
            "k": self.k, "from_fragment": self.from_fragment,
            **{name.lstrip("_"): getattr(self, name) for name in self._SCALARS},
            "classes": [[domain, state.state()] for domain, state in self._classes.items()],
            "open": None if self._open is None else self._open.state(),
            "loss": self._loss.state(), "intensity": self._intensity.state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`; the tracker's k and from_fragment must match."""
        if (state["k"], state["from_fragment"]) != (self.k, self.from_fragment):
            raise ValueError(f"saved CALM tracker has k={state['k']}, from_fragment={state['from_fragment']}; "
                             f"this one k={self.k}, from_fragment={self.from_fragment}")
        for name in self._SCALARS:
            setattr(self, name, state[name.lstrip("_")])
        self._classes = {domain: _ClassState.from_state(values) for domain, values in state["classes"]}
        self._open = None if state["open"] is None else _OpenFragment.from_state(state["open"])
        self._loss, self._intensity = _RunningMean.from_state(state["loss"]), _RunningMean.from_state(state["intensity"])

    def loss_mean(self, domain: int | None = None) -> float | None:
        """Mean loss over the evaluated span of class `domain` (None: of every class), the loss of
        ppl; None before the class has a batch there. O(1), for a reading at every batch."""
        if domain is None:
            return self._loss.mean
        state = self._classes.get(domain)
        return None if state is None else state.loss.mean

    def snapshot(self) -> dict:
        """The metrics over the records seen so far, plus the ``"live"`` sub-dict."""
        n_revisits = self._intensity.count
        mean_rec = self._rec_total / n_revisits if n_revisits else None
        overall = Summary(
            name="all",
            loss=self._loss.mean,
            n_batches=self._loss.count,
            n_fragments=self._n_fragments,
            n_revisits=n_revisits,
            intensity=self._intensity.mean,
            rec=mean_rec,
        )
        per_class = [(domain, state.summary()) for domain, state in self._classes.items()]
        result = calm_result(overall, per_class, self.k, self.from_fragment)
        result["live"] = {
            "switches": self._switches,
            "current_sequence": self._sequence,
            "current_class": self._class_name,
            "batches_in_fragment": self._batches_in_fragment,
            "last_loss_after_switch": self._last_intensity,
            "last_rec": self._last_rec,
            "last_revisit_class": self._last_revisit_class,
            "mean_loss_after_switch": self._intensity.mean,
            "mean_rec": mean_rec,
        }
        return result
