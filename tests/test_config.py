"""The run config: TOML + --set -> typed config; every bad input is one clear error, exit 2."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from conftest import REPO, run_cli
from pipeline.config import Config, load_config, parse_override, save_config, with_overrides
from pipeline.schema import build, explain, explain_toml, field_docs, to_dict
from workers.checks import ConfigError
from workers.rewards import RewardConfig, RewardFunction, Scorer
from workers.tasks import Prompt


def _write(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_and_shipped_configs_load():
    assert load_config() == Config()
    assert load_config(REPO / "configs" / "default.toml").run.num_generators == 1
    gpu = load_config(REPO / "configs" / "gpu_vllm.toml")
    assert gpu.generator.backend == "vllm" and gpu.trainer.dtype == "bfloat16"


def test_overrides_are_typed():
    cfg = load_config(None, ["trainer.lr=1e-5", "generator.num_generations=4", "run.time_limit_s=none",
                             "task.seed=7"])
    assert cfg.trainer.lr == 1e-5 and cfg.generator.num_generations == 4
    assert cfg.run.time_limit_s is None and cfg.task.seed == 7
    assert parse_override("model.path=/m/x") == ("model.path", "/m/x")
    assert parse_override("trainer.loss.epsilon = 0.3") == ("trainer.loss.epsilon", 0.3)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["run.time_limit_s=none", "trainer.max_staleness=4", "model.path=/x/y",
                             'reward.functions=[{name = "accuracy", weight = 0.0}, {name = "format"}]'])
    save_config(cfg, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml") == cfg
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]   # no temp file left behind
    save_config(load_config(), tmp_path / "config.toml")             # replaces it
    assert load_config(tmp_path / "config.toml") == Config()


BAD = [
    ("[trainer]\nlrr = 1\n", "unknown key 'trainer.lrr'; did you mean 'lr'?"),
    ("[trainer]\nlr = 'fast'\n", "trainer.lr: expected a number, got 'fast'"),
    ("[trainer]\nlr = -1.0\n", "trainer.lr must be"),
    ("[generator]\nnum_generations = 1\n", "generator.num_generations must be an integer >= 2, got 1"),
    ("[generator]\nnum_generations = 2.5\n", "generator.num_generations: expected an integer, got 2.5"),
    ("[generator]\nbackend = 'tgi'\n", "generator.backend: expected one of 'hf', 'vllm', got 'tgi'"),
    ("[generator.sampling]\ntemperature = 0\n", "generator.sampling.temperature must be"),
    ("[trainer.loss]\nepsilon = 1.5\n", "trainer.loss.epsilon must be a number in [0, 1), got 1.5"),
    ("[run]\nnum_generators = -1\n", "run.num_generators must be an integer >= 1, got -1"),
    ("[run]\nnum_generators = true\n", "run.num_generators: expected an integer, got True"),
    ("[bogus]\nx = 1\n", "unknown key 'bogus'"),
    ("[trainer]\nloss = 3\n", "trainer.loss: expected a table of settings, got 3"),
    ("run = [\n", "is not valid TOML"),
    ("[generator]\nbackend = 'vllm'\n", "generator.backend = 'vllm' needs model.path"),
    # rewards: a list of tables; every error names the entry
    ("[[reward.functions]]\nname = 'acuracy'\n",
     "reward.functions[0].name must be a built-in reward (accuracy, format) or an import path \"module:function\" "
     "(e.g. \"mypkg.rewards:length_penalty\"), got 'acuracy'; did you mean 'accuracy'?"),
    ("[[reward.functions]]\nname = 'accuracy'\n[[reward.functions]]\nname = 'mypkg.rewards'\n",
     "reward.functions[1].name must be a built-in reward (accuracy, format) or an import path \"module:function\" "
     "(e.g. \"mypkg.rewards:length_penalty\"), got 'mypkg.rewards'"),
    ("[[reward.functions]]\nname = 'accuracy'\n[[reward.functions]]\nname = 'format'\n"
     "[[reward.functions]]\nname = 'accuracy'\nweight = 2.0\n",
     "reward.functions[2].name: 'accuracy' is listed twice (also functions[0]); list each function once"),
    ("[[reward.functions]]\nname = 'accuracy'\nweight = 'high'\n",
     "reward.functions[0].weight: expected a number, got 'high'"),
    ("[[reward.functions]]\nname = 'accuracy'\nweight = nan\n",
     "reward.functions[0].weight must be a finite number, got nan"),
    ("[[reward.functions]]\nname = 'accuracy'\n[[reward.functions]]\nweight = 1.0\n",
     "reward.functions[1].name is missing; it has no default and must be given (a string)"),
    ("[[reward.functions]]\nname = 'accuracy'\nwieght = 2.0\n",
     "unknown key 'reward.functions[0].wieght'; did you mean 'weight'?"),
    ("[reward]\nfunctions = ['accuracy']\n", "reward.functions[0]: expected a table of settings, got 'accuracy'"),
    ("[reward]\nfunctions = 'accuracy'\n",
     "reward.functions: expected a list of tables (name, weight), got 'accuracy'"),
    ("[reward]\nfunctions = []\n", "reward.functions must be a non-empty list of RewardFunction"),
    ("[[reward.functions]]\nname = 'format'\n",
     "reward.correct = 'accuracy' is not one of the listed functions ('format'); name one of them, or add "
     "{name = \"accuracy\", weight = 0.0} to judge answers by accuracy without rewarding it"),
    ("[reward]\ncorrect = 'format'\n", "reward.correct = 'format' is not one of the listed functions ('accuracy')"),
    ("[reward]\nfallback_reward = inf\n", "reward.fallback_reward must be a finite number, got inf"),
    ("[reward]\naccuracy_weight = 2.0\nformat_weight = 0.5\n",
     "reward.accuracy_weight, reward.format_weight: rewards are now a list of functions (built-in accuracy and "
     "format, or \"module:function\"), each with a weight; in the [reward] table, replace these keys with: "
     "functions = [{name = \"accuracy\", weight = 2.0}, {name = \"format\", weight = 0.5}]"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_config_files(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    assert message in str(e.value)
    assert "c.toml" in str(e.value)


@pytest.mark.parametrize("item,message", [
    ("trainer.lr", "expected SECTION.KEY=VALUE"),
    ("trainer..lr=1", "expected SECTION.KEY=VALUE"),
    ("trainer.lr=abc", "trainer.lr: expected a number, got 'abc'"),
    ("trainer.nope=1", "unknown key 'trainer.nope'"),
    ("reward.functions[0].weight=2", "entries of a list are not set one by one; set the whole list, e.g. "
                                     "--set 'reward.functions=[{name = \"accuracy\"}, {name = \"format\", "
                                     "weight = 0.5}]', or write it in the config file"),
    ("reward.functions={name = 'accuracy'}", "reward.functions: expected a list of tables (name, weight)"),
    ("reward.custom=a.b:c", "reward.custom: rewards are now a list of functions"),
])
def test_bad_overrides(item, message):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, [item])
    assert message in str(e.value)


def test_every_field_is_documented():
    rows = explain(Config)
    assert {"reward.functions[].name", "reward.functions[].weight"} <= {key for key, *_ in rows}
    undocumented = [key for key, _, _, doc in rows if not doc]
    assert not undocumented, f"fields without a docstring: {undocumented}"
    assert len(rows) > 40
    assert "Seed of the run" in field_docs(type(Config().run))["seed"]


@pytest.mark.parametrize("args,message", [
    (["config", "missing.toml"], "config file 'missing.toml' does not exist"),
    (["config", "--set", "trainer.lr=-3"], "trainer.lr must be"),
    (["config", "--set", 'reward.functions=[{name = "accuracy"}, {name = "no_such_module_xyz:f"}]'],
     "reward.functions[1].name = 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"),
    (["run", "--run", "{tmp}/r", "--set", "generator.num_generations=0"], "generator.num_generations must be"),
    (["run", "--run", "{tmp}/r", "--set", "model.path={tmp}/nope"], "does not exist"),
    (["train", "--run", "{tmp}/absent"], "run directory"),
    (["generate", "--run", "{tmp}"], "not a run directory"),
    (["eval", "--run", "{tmp}/absent"], "does not exist"),
])
def test_cli_config_errors_exit_2_and_start_nothing(tmp_path, args, message):
    r = run_cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r" / "logs").exists()  # nothing started


def test_partial_nested_table_keeps_the_fields_own_default(tmp_path):
    # TrainerConfig.loss defaults to the decoupled objective; setting one loss field must not
    # fall back to PolicyLossConfig's class default ("bypass").
    base = Config().trainer.loss.objective
    assert load_config(None, ["trainer.loss.beta=0.1"]).trainer.loss.objective == base
    cfg = load_config(_write(tmp_path, "[trainer.loss]\nepsilon = 0.1\n"))
    assert cfg.trainer.loss.objective == base and cfg.trainer.loss.epsilon == 0.1


def test_configs_are_checked_without_importing_torch(tmp_path):
    """`asyncgrpo config` and every command's input checks answer in a fraction of a second: reading and
    validating a config (PolicyLossConfig included) imports no torch."""
    import subprocess
    import sys

    code = ("import sys; from pipeline.config import load_config; "
            "c = load_config(None, ['trainer.loss.loss_agg_mode=seq-mean-token-mean']); "
            "print(c.trainer.loss.loss_agg_mode, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["seq-mean-token-mean", "False"]


def test_grpo_registries_hold_exactly_the_names_configs_accept():
    from workers.grpo.aggregation import AGGREGATORS
    from workers.grpo.kl import KL_ESTIMATORS
    from workers.grpo.options import KL_ESTIMATOR_NAMES, LOSS_AGG_MODES, check_registry

    assert tuple(AGGREGATORS) == LOSS_AGG_MODES and tuple(KL_ESTIMATORS) == KL_ESTIMATOR_NAMES
    with pytest.raises(RuntimeError, match=r"KL estimator registry holds \('k1', 'k2'\), but workers.grpo"):
        check_registry({"k1": None, "k2": None}, KL_ESTIMATOR_NAMES, "KL estimator")


# ---- rewards as a list --------------------------------------------------------------------------------

H = "tests.helpers.custom_rewards"
REWARDS_TOML = f"""
[reward]
fallback_reward = -1.0

[[reward.functions]]
name = "accuracy"
weight = 1.0

[[reward.functions]]
name = "{H}:length_bonus"
weight = 0.5

[[reward.functions]]
name = "{H}:is_exact"
weight = 2
"""


def test_reward_functions_from_a_file_set_and_saved(tmp_path):
    cfg = load_config(_write(tmp_path, REWARDS_TOML))
    assert cfg.reward == RewardConfig((RewardFunction("accuracy", 1.0), RewardFunction(f"{H}:length_bonus", 0.5),
                                       RewardFunction(f"{H}:is_exact", 2.0)), "accuracy", -1.0)
    assert isinstance(cfg.reward.functions[2].weight, float)
    save_config(cfg, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml") == cfg
    got = Scorer(cfg.reward).score(Prompt("12+34=", "12+34=", "46", "add2"), "46")
    assert got.reward == 1.0 + 0.5 * 1.2 + 2.0 and got.correct is True
    # --set replaces the whole list, in a file's config or a resolved one
    only = 'reward.functions=[{name = "accuracy", weight = 0.0}, {name = "format", weight = 0.5}]'
    expected = (RewardFunction("accuracy", 0.0), RewardFunction("format", 0.5))
    assert load_config(_write(tmp_path, REWARDS_TOML), [only]).reward.functions == expected
    assert with_overrides(cfg, [only]).reward.functions == expected
    assert with_overrides(cfg, [f"reward.correct={H}:is_exact"]).reward.correct == f"{H}:is_exact"


def test_the_error_for_old_reward_keys_gives_a_list_that_loads(tmp_path):
    old = "[reward]\naccuracy_weight = 0.0\ncustom = 'tests.helpers.custom_rewards:is_exact'\ncustom_weight = 2.0\n"
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, old))
    suggested = str(e.value).split("replace these keys with: ")[1].split(" (--set")[0]
    assert suggested == f'functions = [{{name = "accuracy", weight = 0.0}}, {{name = "{H}:is_exact", weight = 2.0}}]'
    expected = (RewardFunction("accuracy", 0.0), RewardFunction(f"{H}:is_exact", 2.0))
    assert load_config(_write(tmp_path, f"[reward]\n{suggested}\n")).reward.functions == expected
    assert load_config(None, ["reward." + suggested.replace(" = ", "=", 1)]).reward.functions == expected


def test_a_run_directory_saved_before_the_list_gets_the_replacement(tmp_path):
    saved = ('[reward]\naccuracy_weight = 1.0\nformat_weight = 0.0\ncustom = "none"\ncustom_weight = 1.0\n'
             "fallback_reward = 0.0\n")   # what save_config wrote for the old defaults
    with pytest.raises(ConfigError, match=r"c.toml': reward.accuracy_weight, reward.format_weight, reward.custom, "
                                          r"reward.custom_weight: .* functions = \[\{name = \"accuracy\", "
                                          r"weight = 1.0\}\] \(--set"):
        load_config(_write(tmp_path, saved))


# ---- config --explain prints the defaults a run really gets -----------------------------------------------

def _differences(got, want, key: str = "") -> list[str]:
    """Every leaf field where two config trees differ (value or type), as 'key: got != want'."""
    out = []
    for f in dataclasses.fields(want):
        g, w, k = getattr(got, f.name), getattr(want, f.name), f"{key}.{f.name}".lstrip(".")
        if dataclasses.is_dataclass(w) and not isinstance(w, type):
            out += _differences(g, w, k)
        elif g != w or type(g) is not type(w):
            out.append(f"{k}: explained {g!r} != constructed {w!r}")
    return out


def test_explain_prints_the_defaults_the_daemons_get(tmp_path):
    r = run_cli("config", "--explain")
    assert r.returncode == 0, r.stderr
    assert r.stdout == explain_toml(Config) + "\n"
    explained = tomllib.loads(r.stdout)   # the output is itself a TOML file of every default
    # The whole config, against what a run with an empty config file resolves and the typed default
    assert _differences(build(Config, explained), load_config(_write(tmp_path, ""))) == []
    assert _differences(build(Config, explained), Config()) == []
    # Each section alone (its nested sections included, e.g. trainer.loss), against the component's
    # own constructor: TrainerConfig(), GeneratorConfig(), ... as the daemons build them
    for f in dataclasses.fields(Config):
        cls = f.default_factory
        assert _differences(build(cls, explained[f.name], f.name), cls(), f.name) == []
    for key, _, default, _ in explain(Config):   # the rows themselves, not only the rendering
        if "[]" not in key:
            want = Config()
            for part in key.split("."):
                want = getattr(want, part)
            assert default == want and type(default) is type(want), key
    assert explained == to_dict(Config())   # and no field is left out (build would fill it in)
