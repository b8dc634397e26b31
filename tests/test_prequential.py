"""The recorded loss of batch t comes from the parameters before any update on batch t.

Naive's other contract (predict changes nothing, learn changes the parameters, the state_dict
round trip, the protocol, headers never reach the model, seeded runs repeat) is checked for
every strategy, naive included, in test_strategy_conformance.py.
"""

import copy

import pytest

from streamer.step import prequential_step
from tests.helpers import naive


def test_recorded_loss_is_the_loss_under_the_parameters_before_the_update(tiny_stream):
    _, batches = tiny_stream
    strategy = naive(seed=0)
    for t, (batch, truth) in enumerate(batches[:25]):
        snapshot = copy.deepcopy(strategy.state_dict())  # parameters + hidden state before batch t
        result = prequential_step(strategy, batch, truth, t)
        replica = naive(seed=123)  # different init, then overwritten by the snapshot
        replica.load_state_dict(snapshot)
        before = replica.predict(batch).loss.item()
        after = strategy.predict(batch).loss.item()
        assert result.loss == pytest.approx(before, rel=1e-6, abs=1e-7)
        assert abs(after - before) > 1e-6  # the update did change the loss of batch t
