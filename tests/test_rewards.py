"""Rewards: answer extraction, numeric comparison, the built-ins, the weighted list of functions, import
paths and their failures, and which function judges `correct`."""

from __future__ import annotations

import math

import pytest

from workers.checks import ConfigError
from workers.rewards import (BUILTIN_REWARDS, RewardConfig, RewardFunction, Score, Scorer, accuracy_reward,
                             extract_answer, format_reward, is_correct)
from workers.tasks import Prompt

P = Prompt("12+34=", "12+34=", "46", "add2")
H = "tests.helpers.custom_rewards"


@pytest.mark.parametrize("completion, extracted", [
    ("46", "46"),
    ("", None),
    ("abc", None),
    ("12+34=46", "46"),
    ("4-6", "-6"),
    ("the answer is 1,234.", "1,234"),
    ("2.50", "2.50"),
    ("-.5", "-.5"),
    ("<answer>7</answer>", "7"),
    ("99<answer>7</answer>12", "7"),            # the tag wins over the last number
    ("<answer>1</answer><answer>x 2 y</answer>", "2"),  # the last tag, its last number
    ("<answer>none</answer>5", None),           # a tag without a number: no answer
    ("<answer>3", "3"),                         # an unclosed tag is plain text
])
def test_extract_answer(completion, extracted):
    assert extract_answer(completion) == extracted


@pytest.mark.parametrize("completion, answer, correct", [
    ("46", "46", True),
    ("046", "46", True),
    ("46.0", "46", True),
    ("2.50", "2.5", True),
    ("1,234", "1234", True),
    ("1234", "1,234", True),
    ("-22", "-22", True),
    ("22", "-22", False),
    ("45", "46", False),
    ("4", "46", False),
    ("", "46", False),
    ("<think>12+34</think><answer>46</answer>", "46", True),
    ("<think>46</think><answer>47</answer>", "46", False),
    ("Paris", "Paris", True),                   # non-numeric answers compare as text
    ("<answer> Paris </answer>", "Paris", True),
    ("paris", "Paris", False),
])
def test_is_correct(completion, answer, correct):
    assert is_correct(completion, answer) is correct


@pytest.mark.parametrize("completion, value", [
    ("<think>a</think><answer>46</answer>", 1.0),
    ("  <think>\nx y\n</think>\n<answer>46</answer>\n", 1.0),
    ("<think></think><answer></answer>", 1.0),
    ("<answer>46</answer>", 0.0),
    ("<think>a</think>46", 0.0),
    ("<think>a</think><answer>46</answer>extra", 0.0),
    ("46", 0.0),
])
def test_format_reward(completion, value):
    assert format_reward("12+34=", completion, "46") == value


def test_accuracy_reward():
    assert accuracy_reward("12+34=", "<answer>46</answer>", "46") == 1.0
    assert accuracy_reward("12+34=", "45", "46") == 0.0


def test_builtin_registry():
    assert BUILTIN_REWARDS == {"accuracy": accuracy_reward, "format": format_reward}


def rewards(*functions, **kwargs) -> RewardConfig:
    """RewardConfig from (name, weight) pairs."""
    return RewardConfig(tuple(RewardFunction(n, w) for n, w in functions), **kwargs)


def test_default_scorer_is_accuracy_only():
    assert RewardConfig().functions == (RewardFunction("accuracy", 1.0),)
    assert Scorer().score(P, "46") == Score(1.0, {"accuracy": 1.0}, True, None)
    assert Scorer().score(P, "45") == Score(0.0, {"accuracy": 0.0}, False, None)


def test_weighted_sum():
    s = Scorer(rewards(("accuracy", 2.0), ("format", 0.5)))
    assert s.score(P, "<think>t</think><answer>46</answer>") == Score(2.5, {"accuracy": 1.0, "format": 1.0}, True)
    assert s.score(P, "<think>t</think><answer>4</answer>") == Score(0.5, {"accuracy": 0.0, "format": 1.0}, False)
    assert s.score(P, "46") == Score(2.0, {"accuracy": 1.0, "format": 0.0}, True)


def test_two_import_paths_and_a_builtin():
    """The issue's case: two user functions and a built-in, each weighted, each value kept by name."""
    s = Scorer(rewards((f"{H}:length_bonus", 2.0), ("accuracy", 0.5), (f"{H}:is_exact", -3.0)))
    got = s.score(P, "46")   # length_bonus = 0.1 * 2 + 1 = 1.2; accuracy 1; is_exact True -> 1
    assert got.components == pytest.approx({f"{H}:length_bonus": 1.2, "accuracy": 1.0, f"{H}:is_exact": 1.0},
                                           abs=1e-12)
    assert list(got.components) == [f"{H}:length_bonus", "accuracy", f"{H}:is_exact"]   # listed order
    assert got.reward == pytest.approx(2.0 * 1.2 + 0.5 * 1.0 - 3.0 * 1.0, abs=1e-12)
    assert (got.correct, got.error) == (True, None)
    wrong = s.score(P, "4")  # length_bonus 1.1, accuracy 0, is_exact 0
    assert wrong.reward == pytest.approx(2.0 * 1.1, abs=1e-12) and wrong.correct is False


def test_weight_zero_is_recorded_but_adds_nothing():
    s = Scorer(rewards(("accuracy", 0.0), ("format", 1.0)))
    assert s.score(P, "46") == Score(0.0, {"accuracy": 1.0, "format": 0.0}, True)


def test_correct_is_decided_by_the_named_function():
    s = Scorer(rewards(("accuracy", 1.0), ("format", 1.0), correct="format"))
    assert s.score(P, "46").correct is False   # right answer, wrong format
    assert s.score(P, "<think>t</think><answer>1</answer>").correct is True
    exact = Scorer(rewards((f"{H}:length_bonus", 1.0), correct=f"{H}:length_bonus"))
    assert exact.score(P, "").correct is True      # 1.0 (prompt ends with '='): >= 1.0 is correct
    judged_by_bool = Scorer(rewards((f"{H}:is_exact", 1.0), correct=f"{H}:is_exact"))
    assert judged_by_bool.score(P, "46").correct is True and judged_by_bool.score(P, "4").correct is False


def test_custom_reward_by_import_path():
    s = Scorer(rewards(("accuracy", 1.0), (f"{H}:length_bonus", 2.0)))
    got = s.score(P, "46")   # custom = 0.1 * 2 + 1 = 1.2; reward = 1 + 2 * 1.2
    assert got.reward == pytest.approx(3.4, abs=1e-12)
    assert got.components == pytest.approx({"accuracy": 1.0, f"{H}:length_bonus": 1.2}, abs=1e-12)
    assert got.correct is True and got.error is None
    booleans = Scorer(rewards(("accuracy", 0.0), (f"{H}:is_exact", 1.0)))
    assert booleans.score(P, "46").reward == 1.0 and booleans.score(P, "4").reward == 0.0


@pytest.mark.parametrize("fn, error", [
    ("boom", f"{H}:boom raised ValueError: cannot score '46'"),
    ("nan", f"{H}:nan returned nan, not a finite number"),
    ("text", f"{H}:text returned str 'high', not a number"),
    ("none", f"{H}:none returned NoneType None, not a number"),
])
def test_failing_custom_reward_gives_the_fallback_and_an_error(fn, error):
    s = Scorer(rewards(("accuracy", 1.0), (f"{H}:{fn}", 1.0), fallback_reward=-0.5))
    got = s.score(P, "46")
    assert got == Score(-0.5, {"accuracy": 1.0, f"{H}:{fn}": -0.5}, True, error)
    assert s.num_errors == 1
    assert s.score(P, "45").error is not None and s.num_errors == 2   # the scorer goes on


def test_every_failure_is_reported_and_a_failed_judge_leaves_correct_unknown():
    s = Scorer(rewards((f"{H}:boom", 1.0), ("accuracy", 1.0), (f"{H}:nan", 1.0), correct=f"{H}:boom"))
    got = s.score(P, "46")
    assert got == Score(0.0, {f"{H}:boom": 0.0, "accuracy": 1.0, f"{H}:nan": 0.0}, None,
                        f"{H}:boom raised ValueError: cannot score '46'; {H}:nan returned nan, not a finite number")
    assert s.num_errors == 1   # one completion


def test_a_weighted_sum_that_overflows_gives_the_fallback():
    s = Scorer(rewards((f"{H}:huge", 1.0), (f"{H}:huge_too", 1.0), correct=f"{H}:huge", fallback_reward=-1.0))
    got = s.score(P, "46")
    assert (got.reward, got.components) == (-1.0, {f"{H}:huge": 1e308, f"{H}:huge_too": 1e308})
    assert got.error == f"the weighted sum of {H}:huge, {H}:huge_too is inf, not a finite number"


def test_long_error_messages_are_cut():
    got = Scorer(rewards(("accuracy", 1.0), (f"{H}:long_error", 1.0))).score(P, "46")
    assert len(got.error) == 200 and got.error.startswith(f"{H}:long_error raised RuntimeError: xxx")
    assert got.error.endswith("...")


@pytest.mark.parametrize("path, message", [
    ("no_such_module_xyz:f", r"reward.functions\[1\].name = 'no_such_module_xyz:f': cannot import module "
                             r"'no_such_module_xyz' \(ModuleNotFoundError"),
    (f"{H}:missing", rf"reward.functions\[1\].name = '{H}:missing': module '{H}' has no 'missing'"),
    (f"{H}:NOT_CALLABLE", rf"reward.functions\[1\].name = '{H}:NOT_CALLABLE': 'NOT_CALLABLE' is a int, "
                          r"not a function"),
])
def test_bad_import_path_fails_at_construction(path, message):
    with pytest.raises(ConfigError, match=message):
        Scorer(rewards(("accuracy", 1.0), (path, 1.0)))


@pytest.mark.parametrize("make, message", [
    (lambda: RewardFunction("just_a_module"), r'RewardFunction.name must be a built-in reward \(accuracy, format\) '
                                              r'or an import path "module:function"'),
    (lambda: RewardFunction("a:b:c"), r"RewardFunction.name must be a built-in reward .* got 'a:b:c'$"),
    (lambda: RewardFunction("acuracy"), r"got 'acuracy'; did you mean 'accuracy'\?"),
    (lambda: RewardFunction("format", math.nan), r"RewardFunction.weight must be a finite number, got nan"),
    (lambda: RewardFunction("format", "1"), r"RewardFunction.weight must be a finite number, got '1'"),
    (lambda: RewardConfig(()), r"RewardConfig.functions must be a non-empty list"),
    (lambda: rewards(("accuracy", 1.0), ("format", 1.0), ("accuracy", 2.0)),
     r"RewardConfig.functions\[2\].name: 'accuracy' is listed twice \(also functions\[0\]\)"),
    (lambda: rewards(("format", 1.0)), r"RewardConfig.correct = 'accuracy' is not one of the listed functions "
                                       r"\('format'\); name one of them, or add \{name = \"accuracy\", weight = 0.0\}"),
    (lambda: RewardConfig(fallback_reward="0"), r"RewardConfig.fallback_reward must be a finite number, got '0'"),
])
def test_bad_configs(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_components_are_stored_in_the_buffer_by_function_name(tmp_path):
    """Scorer -> buffer Completion -> shard: reward_components holds every function's value under its name."""
    import numpy as np
    import pyarrow.parquet as pq

    from buffer import Completion, Group, ShardWriter

    s = Scorer(rewards(("accuracy", 1.0), (f"{H}:length_bonus", 0.5), (f"{H}:is_exact", 2.0)))
    texts = ["46", "4", "<answer>46</answer>"]
    scores = [s.score(P, t) for t in texts]
    comps = [Completion(t, np.array([5, 6], np.int32), np.array([-0.1, -0.2], np.float32), sc.reward,
                        reward_components=sc.components, correct=sc.correct) for t, sc in zip(texts, scores)]
    with ShardWriter(tmp_path / "buffer", flush_seconds=None) as w:
        w.append(Group(prompt_id="p", prompt=P.text, prompt_ids=[1, 2], version=0, completions=comps))
    rows = pq.read_table(w.shards_written[0]).to_pylist()
    assert [dict(r["reward_components"]) for r in rows] == [
        {"accuracy": 1.0, f"{H}:length_bonus": 1.2, f"{H}:is_exact": 1.0},
        {"accuracy": 0.0, f"{H}:length_bonus": 1.1, f"{H}:is_exact": 0.0},
        {"accuracy": 1.0, f"{H}:length_bonus": 0.1 * 19 + 1.0, f"{H}:is_exact": 0.0}]
    assert [r["reward"] for r in rows] == [1.0 + 0.6 + 2.0, 0.55, 1.0 + 0.5 * (0.1 * 19 + 1.0)]
    assert [r["correct"] for r in rows] == [True, False, True]
