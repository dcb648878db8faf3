"""Rule-based rewards: a list of weighted reward functions, summed (TRL's `reward_funcs` and
`reward_weights`).

    reward = sum_k weight_k * f_k(prompt_text, completion, answer)

Every function has that one signature and returns a number (a bool counts as 0 or 1). A
function is named either by a key of `BUILTIN_REWARDS` or by an import path
"module:function". Each function's unweighted value is kept in `Score.components`,
keyed by its name (the buffer's `reward_components`), weight 0 included, so a function
can judge `correct` or be watched without moving the reward.

Built-ins:
- accuracy: 1.0 when the completion's answer equals the prompt's answer, else 0.0.
  The completion's answer is the content of its last `<answer>...</answer>` when it
  has one, else the whole completion; from that text the last number is taken
  ("1,234" and "-5" and "2.50" are numbers) and compared numerically (exact
  rationals, so 2.50 == 2.5). A reference answer that is not a number is compared
  as stripped text.
- format: 1.0 when the completion is `<think>...</think><answer>...</answer>`
  (whitespace allowed around the parts), else 0.0.

`correct` is decided by the function that `RewardConfig.correct` names (accuracy by
default): a completion is correct when that function gives it 1.0 or more.

Where this departs from TRL: a function that raises, or returns something that is
not a finite number (or whose weighted value is not finite), does not stop the run
and is not skipped as NaN: the completion gets `fallback_reward` as its whole
reward, the failed functions' components are `fallback_reward` too, `Score.error`
says why (and `correct` is None if the judging function failed), and scoring goes on.
"""

from __future__ import annotations

import difflib
import importlib
import math
import numbers
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

from workers.checks import ConfigError, is_num, require
from workers.grpo.registry import registrar
from workers.tasks import Prompt

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_MAX_ERROR_CHARS = 200

RewardFn = Callable[[str, str, str], float]
"""fn(prompt_text, completion, answer) -> float: the one signature of every reward function."""

BUILTIN_REWARDS: dict[str, RewardFn] = {}
"""The reward functions a config names without an import path."""

_builtin = registrar(BUILTIN_REWARDS, "built-in reward")


def extract_answer(completion: str) -> str | None:
    """The last number of the completion's last <answer> block (or of the whole completion), or None."""
    tagged = _ANSWER_TAG.findall(completion)
    text = tagged[-1] if tagged else completion
    numbers_found = _NUMBER.findall(text)
    return numbers_found[-1] if numbers_found else None


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact rational ("1,234" -> 1234, "2.50" -> 5/2), or None if it is not a number."""
    text = text.strip().replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def is_correct(completion: str, answer: str) -> bool:
    """Whether the completion's answer (see `extract_answer`) equals `answer`."""
    expected = parse_number(answer)
    if expected is None:  # a text answer: the <answer> block, or the whole completion
        tagged = _ANSWER_TAG.findall(completion)
        return (tagged[-1] if tagged else completion).strip() == answer.strip()
    got = extract_answer(completion)
    return got is not None and parse_number(got) == expected


@_builtin("accuracy")
def accuracy_reward(prompt_text: str, completion: str, answer: str) -> float:
    """1.0 when the completion's answer equals `answer` (see `is_correct`), else 0.0."""
    return 1.0 if is_correct(completion, answer) else 0.0


@_builtin("format")
def format_reward(prompt_text: str, completion: str, answer: str) -> float:
    """1.0 for `<think>...</think><answer>...</answer>` (whitespace around parts allowed), else 0.0."""
    return 1.0 if _FORMAT.fullmatch(completion) else 0.0


@dataclass(frozen=True)
class RewardFunction:
    """One term of the reward: a function and its weight; validated on construction."""

    name: str
    """A built-in reward ("accuracy": 1 when the answer is right; "format": 1 for
    `<think>...</think><answer>...</answer>`) or your own as "module:function", called
    fn(prompt_text, completion, answer) -> float. Its value is stored under this name."""
    weight: float = 1.0
    """Its weight in the sum; negative for a penalty, 0 to record it without rewarding it."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or (self.name not in BUILTIN_REWARDS
                                               and _IMPORT_PATH.fullmatch(self.name) is None):
            near = difflib.get_close_matches(self.name, BUILTIN_REWARDS, n=1) if isinstance(self.name, str) else []
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"RewardFunction.name must be a built-in reward ({', '.join(BUILTIN_REWARDS)}) or an "
                              f'import path "module:function" (e.g. "mypkg.rewards:length_penalty"), '
                              f"got {self.name!r}{hint}")
        require(self, "weight", is_num(self.weight), "a finite number")


@dataclass(frozen=True)
class RewardConfig:
    """How completions are scored; validated on construction."""

    functions: tuple[RewardFunction, ...] = (RewardFunction("accuracy"),)
    """The reward functions, each a table with a name and a weight; the reward is their weighted sum.
    Set as a whole list: [[reward.functions]] tables in the file, or
    --set 'reward.functions=[{name = "accuracy"}, {name = "format", weight = 0.5}]'."""
    correct: str = "accuracy"
    """The function (a name in reward.functions) that judges a completion correct when it gives 1.0 or
    more: pass rates, all_correct / all_wrong groups, evaluation accuracy. To judge by accuracy without
    rewarding it, list accuracy with weight 0."""
    fallback_reward: float = 0.0
    """Whole reward of a completion one of whose functions raised or returned a non-number."""

    def __post_init__(self) -> None:
        if isinstance(self.functions, list):
            object.__setattr__(self, "functions", tuple(self.functions))
        require(self, "functions", isinstance(self.functions, tuple) and len(self.functions) > 0
                and all(isinstance(f, RewardFunction) for f in self.functions),
                "a non-empty list of RewardFunction (name, weight)")
        first: dict[str, int] = {}
        for i, f in enumerate(self.functions):
            if f.name in first:
                raise ConfigError(f"RewardConfig.functions[{i}].name: {f.name!r} is listed twice (also "
                                  f"functions[{first[f.name]}]); list each function once, with one weight")
            first[f.name] = i
        if self.correct not in first:
            raise ConfigError(f"RewardConfig.correct = {self.correct!r} is not one of the listed functions "
                              f"({', '.join(map(repr, first))}); name one of them, or add "
                              '{name = "accuracy", weight = 0.0} to judge answers by accuracy without rewarding it')
        require(self, "fallback_reward", is_num(self.fallback_reward), "a finite number")


@dataclass
class Score:
    """One completion's reward, its parts (unweighted, by function name), and whether it is correct."""

    reward: float
    components: dict[str, float]
    correct: bool | None
    error: str | None = None


def import_reward_function(path: str, key: str = "reward function") -> RewardFn:
    """The function at "module:function"; ConfigError naming `key` and the path if it cannot be imported."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"{key} = {path!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{key} = {path!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{key} = {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


@dataclass
class _Term:
    name: str
    weight: float
    fn: RewardFn = field(repr=False)


class Scorer:
    """Scores completions with `cfg`'s reward functions. Imports the user functions once, here."""

    def __init__(self, cfg: RewardConfig = RewardConfig()):
        self.cfg = cfg
        self.terms = [_Term(f.name, f.weight, BUILTIN_REWARDS.get(f.name)
                            or import_reward_function(f.name, f"reward.functions[{i}].name"))
                      for i, f in enumerate(cfg.functions)]
        self.num_errors = 0
        """Completions one of whose reward functions failed (given the fallback reward)."""

    def score(self, prompt: Prompt, completion: str) -> Score:
        components: dict[str, float] = {}
        errors: list[str] = []
        failed: set[str] = set()
        reward = 0.0
        for t in self.terms:
            value, error = _call(t, prompt, completion)
            if error is not None:
                errors.append(error)
                failed.add(t.name)
                value = self.cfg.fallback_reward
            else:
                reward += t.weight * value
            components[t.name] = value
        correct = None if self.cfg.correct in failed else components[self.cfg.correct] >= 1.0
        if not errors and not math.isfinite(reward):
            errors.append(f"the weighted sum of {', '.join(components)} is {reward}, not a finite number")
        if errors:
            self.num_errors += 1
            return Score(self.cfg.fallback_reward, components, correct, _short("; ".join(errors)))
        return Score(reward, components, correct)


def _call(t: _Term, prompt: Prompt, completion: str) -> tuple[float, str | None]:
    """(value, None), or (nan, why) when the function raised or returned no finite number."""
    try:
        value = t.fn(prompt.text, completion, prompt.answer)
    except Exception as e:
        return math.nan, f"{t.name} raised {type(e).__name__}: {e}"
    if not isinstance(value, numbers.Real):
        return math.nan, f"{t.name} returned {type(value).__name__} {value!r}, not a number"
    try:
        value = float(value)
    except OverflowError:  # an int past float's range, e.g. 10**400
        return math.nan, f"{t.name} returned {value!r}, too large for a float"
    if not math.isfinite(value):
        return math.nan, f"{t.name} returned {value}, not a finite number"
    if not math.isfinite(t.weight * value):
        return math.nan, f"{t.name} returned {value}, which times its weight {t.weight} is not a finite number"
    return value, None


def _short(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[: _MAX_ERROR_CHARS - 3] + "..."
