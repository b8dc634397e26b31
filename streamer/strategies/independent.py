"""The Ind. LSTM oracle (CALM): one model per ground-truth class, chosen by the class header.

An oracle, not a continual learner: it is told the class of every batch (the one
strategy that reads the ground truth, through `route`, which the prequential step
calls before `predict`), so it never forgets and never has to detect a switch. It
bounds what a strategy that must find the class itself could reach.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from streamer.strategies.base import Batch, LearnStats, Prediction
from streamer.strategies.naive import Naive
from streamer.strategies.params import HyperparameterRepr

__all__ = ["Independent", "PerClassModels", "UNROUTED"]

UNROUTED = "unlabelled"  # the class of a batch whose truth is None (as monitor.live names it)


class PerClassModels(nn.ModuleDict):
    """The oracle's models keyed "0", "1", ...; called as a model, the selected one answers.

    `for_class(name)` is the model of a class (the untrained initial model for a class not
    seen yet), so a held-out probe of class c is scored by c's own model."""

    def __init__(self, models: dict[str, nn.Module], lookup):
        super().__init__(models)
        self._lookup = lookup  # class name -> its model (a plain callable, not a submodule)
        self.selected = "0"

    def for_class(self, name: str) -> nn.Module:
        return self._lookup(name)

    def initial_state(self, batch_size: int, device="cpu"):
        return self[self.selected].initial_state(batch_size, device)

    def forward(self, inputs, state):
        return self[self.selected](inputs, state)


class Independent(HyperparameterRepr):
    """One naive learner per class: a copy of the initial model with its own Adam and hidden state.

    Not distributed: `streamer learn --nproc` refuses it (ranks' rows may hold different classes).

    The model given to the constructor serves the first class routed (and any batch learned
    before the first `route`); every later class starts from a deep copy of the *initial*
    weights (kept in a private template), with a fresh optimizer and a zero hidden state.
    A class's hidden state carries from its own previous batch. `model` is an
    `nn.ModuleDict` of the per-class models, keyed "0", "1", ... in order of first
    appearance (`classes` maps class name -> key); it grows as classes appear, so its
    parameter count at the start of a run is one class's model and at the end that
    times the number of classes seen. Called as a model it is the selected class's model;
    the probe split scores each class with that class's model (`for_class`).

    With the `independent` schedule a batch mixes streams of different classes; it is
    routed by its majority class (streamer.batching.BatchTruth).
    """

    oracle = True  # reads the ground-truth class: labelled "(oracle)" in views, configs and tables

    def __init__(self, model: nn.Module, lr: float, *, clip: float = 1.0):
        self.lr = lr
        self.clip = clip
        self._template = copy.deepcopy(model).eval()  # the initial weights every new class starts from
        self._learners: list[Naive] = [Naive(model, lr=lr, clip=clip)]
        self._slots: dict[str, int] = {}  # class name -> index into _learners
        self._current = 0
        self.model = PerClassModels({"0": model}, self._model_of)

    @property
    def classes(self) -> dict[str, str]:
        """class name -> key of its model in `model`."""
        return {name: str(slot) for name, slot in self._slots.items()}

    def _add_learner(self) -> int:
        slot = len(self._learners)
        model = copy.deepcopy(self._template)
        self._learners.append(Naive(model, lr=self.lr, clip=self.clip))
        self.model[str(slot)] = model
        return slot

    def _model_of(self, name: str) -> nn.Module:
        slot = self._slots.get(name)
        return self._template if slot is None else self._learners[slot].model

    def route(self, truth) -> None:
        """Select the model of `truth.class_name` (a BatchTruth, or None: the class "unlabelled")."""
        name = UNROUTED if truth is None else truth.class_name
        slot = self._slots.get(name)
        if slot is None:
            slot = 0 if not self._slots else self._add_learner()
            self._slots[name] = slot
        self._current = slot
        self.model.selected = str(slot)

    def predict(self, batch: Batch) -> Prediction:
        return self._learners[self._current].predict(batch)

    def learn(self, batch: Batch) -> LearnStats:
        return self._learners[self._current].learn(batch)

    def state_dict(self) -> dict[str, Any]:
        return {
            "initial": self._template.state_dict(),
            "classes": dict(self._slots),
            "current": self._current,
            "learners": [learner.state_dict() for learner in self._learners],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._template.load_state_dict(state["initial"])
        wanted = len(state["learners"])
        while len(self._learners) < wanted:
            self._add_learner()
        for slot in range(wanted, len(self._learners)):
            del self.model[str(slot)]
        del self._learners[wanted:]
        for learner, learner_state in zip(self._learners, state["learners"]):
            learner.load_state_dict(learner_state)
        self._slots = dict(state["classes"])
        self._current = state["current"]
        self.model.selected = str(self._current)
