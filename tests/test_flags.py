"""Bad flags and files: one line on stderr, exit 2, before any work (no run directory is created).

The command runs in-process (`streamer.cli.main(argv)`, its exit status and stderr captured); two
checks start the real process, where the one-line contract is what a shell sees.
"""

import dataclasses
import json
import socket
import subprocess
import sys

import pytest

from streamer.cli import main, parse
from streamer.cli.checks import check_bootstrap, check_hyperparameters
from streamer.cli.errors import UserError


def run_main(argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `streamer ARGV` run in this process."""
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse and --config errors exit through the parser
        status = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(done, *expected):
    status, _, stderr = done
    lines = stderr.strip().splitlines()
    assert status == 2, stderr
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


CASES = {
    "set-not-a-number": (["learn", "--strategy", "replay", "--set", "p_write=abc"], ["p_write", "number"]),
    "set-out-of-range": (["learn", "--strategy", "replay", "--set", "p_write=-1"], ["p_write", "[0, 1]"]),
    "set-probability-above-one": (["learn", "--strategy", "replay", "--set", "p_write=5"], ["p_write=5", "[0, 1]"]),
    "set-unknown-key-lists-keys": (["learn", "--strategy", "replay", "--set", "pwrite=0.2"],
                                   ["pwrite", "memory_size, n_replay, p_write, r_interval", "streamer strategies"]),
    "set-count": (["learn", "--strategy", "poe", "--set", "n_experts=0"], ["n_experts", ">= 1"]),
    "set-integer": (["learn", "--strategy", "replay", "--set", "memory_size=2.5"], ["memory_size", "integer"]),
    "set-choice": (["learn", "--strategy", "replay", "--set", "selection=best"], ["selection", "reservoir | herding"]),
    "set-boundary": (["learn", "--strategy", "ewc", "--set", "boundary=every:0"], ["boundary", "every:N"]),
    "set-lr-range": (["learn", "--set", "lr=-1"], ["lr=-1", "> 0"]),
    "set-lr-and-flag": (["learn", "--set", "lr=0.01", "--lr", "0.02"], ["--set lr=0.01", "--lr 0.02"]),
    "metrics-port-range": (["learn", "--metrics-port", "99999"], ["--metrics-port", "99999"]),
    "bootstrap": (["learn", "--bootstrap-servers", "no port here"], ["--bootstrap-servers"]),
    "bootstrap-port": (["learn", "--bootstrap-servers", "localhost:99999"], ["--bootstrap-servers"]),
    "model-name": (["learn", "--model", "hf-causal", "--model-opt", "name=nobody/no-such-model-xyz"],
                   ["name=nobody/no-such-model-xyz", "path=DIR"]),
    "broker-port-range": (["broker", "--port", "70000"], ["--port"]),
    "compare-set": (["compare", "--strategies", "naive,replay", "--set", "p_write=7"], ["p_write"]),
    "compare-unknown": (["compare", "--strategies", "naive,replay", "--set", "nothing=1"], ["nothing", "p_write"]),
    "unknown-strategy-listed": (["strategies", "nosuch"], ["nosuch", "naive"]),
    # a topic Kafka would refuse (the embedded broker takes any), or whose files cannot be named
    "topic-space": (["learn", "--topic", "my topic"], ["--topic 'my topic'", "not a Kafka topic name"]),
    "topic-path": (["produce", "--topic", "../evil"], ["--topic '../evil'", "not a Kafka topic name"]),
    "topic-dot": (["learn", "--topic", ".."], ["not a Kafka topic name"]),
    "topic-long": (["learn", "--topic", "t" * 246, "--run-dir", "run"],
                   ["246 characters", "Kafka's 245", ".dlq"]),
    "topic-sidecar": (["produce", "--topic", "t" * 244], ["244 characters", "Kafka's 243", "--no-truth-topic"]),
    "topic-manifest": (["produce", "--topic", "t" * 245, "--no-truth-topic"], ["default manifest", "--manifest"]),
    "topic-run-dir": (["learn", "--topic", "t" * 130], ["runs/<topic>-<group>", "--run-dir"]),
    "group-run-dir": (["learn", "--group", "team/a"], ["'team/a'", "--run-dir"]),
    # refused by the model once built (after --fresh had moved the run aside), or taken as 0 without a word
    "dropout-range": (["learn", "--dropout", "2"], ["--dropout", "a probability in 0..1, got 2.0"]),
    "probe-every-negative": (["learn", "--probe-every", "-1"], ["--probe-every", "an integer >= 0, got -1"]),
    "compare-probe-every": (["compare", "--probe-every", "-1"], ["--probe-every", "an integer >= 0, got -1"]),
    # produce's stream flags: numpy's traceback for a negative seed; a negative probe split taken silently or
    # named by its field, not its flag
    "produce-seed": (["produce", "--seed", "-1"], ["--seed", "expected an integer >= 0, got -1"]),
    "produce-probe-examples": (["produce", "--probe-examples", "-1"], ["--probe-examples", ">= 0, got -1"]),
    "produce-probe-tokens": (["produce", "--probe-tokens", "-5"], ["--probe-tokens", ">= 0, got -5"]),
    "compare-seeds": (["compare", "--seeds", "0,-1"], ["--seeds", "integers >= 0"]),
    # not finite: taken, and the first step made every weight NaN (the run went on, its updates skipped)
    "lr-inf": (["learn", "--lr", "inf"], ["--lr", "expected a positive number, got inf"]),
    "set-clip-inf": (["learn", "--set", "clip=inf"], ["clip=inf", "finite"]),
    "set-nan": (["learn", "--strategy", "replay", "--set", "p_write=nan"], ["p_write=nan", "finite"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_flag_is_one_line_and_exit_2_before_any_work(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    args, expected = CASES[case]
    assert_one_line_error(run_main(args, capsys), *expected)
    assert list(tmp_path.iterdir()) == []  # no runs/, no report/, nothing


def test_a_bad_flag_is_one_line_from_the_real_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "streamer.cli", "learn", "--bootstrap-servers", "kafka"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert_one_line_error((done.returncode, done.stdout, done.stderr), "--bootstrap-servers", "HOST:PORT")
    assert list(tmp_path.iterdir()) == []


def test_taken_ports_are_named(tmp_path, monkeypatch, capsys, taken_port):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run_main(["learn", "--metrics-port", str(taken_port)], capsys), f"port {taken_port}", "in use")
    assert_one_line_error(run_main(["broker", "--port", str(taken_port)], capsys), f"port {taken_port}", "in use")
    assert list(tmp_path.iterdir()) == []


def test_files_that_cannot_be_used(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    binary = tmp_path / "config.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    assert_one_line_error(run_main(["learn", "--config", str(binary)], capsys), "config.toml", "not a TOML file")
    not_toml = tmp_path / "bad.toml"
    not_toml.write_text("fragments = = 3\n")
    assert_one_line_error(run_main(["learn", "--config", str(not_toml)], capsys), "not valid TOML")
    table = tmp_path / "table.toml"
    table.write_text("[strategy.replay]\np_write = 3.0\n")
    assert_one_line_error(run_main(["learn", "--strategy", "replay", "--config", str(table)], capsys),
                          "p_write", "[0, 1]")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert_one_line_error(run_main(["learn", "--run-dir", str(a_file)], capsys), "is a file")
    assert_one_line_error(run_main(["learn", "--run-dir", str(a_file / "run")], capsys), "is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "bad.toml", "config.toml", "table.toml"]


def test_hyperparameters_are_typed_from_their_signature():
    assert check_hyperparameters("replay", [("p_write", 1), ("memory_size", 5.0), ("selection", "herding")]) == [
        ("p_write", 1.0), ("memory_size", 5), ("selection", "herding")]
    assert check_hyperparameters("ewc", [("ewc_lambda", 0), ("gamma", 0.5), ("boundary", "every:50")]) == [
        ("ewc_lambda", 0.0), ("gamma", 0.5), ("boundary", "every:50")]
    assert check_hyperparameters("adapters", [("selection", "row")]) == [("selection", "row")]
    with pytest.raises(UserError, match="fisher_decay=1.5"):
        check_hyperparameters("ewc", [("fisher_decay", 1.5)])


def test_every_default_is_inside_its_own_range():
    from streamer.cli.checks import strategy_signature
    from streamer.cli.flags import DETECTOR_CHOICES, STRATEGY_CHOICES
    from streamer.strategies import params

    assert set(params._BOUNDARY_DETECTORS) == set(DETECTOR_CHOICES)  # noqa: SLF001 (the table the check reads)
    for name in (*STRATEGY_CHOICES, "multitask"):
        for key, hyperparameter in strategy_signature(name).items():
            if key != "lr":  # lr has no default of its own: the model's
                assert hyperparameter.check(hyperparameter.default) == hyperparameter.default, (name, key)


def test_set_lr_and_clip_are_the_runs_lr_and_clip(tmp_path):
    """README lists lr and clip as naive's hyperparameters: --set gives them, as --lr and --clip do."""
    from streamer.cli.checks import check_args
    from streamer.cli.configs import learn_config

    def config(*flags):
        args = parse(["learn", "--topic", "t", *flags])
        check_args(args)
        return learn_config(args, bootstrap="x:1", topic="t", group="g", run_dir=tmp_path, manifest=None,
                            log=lambda _: None)

    by_set = config("--set", "lr=0.001", "--set", "clip=0.5")
    by_flag = config("--lr", "0.001", "--clip", "0.5")
    assert (by_set.lr, by_set.clip, by_set.strategy_options) == (0.001, 0.5, ())
    assert (by_flag.lr, by_flag.clip) == (0.001, 0.5)
    assert config().clip == 1.0
    replay = config("--strategy", "replay", "--set", "clip=2", "--set", "p_write=0.5")
    assert (replay.clip, replay.strategy_options) == (2.0, (("p_write", 0.5),))


def test_learn_takes_streams_and_window_from_the_manifest(tmp_path, monkeypatch, capsys):
    from streamer.cli.configs import learn_config

    manifest = {"streams": 4, "window": 16, "n_fragments": 10, "total_batches": 50, "classes": ["a", "b"]}

    def config(*flags):
        args = parse(["learn", "--topic", "t", *flags])
        return learn_config(args, bootstrap="x:1", topic="t", group="g", run_dir=tmp_path, manifest=manifest,
                            manifest_path=tmp_path / "m.json")

    taken = config()
    assert (taken.streams, taken.window, taken.from_fragment) == (4, 16, 5)  # 'half': the paper's N/2
    assert config("--streams", "4").streams == 4  # agreeing is fine
    with pytest.raises(UserError) as caught:
        config("--window", "20")
    assert "--window 20" in str(caught.value) and "window 16" in str(caught.value) and "m.json" in str(caught.value)
    assert config("--from-fragment", "all").from_fragment == 0

    # learn picks up produce's default manifest of the topic, and says so
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path / "cache"))
    from streamer.cli.learn import _manifest
    from streamer.cli.runs import default_manifest_path

    assert _manifest(parse(["learn", "--topic", "t"])) == (None, None)
    path = default_manifest_path("t")
    assert path == tmp_path / "cache" / "streams" / "t.manifest.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest))
    assert _manifest(parse(["learn", "--topic", "t"])) == (path, manifest)
    assert f"manifest: {path}" in capsys.readouterr().out


@pytest.mark.parametrize("servers", ["127.0.0.1:9092", "kafka-0.svc:9092,kafka-1.svc:9093", "[::1]:9092"])
def test_bootstrap_addresses_that_parse(servers):
    check_bootstrap(servers)


@pytest.mark.parametrize("servers", ["", "host", ":9092", "host:", "host:0", "a b:1", "host:9092,"])
def test_bootstrap_addresses_that_do_not(servers):
    with pytest.raises(UserError):
        check_bootstrap(servers)


def test_a_resumed_run_keeps_the_span_seed_and_detector_it_started_with(tmp_path, capsys):
    from streamer.cli.learn import _KEPT_SAID, _resumed_settings
    from streamer.config import LearnConfig
    from streamer.resume import KEPT_KEYS

    assert set(_KEPT_SAID) == set(KEPT_KEYS)  # each kept key is said with its flag

    config = LearnConfig(bootstrap_servers="x:1", topic="t", run_dir=tmp_path, from_fragment=5)
    assert _resumed_settings(config, None) is config
    assert _resumed_settings(config, {"config": {"from_fragment": 5}}) is config
    assert _resumed_settings(config, {"config": {"from_fragment": 0}}).from_fragment == 0
    assert "fragments >= 0 (not 5)" in capsys.readouterr().out
    # the seed and the detector too: the checkpoint's generators and detector state go on, and the run says so
    kept = _resumed_settings(config, {"config": {"from_fragment": 5, "seed": 0, "detector": "page-hinkley"}})
    assert kept is config
    changed = dataclasses.replace(config, seed=7, detector="adwin")
    kept = _resumed_settings(changed, {"config": {"from_fragment": 5, "seed": 0, "detector": "page-hinkley"}})
    assert (kept.seed, kept.detector, kept.from_fragment) == (0, "page-hinkley", 5)
    said = capsys.readouterr().out
    assert "--seed: the run continues with the seed it started with, 0 (its random generators go on) (not 7)" in said
    assert "--detector: the run continues with the drift detector it started with, page-hinkley" in said


def test_the_launchers_line_tells_failed_ranks_from_those_its_agent_then_stopped():
    from streamer.cli.launch import failed_ranks

    assert failed_ranks({1: 2, 0: -15}) == ("rank(s) 1 failed (exit status 2); their own lines are above; "
                                            "torchrun's agent then stopped rank(s) 0")
    assert failed_ranks({0: 2, 1: 2}) == "rank(s) 0, 1 failed (exit status 2); their own lines are above"
    assert failed_ranks({2: 1, 0: 143, 1: -9, 3: -15}) == (  # 143: a rank that caught the SIGTERM and checkpointed
        "rank(s) 1 (exit status -9 (SIGKILL)), 2 (exit status 1) failed; their own lines are above; "
        "torchrun's agent then stopped rank(s) 0, 3")
    assert failed_ranks({0: -15, 1: 143}) is None  # a SIGTERM to one rank: all stopped (143, not a failure's 2)


def test_what_a_config_chose_is_said_by_say_and_not_by_silent(tmp_path, capsys):
    from streamer.cli.configs import learn_config, say, silent

    args = parse(["learn", "--topic", "t", "--params", "200000"])
    for log in (say, silent):
        learn_config(args, bootstrap="x:1", topic="t", group="g", run_dir=tmp_path, manifest=None, log=log)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and said[0].startswith("--from-fragment half: no manifest") and \
        said[1].startswith("--params 200,000: naive with hidden "), said


def test_a_collective_that_lost_its_peer_is_told_from_other_runtime_errors():
    import torch.distributed as dist

    from streamer.cli.ranks import a_peer_is_gone, last_words

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:25805. This is typically caused by a remote worker crashing.")
    assert a_peer_is_gone(gloo) and a_peer_is_gone(dist.DistNetworkError("recv failed"))
    assert not a_peer_is_gone(RuntimeError("CUDA out of memory"))  # a fault of its own stays a traceback
    assert last_words(gloo).startswith("Connection closed by peer [127.0.0.1]:25805.")


def test_cache_is_taken_before_and_after_the_data_and_weights_subcommands():
    """`data list --cache D` was refused (unrecognized arguments) while `produce --cache D` worked."""
    for argv, cache in ((["data", "list", "--cache", "/x"], "/x"), (["data", "--cache", "/y", "list"], "/y"),
                        (["data", "list"], None), (["weights", "build", "smollm2-135m", "--cache", "/z"], "/z"),
                        (["data", "--cache", "/y", "info", "calm-multilingual", "--cache", "/w"], "/w")):
        got = parse(argv).cache
        assert (None if got is None else str(got)) == cache, argv


def test_a_bad_value_in_a_config_files_table_is_named_by_the_file_not_by_set(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('[strategy.replay]\nr_interval = "ten"\n')
    assert_one_line_error(run_main(["learn", "--strategy", "replay", "--config", str(config)], capsys),
                          f"{config}: [strategy.replay] r_interval=ten: expected an integer")


def test_set_overrides_a_config_files_table_and_its_bad_value_is_not_refused(tmp_path):
    """The command line wins over the file: `--set r_interval=5` beside a file's `r_interval = "ten"` was
    refused for the file's value."""
    from streamer.cli.checks import check_args

    config = tmp_path / "c.toml"
    config.write_text('[strategy.replay]\nr_interval = "ten"\nn_replay = 3\n')
    args = parse(["learn", "--strategy", "replay", "--config", str(config), "--set", "r_interval=5"])
    check_args(args)
    assert dict(args.strategy_options) == {"r_interval": 5, "n_replay": 3}
    args = parse(["compare", "--strategies", "replay,naive", "--config", str(config), "--set", "r_interval=5"])
    check_args(args)
    assert dict(args.strategy_tables["replay"]) == {"n_replay": 3}


def test_device_cuda_without_one_is_refused_before_any_work(tmp_path, capsys):
    """compare built and produced its stream, then failed at its first run; the files it had left in --out
    refused the same command with --device cpu."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: --device cuda is taken")
    for command in (["compare", "--out", str(tmp_path / "cmp")], ["learn", "--run-dir", str(tmp_path / "run")]):
        assert_one_line_error(run_main([*command, "--device", "cuda"], capsys),
                              "--device cuda: torch sees no CUDA device here")
    assert not any(tmp_path.iterdir())


def test_the_ranks_command_line_is_the_launchers_less_its_nproc_however_it_was_written():
    """`--npro 2`, an abbreviation argparse takes, went on to torchrun, which refused it with 20 lines."""
    from streamer.cli.launch import _without_nproc

    for given in (["--nproc", "2"], ["--nproc=2"], ["--npro", "2"], ["--np=2"]):
        assert _without_nproc(["learn", "--topic", "t", *given, "--threads", "1"]) == [
            "learn", "--topic", "t", "--threads", "1"], given
    assert _without_nproc(["learn", "--no-view", "--n", "x"]) == ["learn", "--no-view", "--n", "x"]


def test_an_allocation_the_machine_refused_is_one_line_naming_its_size():
    """A replay memory of --set memory_size=2000000000 was 70 lines of traceback mid-run (per rank)."""
    import torch

    from streamer.cli.errors import out_of_memory

    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 320000000000 bytes. Error code 12 (Cannot allocate memory)")
    assert out_of_memory(cpu).startswith("out of memory: torch asked for 320.0 GB at once; a smaller --set "
                                         "memory_size")
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")
    assert out_of_memory(gpu).startswith("out of memory: torch asked for 2.00 GiB on the GPU;")
    assert out_of_memory(MemoryError()).startswith("out of memory (Python could not allocate)")
    assert out_of_memory(RuntimeError("shape mismatch")) is None and out_of_memory(ValueError("x")) is None


def test_the_checked_ranges_are_the_ones_the_strategies_take(tiny_model):
    """--set is checked before the model is built, against params' table; a value it lets through that a
    strategy's constructor refuses would fail only after the build (fisher_decay=1 passed the check as
    [0, 1] and EWC raised). At each edge of every ranged hyperparameter, and just past it, what the check
    lets through the constructor takes (the check may be stricter: lr 0 is refused, torch would take it)."""
    from streamer.cli.checks import strategy_signature
    from streamer.cli.flags import STRATEGY_CHOICES
    from streamer.strategies import STRATEGIES, params

    tried = 0
    for name in STRATEGY_CHOICES:
        for key, hyperparameter in strategy_signature(name).items():
            edges = [edge for edge in (hyperparameter.low, hyperparameter.high) if edge is not None]
            for value in [v for edge in edges for v in (edge, edge - 0.5, edge + 0.5)]:
                value = hyperparameter.kind(value) if hyperparameter.kind is float else value
                if hyperparameter.kind is int and value != int(value):
                    continue
                try:
                    hyperparameter.check(value)
                    checked = True
                except params.HyperparameterError:
                    checked = False
                options = {"lr": 1e-3, key: value} if key != "lr" else {key: value}
                try:
                    STRATEGIES[name](tiny_model, **options)
                    built = True
                except ValueError:
                    built = False
                assert built or not checked, (name, key, value)
                tried += checked
    assert tried > 30
