"""Bad input as tables of cases, through the CLI as a user runs it: one paragraph, exit code 2, no traceback.

Config files, prompt files, reward functions and command-line arguments. Misbehaving reward
functions are not user errors: the completion gets the fallback reward and the error is recorded,
so those are checked on the scorer itself.
"""

from __future__ import annotations

import math

import pytest

from conftest import run_cli

def _assert_user_error(r, message: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stderr.startswith("asyncgrpo: error: ") or r.stderr.startswith("Usage: "), r.stderr
    error_lines = [line for line in r.stderr.splitlines() if line.startswith(("asyncgrpo: error:", "Error:"))]
    assert len(error_lines) == 1, r.stderr


@pytest.fixture
def run_dir(tmp_path):
    """A run directory holding only its resolved config (enough for the commands' input checks)."""
    from pipeline.config import load_config, save_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, []), run / "config.toml")
    return run


# ---- config files -------------------------------------------------------------------------------

CONFIG_FILES = [
    ("[trainer]\nlrr = 1e-4\n", "unknown key 'trainer.lrr'; did you mean 'lr'?"),
    ("[trainer.loss]\nepsilonn = 0.2\n", "unknown key 'trainer.loss.epsilonn'; did you mean 'epsilon'?"),
    ("[gnerator]\nnum_generations = 4\n", "unknown key 'gnerator'; did you mean 'generator'?"),
    ("seed = 3\n", "unknown key 'seed'"),
    ("[trainer]\ngroups_per_step = '32'\n", "trainer.groups_per_step: expected an integer, got '32'"),
    ("[trainer]\nlr = [0.1]\n", "trainer.lr: expected a number, got [0.1]"),
    ("[trainer]\nbetas = 0.9\n", "trainer.betas: expected a list of a number, got 0.9"),
    ("[generator]\nnum_generations = true\n", "generator.num_generations: expected an integer, got True"),
    ("[run]\npin_cores = 'yes'\n", "run.pin_cores: expected true or false, got 'yes'"),
    ("[trainer]\ngroups_per_step = -4\n", "trainer.groups_per_step must be"),
    ("[trainer]\nmicro_batch_size = 0\n", "trainer.micro_batch_size must be"),
    ("[trainer]\nmax_staleness = -1\n", "trainer.max_staleness must be"),
    ("[generator]\nprompts_per_batch = 0\n", "generator.prompts_per_batch must be an integer >= 1, got 0"),
    ("[generator]\nflush_groups = -1\n", "generator.flush_groups must be an integer >= 1, got -1"),
    ("[generator]\nflush_seconds = -5.0\n", "generator.flush_seconds must be a number > 0, got -5.0"),
    ("[generator.sampling]\nmax_new_tokens = 0\n", "generator.sampling.max_new_tokens must be"),
    ("[task]\nnum_eval = -3\n", "task.num_eval must be an int >= 1, got -3"),
    ("[run]\neval_size = 0\n", "run.eval_size must be an integer >= 1"),
    ("[run]\ntime_limit_s = -1\n", "run.time_limit_s must be a number of seconds > 0"),
    ("[trainer]\nlr = nan\n", "trainer.lr must be"),
    ("[trainer]\nlr = inf\n", "trainer.lr must be"),
    ("[trainer\nlr = 1\n", "is not valid TOML"),
    ("\xff\xfe[run]\n", "is not UTF-8 text"),
]


@pytest.mark.parametrize("text, message", CONFIG_FILES)
def test_bad_config_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_bytes(text.encode("latin-1"))
    r = run_cli("config", str(path))
    _assert_user_error(r, message)
    assert str(path) in r.stderr                      # the file is named


MODEL_FOLDERS = [
    (None, "model folder '{tmp}/nope' does not exist"),
    ("empty", "has no config.json; is it an HF model folder?"),
    ("config_only", "has no weights (*.safetensors)"),
]


@pytest.mark.parametrize("kind, message", MODEL_FOLDERS)
def test_bad_model_folder(tmp_path, kind, message):
    folder = tmp_path / "nope"
    if kind is not None:
        folder.mkdir()
    if kind == "config_only":
        (folder / "config.json").write_text("{}")
    r = run_cli("run", "--run", str(tmp_path / "r"), "--set", f"model.path={folder}")
    _assert_user_error(r, message.format(tmp=tmp_path))
    assert not (tmp_path / "r").exists()              # nothing was created


# ---- prompt files -------------------------------------------------------------------------------

PROMPT_FILES = [
    (['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2=", "answer": '], "bad.jsonl: line 2: not valid JSON"),
    (['{"prompt": "1+1=", "answer": "2"}', 'prompt: 2+2='], "bad.jsonl: line 2: not valid JSON"),
    (['{"prompt": "1+1=", "answer": "2"}', '', '', '{"answer": "4"}'], "bad.jsonl: line 4: no 'prompt' key"),
    (['{"prompt": "1+1="}'], "bad.jsonl: line 1: no 'answer' key (keys: ['prompt'])"),
    (['{"prompt": "1+1=", "answer": ""}'], "bad.jsonl: line 1: 'answer' is empty"),
    (['{"prompt": "1+1=", "answer": null}'], "bad.jsonl: line 1: 'answer' must be a string or number"),
    (['{"prompt": 7, "answer": "7"}'], "bad.jsonl: line 1: 'prompt' must be a non-empty string"),
    (['"just a string"'], "bad.jsonl: line 1: expected a JSON object, got str"),
    ([], "bad.jsonl' holds no prompts (empty file)"),
    (['', '  ', ''], "bad.jsonl' holds no prompts (empty file)"),
    (['{"prompt": "1+1=", "answer": "2"}'], "holds 1 prompts, too few to hold out"),
]


@pytest.mark.parametrize("lines, message", PROMPT_FILES)
def test_bad_prompt_file(run_dir, lines, message):
    path = run_dir / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    num_eval = 5 if "too few" in message else 1
    r = run_cli("generate", "--run", str(run_dir), "--set", "task.name=file", "--set", f"task.path={path}",
                "--set", f"task.num_eval={num_eval}")
    _assert_user_error(r, message)


def test_missing_and_binary_prompt_files(run_dir):
    (run_dir / "bin.jsonl").write_bytes(b"\x00\xff\xfe{\n")
    cases = [(run_dir / "absent.jsonl", "prompt file '{p}' does not exist"),
             (run_dir / "bin.jsonl", "bin.jsonl: line 1: not UTF-8 text (byte 2: b'\\xff')")]
    for path, message in cases:
        r = run_cli("generate", "--run", str(run_dir), "--set", "task.name=file", "--set", f"task.path={path}",
                    "--set", "task.num_eval=1")
        _assert_user_error(r, message.format(p=path))


# ---- reward functions ---------------------------------------------------------------------------

REWARD_PATHS = [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("tests.helpers.bad_rewards:missing", "module 'tests.helpers.bad_rewards' has no 'missing'"),
    ("just_a_module", 'reward.functions[1].name must be a built-in reward (accuracy, format) or an import path'),
    ("tests.helpers.custom_rewards:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
]


@pytest.mark.parametrize("path, message", REWARD_PATHS)
def test_bad_reward_import_path(run_dir, path, message):
    _assert_user_error(run_cli("generate", "--run", str(run_dir), "--set",
                               f'reward.functions=[{{name = "accuracy"}}, {{name = "{path}"}}]'), message)


B = "tests.helpers.bad_rewards"
MISBEHAVING_REWARDS = [
    ("infinite", f"{B}:infinite returned inf, not a finite number"),
    ("numpy_nan", f"{B}:numpy_nan returned nan, not a finite number"),
    ("huge_int", f"{B}:huge_int returned {10 ** 400!r}, too large for a float"[:197] + "..."),
    ("near_max", f"{B}:near_max returned 1e+308, which times its weight 2.0 is not a finite number"),
    ("a_list", f"{B}:a_list returned list [1.0], not a number"),
    ("key_error", f"{B}:key_error raised KeyError: 'score'"),
    ("wrong_arity", f"{B}:wrong_arity raised TypeError: wrong_arity() takes 1 positional argument but 3 were given"),
]


@pytest.mark.parametrize("fn, error", MISBEHAVING_REWARDS)
def test_misbehaving_reward_gives_the_fallback_and_goes_on(fn, error):
    from workers.rewards import RewardConfig, RewardFunction, Scorer
    from workers.tasks import Prompt

    s = Scorer(RewardConfig((RewardFunction("accuracy"), RewardFunction(f"{B}:{fn}", 2.0)), fallback_reward=-1.0))
    got = s.score(Prompt("1+1=", "1+1=", "2", "add2"), "2")
    assert (got.reward, got.components, got.correct, got.error) == (-1.0, {"accuracy": 1.0, f"{B}:{fn}": -1.0},
                                                                     True, error)
    assert math.isfinite(got.reward) and s.num_errors == 1


def test_a_numpy_integer_reward_is_a_number():
    from workers.rewards import RewardConfig, RewardFunction, Scorer
    from workers.tasks import Prompt

    got = Scorer(RewardConfig((RewardFunction("accuracy", 0.0), RewardFunction(f"{B}:numpy_int")))).score(
        Prompt("1+1=", "1+1=", "2", "add2"), "2")
    assert (got.reward, got.error) == (2.0, None)


# ---- command-line arguments ---------------------------------------------------------------------

CLI_ARGS = [
    (["config", "--set", "trainer.lr"], "--set 'trainer.lr': expected SECTION.KEY=VALUE"),
    (["config", "--set", "=1"], "--set '=1': expected SECTION.KEY=VALUE"),
    (["config", "--set", "trainer..lr=1"], "expected SECTION.KEY=VALUE"),
    (["config", "--set", "trainer.lr=fast"], "trainer.lr: expected a number, got 'fast'"),
    (["config", "--set", "trainer=3"], "trainer: expected a table of settings, got 3"),
    (["config", "--set", "nosuch.key=1"], "unknown key 'nosuch'"),
    (["config", "--bogus"], "No such option '--bogus'"),
    (["sql", "{run}", "SELECT 1", "--limit", "3"], "No such option '--limit'"),
    (["frobnicate"], "No such command 'frobnicate'"),
    (["sql"], "Missing argument 'PATH'"),
    (["generate"], "Missing option '--run'"),
    (["generate", "--run", "{run}", "--index", "-1"], "-1 is not in the range x>=0"),
    (["generate", "--run", "{run}", "--index", "two"], "'two' is not a valid integer"),
    (["train", "--run", "{tmp}/absent"], "run directory '{tmp}/absent' does not exist"),
    (["generate", "--run", "{tmp}"], "is not a run directory (no config.toml)"),
    (["eval", "--run", "{run}", "--version", "-2"], "-2 is not in the range x>=0"),
    (["eval", "--run", "{run}", "--size", "0"], "0 is not in the range x>=1"),
    (["run", "--run", "{run}"], "already holds a run; pass --resume"),
    (["run", "{tmp}/x.toml", "--resume", "--run", "{run}"], "--resume takes the config saved in the run"),
    (["run", "--resume", "--run", "{tmp}/absent"], "is not a run directory (no config.toml)"),
    (["sql", "{tmp}/absent", "SELECT 1"], "path not found: {tmp}/absent"),
    (["sql", "{run}", "SELECT 1"], "not a buffer or run directory: {run}"),
    (["status", "{run}", "--reuse", "0"], "0 is not in the range x>=1"),
    (["compact", "{tmp}/absent"], "path not found: {tmp}/absent"),
    (["init-model", "{run}"], "exists; pass --force to overwrite it"),
    (["demo", "{run}", "--groups", "0"], "0 is not in the range x>=1"),
]


@pytest.mark.parametrize("args, message", CLI_ARGS)
def test_bad_command_line(tmp_path, run_dir, args, message):
    fill = {"run": str(run_dir), "tmp": str(tmp_path)}
    _assert_user_error(run_cli(*[a.format(**fill) for a in args]), message.format(**fill))


def test_no_query_on_empty_stdin(tmp_path):
    from buffer import ShardWriter

    ShardWriter(tmp_path / "buffer").close()
    _assert_user_error(run_cli("sql", str(tmp_path), input="  \n"), "no query given")
