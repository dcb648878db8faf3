"""The run config: TOML + --set -> typed config; every bad input is one clear error, exit 2."""

from __future__ import annotations

import pytest

from conftest import REPO, run_cli
from pipeline.config import Config, load_config, parse_override, save_config
from pipeline.schema import explain, field_docs
from workers.checks import ConfigError


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
    cfg = load_config(None, ["run.time_limit_s=none", "trainer.max_staleness=4", "model.path=/x/y"])
    save_config(cfg, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml") == cfg


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
])
def test_bad_overrides(item, message):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, [item])
    assert message in str(e.value)


def test_every_field_is_documented():
    rows = explain(Config)
    undocumented = [key for key, _, _, doc in rows if not doc]
    assert not undocumented, f"fields without a docstring: {undocumented}"
    assert len(rows) > 40
    assert "Seed of the run" in field_docs(type(Config().run))["seed"]


@pytest.mark.parametrize("args,message", [
    (["config", "missing.toml"], "config file 'missing.toml' does not exist"),
    (["config", "--set", "trainer.lr=-3"], "trainer.lr must be"),
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
