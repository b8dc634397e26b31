"""`--params N` sizes each strategy's model to the budget; `--config FILE` sets flag defaults and hyperparameters."""

from pathlib import Path

import pytest

from streamer.budget import BudgetError, fit_hidden, fit_to_budget, strategy_parameters
from streamer.cli import parse
from streamer.config import LearnConfig
from streamer.models import LSTMConfig
from streamer.strategies import STRATEGIES

def config(strategy="naive", hidden=32, **options):
    return LearnConfig(bootstrap_servers="", topic="", run_dir=Path("unused"), strategy=strategy,
                       strategy_options=tuple(options.items()), model=LSTMConfig(embedding=16, hidden=hidden))


def test_fit_hidden_by_hand():
    count = lambda h: 10 * h * h  # noqa: E731  (10, 40, 90, 160, 250, 360, ...)
    assert fit_hidden(count, 100) == (3, 90)  # |100-90| = 10 < |160-100| = 60
    assert fit_hidden(count, 140) == (4, 160)  # |140-90| = 50 > |160-140| = 20
    assert fit_hidden(count, 125) == (3, 90)  # 125-90 = 35 = 160-125: a tie keeps the smaller model
    assert fit_hidden(count, 160) == (4, 160)  # exact
    assert fit_hidden(count, 5) == (1, 10)
    with pytest.raises(BudgetError):
        fit_hidden(count, 0)


def test_lstm_parameter_count_by_hand():
    # embedding 256x16; layer 1: 4h(16+h) + 8h; layer 2: 4h(2h) + 8h; decoder h*256 + 256; at h=10:
    # 4096 + (1040 + 80) + (800 + 80) + 2816 = 8912
    assert strategy_parameters(config(hidden=10)) == 8912


@pytest.mark.parametrize("strategy, options", [("naive", {}), ("poe", {"n_experts": 3}), ("independent", {})])
def test_sized_models_land_within_a_few_percent_of_the_budget_and_grow_with_it(strategy, options):
    hiddens = []
    for budget in (100_000, 300_000, 1_000_000):
        sized, fitted = fit_to_budget(config(strategy, **options), budget)
        assert abs(fitted.parameters - budget) / budget < 0.03, (budget, fitted)
        assert strategy_parameters(sized) == fitted.parameters == strategy_parameters(
            config(strategy, hidden=fitted.hidden, **options))
        hiddens.append(fitted.hidden)
    assert hiddens == sorted(hiddens) and len(set(hiddens)) == 3
    counts = [strategy_parameters(config(strategy, hidden=h, **options)) for h in (8, 16, 32, 64)]
    assert counts == sorted(counts) and len(set(counts)) == 4  # monotone in the hidden size


def test_a_mixture_at_equal_budget_has_smaller_experts_than_naive():
    _, naive = fit_to_budget(config("naive"), 400_000)
    _, poe = fit_to_budget(config("poe", n_experts=4), 400_000)
    assert poe.hidden < naive.hidden


def test_fixed_size_models_and_too_small_budgets_are_refused(monkeypatch):
    from streamer.models import registry

    def fixed(request):  # a pretrained model: its size does not follow --hidden
        return registry.BuiltModel(model=registry.LSTMLanguageModel(LSTMConfig(embedding=4, hidden=4)),
                                   encode=registry.byte_encode, name="fixed")

    monkeypatch.setitem(registry.MODELS, "fixed", fixed)
    fixed_config = LearnConfig(bootstrap_servers="", topic="", run_dir=Path("u"), model_name="fixed")
    with pytest.raises(BudgetError, match="fixed size"):
        fit_to_budget(fixed_config, 10_000)
    with pytest.raises(BudgetError, match="below the smallest"):
        fit_to_budget(config(), 100)


def test_params_flag_sizes_the_learn_config(capsys):
    from streamer.cli.configs import learn_config

    args = parse(["learn", "--params", "200000", "--embedding", "16", "--strategy", "replay"])
    learn = learn_config(args, bootstrap="", topic="", group="g", run_dir=Path("r"), manifest=None)
    assert abs(strategy_parameters(learn) - 200_000) / 200_000 < 0.03
    assert "--params 200,000: replay with hidden" in capsys.readouterr().out


def write(tmp_path, text):
    path = tmp_path / "streamer.toml"
    path.write_text(text)
    return str(path)


def test_config_file_sets_flag_defaults_and_hyperparameters_and_the_command_line_wins(tmp_path):
    path = write(tmp_path, """
fragments = 5
lambda = 3000
given-order = ["en", "fr"]
no_view = true
lr = 0.01

[strategy]
name = "replay"

[strategy.replay]
p_write = 0.05
n_replay = 7

[strategy.ewc]
boundary = "every:10"

[model]
name = "lstm-char"
""")
    args = parse(["demo", "--config", path, "--fragments", "9", "--set", "n_replay=3"])
    assert args.fragments == 9  # the command line wins
    assert args.mean_tokens == 3000 and args.given_order == ("en", "fr") and args.no_view is True
    assert args.lr == 0.01 and args.strategy == "replay" and args.model_name == "lstm-char"
    assert dict(args.strategy_options) == {"p_write": 0.05, "n_replay": 3}  # --set after the file's
    assert args.strategy_options[0] == ("p_write", 0.05)
    assert args.strategy_tables["ewc"] == {"boundary": "every:10"}
    plain = parse(["demo", "--fragments", "9"])
    assert plain.mean_tokens == 10_000 and plain.strategy == "naive" and plain.strategy_options == []


def test_compare_takes_each_strategy_table_and_the_matching_set_entries(tmp_path):
    from streamer.cli import UserError
    from streamer.cli.compare import strategy_options

    path = write(tmp_path, 'seeds = [0, 1, 2]\nstrategies = "naive,replay"\n[strategy.replay]\np_write = 0.2\n')
    args = parse(["compare", "--config", path, "--set", "r_interval=50"])
    assert args.seeds == (0, 1, 2) and args.strategies == "naive,replay"
    options = strategy_options(["naive", "replay", "ewc"], args.strategy_tables, args.strategy_options)
    assert options == {"naive": (), "replay": (("p_write", 0.2), ("r_interval", 50)), "ewc": ()}
    with pytest.raises(UserError, match="no_such"):
        strategy_options(["naive"], {}, [("no_such", 1)])


@pytest.mark.parametrize("text, needle", [
    ("no_such_flag = 1\n", "no_such_flag: unknown key"),
    ("fragments = 0\n", "fragments"),
    ("detector = \"weekly\"\n", "'weekly' is not one of"),
    ("[strategy.nonsense]\nx = 1\n", "[strategy.nonsense]: unknown strategy"),
    ("[strategy.replay]\np_wirte = 0.1\n", "p_wirte: not a hyperparameter of replay"),
    ("[strategy.replay]\nlr = 0.1\n", "lr: not a hyperparameter"),
    ("set = 1\n", "use [strategy.<name>] tables"),
    ("fragments = \n", "not valid TOML"),
    # as the README had it: TOML's own words were all the error said
    ('strategy = "replay"\n[strategy.replay]\np_write = 0.5\n', '[strategy] name = "..."'),
    ('model = "lstm-word"\n[model]\nvocab = "v.txt"\n', '[model] name = "..."'),
])
def test_config_file_errors_are_one_line(tmp_path, capsys, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_info:
        parse(["learn", "--config", path])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err and path in err


def test_every_strategy_table_key_is_a_constructor_argument():
    from streamer.cli.config_file import strategy_hyperparameters

    for name in [*STRATEGIES, "multitask"]:
        assert {"model", "lr", "clip"}.isdisjoint(strategy_hyperparameters(name))
    assert "carry_state" in strategy_hyperparameters("multitask")
