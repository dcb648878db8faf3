"""Rewards: answer extraction, numeric comparison, format, weighted sum, custom functions and their failures."""

from __future__ import annotations

import math

import pytest

from workers.checks import ConfigError
from workers.rewards import RewardConfig, Score, Scorer, extract_answer, format_reward, is_correct
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
    assert format_reward(completion) == value


def test_default_scorer_is_accuracy_only():
    assert Scorer().score(P, "46") == Score(1.0, {"accuracy": 1.0}, True, None)
    assert Scorer().score(P, "45") == Score(0.0, {"accuracy": 0.0}, False, None)


def test_weighted_sum():
    s = Scorer(RewardConfig(accuracy_weight=2.0, format_weight=0.5))
    assert s.score(P, "<think>t</think><answer>46</answer>") == Score(2.5, {"accuracy": 1.0, "format": 1.0}, True)
    assert s.score(P, "<think>t</think><answer>4</answer>") == Score(0.5, {"accuracy": 0.0, "format": 1.0}, False)
    assert s.score(P, "46") == Score(2.0, {"accuracy": 1.0, "format": 0.0}, True)


def test_custom_reward_by_import_path():
    s = Scorer(RewardConfig(accuracy_weight=1.0, custom=f"{H}:length_bonus", custom_weight=2.0))
    got = s.score(P, "46")   # custom = 0.1 * 2 + 1 = 1.2; reward = 1 + 2 * 1.2
    assert got.reward == pytest.approx(3.4, abs=1e-12)
    assert got.components == pytest.approx({"accuracy": 1.0, "custom": 1.2}, abs=1e-12)
    assert got.correct is True and got.error is None
    booleans = Scorer(RewardConfig(accuracy_weight=0.0, custom=f"{H}:is_exact"))
    assert booleans.score(P, "46").reward == 1.0 and booleans.score(P, "4").reward == 0.0


@pytest.mark.parametrize("fn, error", [
    ("boom", f"{H}:boom raised ValueError: cannot score '46'"),
    ("nan", f"{H}:nan returned nan, not a finite number"),
    ("text", f"{H}:text returned str 'high', not a number"),
    ("none", f"{H}:none returned NoneType None, not a number"),
])
def test_failing_custom_reward_gives_the_fallback_and_an_error(fn, error):
    s = Scorer(RewardConfig(accuracy_weight=1.0, custom=f"{H}:{fn}", fallback_reward=-0.5))
    got = s.score(P, "46")
    assert got == Score(-0.5, {"accuracy": 1.0, "custom": -0.5}, True, error)
    assert s.num_errors == 1
    assert s.score(P, "45").error is not None and s.num_errors == 2   # the scorer goes on


def test_long_error_messages_are_cut():
    got = Scorer(RewardConfig(custom=f"{H}:long_error")).score(P, "46")
    assert len(got.error) == 200 and got.error.startswith(f"{H}:long_error raised RuntimeError: xxx")
    assert got.error.endswith("...")


@pytest.mark.parametrize("path, message", [
    ("no_such_module_xyz:f", r"RewardConfig.custom = 'no_such_module_xyz:f': cannot import module "
                             r"'no_such_module_xyz' \(ModuleNotFoundError"),
    (f"{H}:missing", rf"RewardConfig.custom = '{H}:missing': module '{H}' has no 'missing'"),
    (f"{H}:NOT_CALLABLE", rf"RewardConfig.custom = '{H}:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not a function"),
])
def test_bad_import_path_fails_at_construction(path, message):
    with pytest.raises(ConfigError, match=message):
        Scorer(RewardConfig(custom=path))


@pytest.mark.parametrize("kwargs, message", [
    ({"custom": "just_a_module"}, r"RewardConfig.custom must be an import path \"module:function\""),
    ({"custom": "a:b:c"}, r"RewardConfig.custom must be an import path"),
    ({"accuracy_weight": math.nan}, r"RewardConfig.accuracy_weight must be a finite number, got nan"),
    ({"fallback_reward": "0"}, r"RewardConfig.fallback_reward must be a finite number, got '0'"),
])
def test_bad_configs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RewardConfig(**kwargs)
