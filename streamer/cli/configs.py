"""Flags become frozen configs here, once: nothing below the command line sees a Namespace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from producers.schedule import Schedule
from streamer.cli.errors import UserError
from streamer.config import LearnConfig, span_start
from streamer.models.catalog import LSTMConfig

__all__ = ["schedule", "stream_options", "from_fragment", "stream_shape", "model_config", "learn_config",
           "fit_budget", "say", "silent", "MANIFEST_FIXES"]

# What a producer's manifest fixes for the learner: LearnConfig field -> (manifest key, flag)
MANIFEST_FIXES = {"streams": ("streams", "--streams"), "window": ("window", "--window")}


def schedule(args) -> Schedule:
    """The stream schedule of the stream flags."""
    return Schedule(kind=args.schedule, n_fragments=args.fragments, mean_tokens=args.mean_tokens,
                    streams=args.streams, window=args.window, record_tokens=args.window,
                    seed=args.seed, order=args.order, given_order=args.given_order,
                    permutation=args.permutation, repeats=args.repeats, probe_tokens=args.probe_tokens)


def stream_options(args) -> dict:
    """producers.stream.prepare_stream's keyword options of the stream flags."""
    return {"probe_examples": args.probe_examples, "utterances": False if args.as_text else None}


def say(line: str) -> None:
    """The default `log` of what a config chose: one line on stdout, at once."""
    print(line, flush=True)


def silent(line: str) -> None:
    """A `log` for a process whose config another says (torchrun's ranks other than 0, --nproc's launcher)."""


def from_fragment(spec: str | int, n_fragments: int | None, log=say) -> int:
    """--from-fragment as a fragment index; 'half' without N (no manifest) is the whole stream, said once;
    an index past the manifest's last fragment is a UserError (its span would score nothing)."""
    if spec == "half" and not n_fragments:
        log("--from-fragment half: no manifest gives the number of fragments N (none given, or a looped stream's), "
            "so the whole stream is scored (fragments >= 0); --manifest or --from-fragment N to choose")
        return 0
    try:
        return span_start(spec, n_fragments)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def stream_shape(args, manifest: dict | None, where: str = "the manifest") -> dict[str, int]:
    """streams and window: the manifest's when it has them (a flag that contradicts one is a UserError naming
    both values), else the flag's, else LearnConfig's default."""
    shape = {}
    for field_name, (key, flag) in MANIFEST_FIXES.items():
        given = getattr(args, field_name, None)
        fixed = (manifest or {}).get(key)
        if fixed is not None and given is not None and given != fixed:
            raise UserError(f"{flag} {given} contradicts {where}'s {key} {fixed} (leave {flag} out: the manifest "
                            f"sets it)")
        shape[field_name] = next(v for v in (fixed, given, getattr(LearnConfig, field_name)) if v is not None)
    return shape


def model_config(args, **changes) -> LearnConfig:
    """The LearnConfig fields of the model, strategy and run-limit flags every learning command has.

    `changes` fills the rest (the topic, the run directory, what the command knows)."""
    fields = dict(
        strategy_options=tuple(args.strategy_options), model_name=args.model_name,
        model_options=tuple(args.model_options), streams=args.streams or LearnConfig.streams,
        window=args.window or LearnConfig.window,
        model=LSTMConfig(embedding=args.embedding, hidden=args.hidden, layers=args.layers, dropout=args.dropout),
        lr=args.lr, seed=args.seed, device=args.device, max_batches=args.max_batches, minutes=args.minutes,
        checkpoint_every_s=args.checkpoint_every, probe_every=args.probe_every, detector=args.detector,
        probe=not args.no_probe)
    if getattr(args, "clip", None) is not None:  # --clip, or --set clip=X (checks.route_trainer_keys)
        fields["clip"] = args.clip
    if getattr(args, "max_record_bytes", None) is not None:  # learn and demo (--max-record-bytes)
        fields["max_record_bytes"] = args.max_record_bytes
    if getattr(args, "broker_timeout", None) is not None:  # learn, demo and compare (--broker-timeout)
        fields["broker_timeout_s"] = args.broker_timeout
    if getattr(args, "security_protocol", None) is not None:  # the Kafka security flags (security_flags.py)
        from streamer.cli.security_flags import kafka_security

        fields["kafka_security"] = kafka_security(args)
    if any(getattr(args, name, None) is not None for name in (
            "metrics_tls_cert", "metrics_tls_key", "metrics_tls_client_ca", "metrics_auth_file")):
        from streamer.cli.security_flags import metrics_security

        fields["metrics_security"] = metrics_security(args)
    fields.update(changes)
    config = LearnConfig(**fields)
    return dataclasses.replace(config, lr=config.resolved_lr)  # config.json records the rate used


def learn_config(args, *, bootstrap: str, topic: str, group: str, run_dir: Path, manifest: dict | None,
                 manifest_path: Path | None = None, log=say) -> LearnConfig:
    """`learn` and `demo`: the run's config, with what the manifest fixes (a contradicting flag is a
    UserError naming both values) and sized to --params; `log` says what was chosen for the user."""
    where = f"the manifest {manifest_path}" if manifest_path else "the manifest"
    level = (manifest or {}).get("level")
    if args.model_name == "hf-classifier" and level not in (None, "utterance"):  # (it dead-lettered every record)
        raise UserError(f"--model hf-classifier learns labelled utterances, and {where} is of running text "
                        f"(level {level}): produce an utterance corpus (intents-multilingual, multiwoz-domains, your "
                        "JSONL/CSV) without --as-text, or learn this one with lstm-char, lstm-word or hf-causal")
    config = model_config(
        args, **stream_shape(args, manifest, where), bootstrap_servers=bootstrap, topic=topic, group_id=group,
        run_dir=run_dir, run_name=run_dir.name,
        strategy=args.strategy, idle_timeout_s=getattr(args, "idle_timeout", None),
        keep_windows=getattr(args, "keep_windows", LearnConfig.keep_windows),
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, live_view=not args.no_view,
    ).with_manifest(manifest)
    config = dataclasses.replace(config, from_fragment=from_fragment(args.from_fragment, config.n_fragments, log))
    return fit_budget(config, args.params, manifest, log)


def fit_budget(config: LearnConfig, params: int | None, manifest: dict | None, log=say) -> LearnConfig:
    """--params N: the config with the hidden size that gives the strategy's model about N parameters."""
    if not params:
        return config
    from streamer.budget import fit_to_budget

    try:
        config, fitted = fit_to_budget(config, params, manifest)
    except ValueError as exc:  # BudgetError, or a bad --set or --model-opt found while sizing
        raise UserError(str(exc)) from None
    log(fitted.describe(config.strategy))
    return config
