"""Rule-based rewards: accuracy, format, and user functions, as one weighted sum.

    reward = accuracy_weight * accuracy + format_weight * format + custom_weight * custom

- accuracy: 1.0 when the completion's answer equals the prompt's answer, else
  0.0. The completion's answer is the content of its last
  `<answer>...</answer>` when it has one, else the whole completion; from that
  text the last number is taken ("1,234" and "-5" and "2.50" are numbers) and
  compared numerically (exact rationals, so 2.50 == 2.5). A reference answer
  that is not a number is compared as stripped text.
- format: 1.0 when the completion is `<think>...</think><answer>...</answer>`
  (whitespace allowed around the parts), else 0.0.
- custom: a function named by import path "module:function", called as
  `fn(prompt_text, completion, answer) -> float`. If it raises or returns
  something that is not a finite number, the completion gets
  `fallback_reward` as its whole reward, `Score.error` says why, and scoring
  goes on.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from workers.checks import ConfigError, is_num, require
from workers.tasks import Prompt

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_MAX_ERROR_CHARS = 200


@dataclass(frozen=True)
class RewardConfig:
    """How completions are scored; validated on construction."""

    accuracy_weight: float = 1.0
    """Weight of the accuracy reward (1 when the answer is right, else 0)."""
    format_weight: float = 0.0
    """Weight of the format reward (1 for `<think>...</think><answer>...</answer>`, else 0)."""
    custom: str | None = None
    """Extra reward function as "module:function", called fn(prompt_text, completion, answer) -> float."""
    custom_weight: float = 1.0
    """Weight of the custom reward."""
    fallback_reward: float = 0.0
    """Whole reward of a completion whose custom reward function raised or returned a non-number."""

    def __post_init__(self):
        for name in ("accuracy_weight", "format_weight", "custom_weight", "fallback_reward"):
            require(self, name, is_num(getattr(self, name)), "a finite number")
        require(self, "custom", self.custom is None or (isinstance(self.custom, str)
                                                        and _IMPORT_PATH.fullmatch(self.custom) is not None),
                'an import path "module:function" (e.g. "mypkg.rewards:length_penalty") or unset')


@dataclass
class Score:
    """One completion's reward, its parts (unweighted), and whether its answer is right."""

    reward: float
    components: dict[str, float]
    correct: bool | None
    error: str | None = None


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


def format_reward(completion: str) -> float:
    """1.0 for `<think>...</think><answer>...</answer>` (whitespace around parts allowed), else 0.0."""
    return 1.0 if _FORMAT.fullmatch(completion) else 0.0


def import_reward_function(path: str) -> Callable[[str, str, str], float]:
    """The function at "module:function"; ConfigError naming the path if it cannot be imported."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"RewardConfig.custom = {path!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"RewardConfig.custom = {path!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"RewardConfig.custom = {path!r}: {attr!r} is a {type(fn).__name__}, "
                          "not a function")
    return fn


class Scorer:
    """Scores completions with the rewards `cfg` turns on. Imports the custom function once."""

    def __init__(self, cfg: RewardConfig = RewardConfig()):
        self.cfg = cfg
        self.custom_fn = import_reward_function(cfg.custom) if cfg.custom is not None else None
        self.num_errors = 0
        """Completions whose custom reward failed (given the fallback reward)."""

    def score(self, prompt: Prompt, completion: str) -> Score:
        cfg = self.cfg
        correct = is_correct(completion, prompt.answer)
        components = {"accuracy": 1.0 if correct else 0.0}
        if cfg.format_weight != 0.0:
            components["format"] = format_reward(completion)
        reward = cfg.accuracy_weight * components["accuracy"] + cfg.format_weight * components.get("format", 0.0)
        if self.custom_fn is None:
            return Score(reward, components, correct)
        value, error = self._custom(prompt, completion)
        if error is not None:
            self.num_errors += 1
            components["custom"] = cfg.fallback_reward
            return Score(cfg.fallback_reward, components, correct, error)
        components["custom"] = value
        return Score(reward + cfg.custom_weight * value, components, correct)

    def _custom(self, prompt: Prompt, completion: str) -> tuple[float, str | None]:
        try:
            value = self.custom_fn(prompt.text, completion, prompt.answer)
        except Exception as e:
            return math.nan, _short(f"{self.cfg.custom} raised {type(e).__name__}: {e}")
        if not isinstance(value, numbers.Real):
            return math.nan, _short(f"{self.cfg.custom} returned {type(value).__name__} {value!r}, not a number")
        try:
            value = float(value)
        except OverflowError:  # an int past float's range, e.g. 10**400
            return math.nan, _short(f"{self.cfg.custom} returned {value!r}, too large for a float")
        if not math.isfinite(value):
            return math.nan, _short(f"{self.cfg.custom} returned {value}, not a finite number")
        if not math.isfinite(self.cfg.custom_weight * value):
            return math.nan, _short(f"{self.cfg.custom} returned {value}, which times custom_weight "
                                    f"{self.cfg.custom_weight} is not a finite number")
        return value, None


def _short(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[: _MAX_ERROR_CHARS - 3] + "..."
