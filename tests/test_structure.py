"""The house's structure, counted over the product code (streamer/, producers/, monitor/) by
tests/structure.py: arrows point one way, no cycles, one CLI room, one Kafka package, one settings module, one
checkpoint writer, no pickle, strategies' repr from their signature."""

from tests.structure import check

LIMITS = {"cycles": 0, "upward": 0, "private": 0, "argparse": 0, "aiokafka": 0, "environment": 1,
          "strategy_repr": 1, "torch_save": 1, "pickle": 0}


def test_structure_within_limits():
    faults = check()
    over = {key: faults[key] for key, limit in LIMITS.items() if len(faults[key]) > limit}
    assert not over, over


def test_only_settings_reads_the_environment():
    assert check()["environment"] == ["streamer.settings"]


def test_only_the_checkpoint_module_saves():
    assert check()["torch_save"] == ["streamer.checkpoint"]
