"""Flags become frozen configs here, once: nothing below the command line sees a Namespace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from producers.schedule import Schedule
from streamer.cli.errors import UserError
from streamer.config import LearnConfig, span_start
from streamer.models.catalog import LSTMConfig

__all__ = ["schedule", "stream_options", "from_fragment", "model_config", "learn_config", "fit_budget"]


def schedule(args) -> Schedule:
    """The stream schedule of the stream flags."""
    return Schedule(kind=args.schedule, n_fragments=args.fragments, mean_tokens=args.mean_tokens,
                    streams=args.streams, window=args.window, record_tokens=args.window,
                    seed=args.seed, order=args.order, given_order=args.given_order,
                    permutation=args.permutation, repeats=args.repeats, probe_tokens=args.probe_tokens)


def stream_options(args) -> dict:
    """producers.stream.prepare_stream's keyword options of the stream flags."""
    return {"probe_examples": args.probe_examples, "utterances": False if args.as_text else None}


def from_fragment(spec: str | int, n_fragments: int | None) -> int:
    """--from-fragment as a fragment index."""
    try:
        return span_start(spec, n_fragments)
    except ValueError:
        raise UserError("--from-fragment half needs --manifest (the number of fragments N)") from None


def model_config(args, **changes) -> LearnConfig:
    """The LearnConfig fields of the model, strategy and run-limit flags every learning command has.

    `changes` fills the rest (the topic, the run directory, what the command knows)."""
    fields = dict(
        strategy_options=tuple(args.strategy_options), model_name=args.model_name,
        model_options=tuple(args.model_options), streams=args.streams, window=args.window,
        model=LSTMConfig(embedding=args.embedding, hidden=args.hidden, layers=args.layers, dropout=args.dropout),
        lr=args.lr, seed=args.seed, device=args.device, max_batches=args.max_batches, minutes=args.minutes,
        checkpoint_every_s=args.checkpoint_every, probe_every=max(0, args.probe_every), detector=args.detector,
        probe=not args.no_probe)
    if getattr(args, "max_record_bytes", None) is not None:  # learn and demo (--max-record-bytes)
        fields["max_record_bytes"] = args.max_record_bytes
    fields.update(changes)
    config = LearnConfig(**fields)
    return dataclasses.replace(config, lr=config.resolved_lr)  # config.json records the rate used


def learn_config(args, *, bootstrap: str, topic: str, group: str, run_dir: Path, manifest: dict | None) -> LearnConfig:
    """`learn` and `demo`: the run's config, checked against the manifest and sized to --params."""
    for key, flag in (("streams", "--streams"), ("window", "--window")):
        if manifest and key in manifest and manifest[key] != getattr(args, key):
            raise UserError(f"{flag} {getattr(args, key)} differs from the manifest's {manifest[key]}")
    config = model_config(
        args, bootstrap_servers=bootstrap, topic=topic, group_id=group, run_dir=run_dir, run_name=run_dir.name,
        strategy=args.strategy, idle_timeout_s=getattr(args, "idle_timeout", None),
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, live_view=not args.no_view,
    ).with_manifest(manifest)
    config = dataclasses.replace(config, from_fragment=from_fragment(args.from_fragment, config.n_fragments))
    return fit_budget(config, args.params, manifest)


def fit_budget(config: LearnConfig, params: int | None, manifest: dict | None) -> LearnConfig:
    """--params N: the config with the hidden size that gives the strategy's model about N parameters."""
    if not params:
        return config
    from streamer.budget import fit_to_budget

    try:
        config, fitted = fit_to_budget(config, params, manifest)
    except ValueError as exc:  # BudgetError, or a bad --set or --model-opt found while sizing
        raise UserError(str(exc)) from None
    print(fitted.describe(config.strategy), flush=True)
    return config
