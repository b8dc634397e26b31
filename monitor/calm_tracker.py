"""The CALM metrics of monitor.calm, live: updated one batch at a time in O(classes) memory.

:class:`CalmTracker` is monitor.calm's CalmAccumulator (the one fragment, class and revisit
bookkeeping) with compensated sums, plus what only a live reading needs: the whole stream's
switches, the last revisit, the running loss mean. Its state is plain values
(``state_dict``/``load_state_dict``), so a checkpoint can carry it and a resumed tracker
continues with exactly the numbers of an uninterrupted one.
"""

from __future__ import annotations

from monitor.calm import CalmAccumulator, ClassTotals, OpenFragment
from monitor.sums import CompensatedSum

__all__ = ["CalmTracker"]


def _class_state(totals: ClassTotals) -> dict:
    return {"name": totals.name, "loss": totals.loss.state(), "n_fragments": totals.n_fragments,
            "intensity": totals.intensity.state(), "rec_total": totals.rec_total,
            "previous_mean": totals.previous_mean}


def _class_from_state(state: dict) -> ClassTotals:
    restored = ClassTotals(state["name"], CompensatedSum)
    restored.loss = CompensatedSum.from_state(state["loss"])
    restored.intensity = CompensatedSum.from_state(state["intensity"])
    restored.n_fragments, restored.rec_total = state["n_fragments"], state["rec_total"]
    restored.previous_mean = state["previous_mean"]
    return restored


def _fragment_state(fragment: OpenFragment, domain: int) -> dict:
    return {"domain": domain, "previous_mean": fragment.previous_mean, "loss": fragment.loss.state(),
            "head": fragment.head.state(), "duration": fragment.duration, "recovered": fragment.recovered}


def _fragment_from_state(state: dict, k: int) -> OpenFragment:
    restored = OpenFragment(k, state["previous_mean"], CompensatedSum)
    restored.loss, restored.head = CompensatedSum.from_state(state["loss"]), CompensatedSum.from_state(state["head"])
    restored.duration, restored.recovered = state["duration"], state["recovered"]
    return restored


class CalmTracker(CalmAccumulator):
    """The CALM metrics of :func:`calm_metrics`, updated one batch at a time in O(classes) memory.

    ``snapshot()`` equals ``calm_metrics(records_so_far, k=k, from_fragment=from_fragment)``
    (the still-open fragment is the last one, so it counts for loss only; sums compensated
    where calm_metrics's are exact, equal to rounding), plus a ``"live"`` sub-dict about the
    most recent switches.
    """

    sum_type = CompensatedSum  # its state is three numbers; checkpoints hold them

    def __init__(self, k: int = 10, from_fragment: int = 0) -> None:
        super().__init__(k, from_fragment)
        # whole stream
        self._switches = 0
        self._sequence: int | None = None
        self._class_name: str | None = None
        self._batches_in_fragment = 0
        # the evaluated span's last revisit
        self._last_intensity: float | None = None
        self._last_rec: int | None = None
        self._last_revisit_class: str | None = None

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
        super().update(loss, domain, domain_name, sequence)

    def _close(self) -> tuple[str, float, int] | None:
        revisit = super()._close()
        if revisit is not None:
            self._last_revisit_class, self._last_intensity, self._last_rec = revisit
        return revisit

    _SCALARS = ("_switches", "_sequence", "_class_name", "_batches_in_fragment", "_span_sequence",
                "_n_fragments", "_rec_total", "_last_intensity", "_last_rec", "_last_revisit_class")

    def state_dict(self) -> dict:
        """Everything the tracker has accumulated, as plain values (see :meth:`load_state_dict`)."""
        return {
            "k": self.k, "from_fragment": self.from_fragment,
            **{name.lstrip("_"): getattr(self, name) for name in self._SCALARS},
            "classes": [[domain, _class_state(totals)] for domain, totals in self._classes.items()],
            "open": None if self._open is None else _fragment_state(self._open, self._open_domain),
            "loss": self._loss.state(), "intensity": self._intensity.state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`; the tracker's k and from_fragment must match."""
        if (state["k"], state["from_fragment"]) != (self.k, self.from_fragment):
            raise ValueError(f"saved CALM tracker has k={state['k']}, from_fragment={state['from_fragment']}; "
                             f"this one k={self.k}, from_fragment={self.from_fragment}")
        for name in self._SCALARS:
            setattr(self, name, state[name.lstrip("_")])
        self._classes = {domain: _class_from_state(values) for domain, values in state["classes"]}
        self._open = None if state["open"] is None else _fragment_from_state(state["open"], self.k)
        self._open_domain = None if state["open"] is None else state["open"]["domain"]
        self._loss = CompensatedSum.from_state(state["loss"])
        self._intensity = CompensatedSum.from_state(state["intensity"])

    def loss_mean(self, domain: int | None = None) -> float | None:
        """Mean loss over the evaluated span of class `domain` (None: of every class), the loss of
        ppl; None before the class has a batch there. O(1), for a reading at every batch."""
        if domain is None:
            return self._loss.mean()
        totals = self._classes.get(domain)
        return None if totals is None else totals.loss.mean()

    def snapshot(self) -> dict:
        """The metrics over the records seen so far, plus the ``"live"`` sub-dict."""
        result = self.result()
        result["live"] = {
            "switches": self._switches,
            "current_sequence": self._sequence,
            "current_class": self._class_name,
            "batches_in_fragment": self._batches_in_fragment,
            "last_loss_after_switch": self._last_intensity,
            "last_rec": self._last_rec,
            "last_revisit_class": self._last_revisit_class,
            "mean_loss_after_switch": self._intensity.mean(),
            "mean_rec": result["rec"],
        }
        return result
