"""Groups and their statistics: the G completions of one prompt, their advantages and filter flag.

The buffer stores, with every completion, its group's reward mean and std and
the group-normalised advantage

    A_i = (r_i - mean(r)) / (std(r) + eps)

with std the unbiased sample std ("sample", as verl and TRL), the population
std ("population", DeepSeekMath read literally), or no division ("none", Dr.
GRPO: A_i = r_i - mean(r)). A group whose rewards are all equal (G = 1
included) gets std 0 and advantages exactly 0, and is filtered: it carries no
gradient. `reward_stats` is the one numpy form of this formula;
`workers.grpo.group_advantages` is its torch form for the trainer, which
recomputes advantages itself (the stored ones are for inspection), and a test
checks that the two agree.

Only numpy here (no pyarrow, no torch, no file locks): config checks reach
`StdMode` through workers.grpo.options without loading the buffer's storage code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from buffer.schema import FilterReason

StdMode = Literal["sample", "population", "none"]
STD_MODES: tuple[StdMode, ...] = ("sample", "population", "none")
FINISH_REASONS = ("stop", "length")


@dataclass
class Completion:
    """One sampled completion and its score."""

    text: str
    token_ids: Sequence[int] | np.ndarray
    logprobs: Sequence[float] | np.ndarray
    """Behaviour log-prob of each token in `token_ids`: log_softmax(logits / T)."""
    reward: float
    finish_reason: str = "stop"
    reward_components: Mapping[str, float] = field(default_factory=dict)
    correct: bool | None = None
    reward_error: str | None = None


@dataclass
class Group:
    """The G completions of one prompt, sampled with one weight version."""

    prompt_id: str
    prompt: str
    prompt_ids: Sequence[int] | np.ndarray
    version: int
    completions: list[Completion]
    task: str = "default"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None


def reward_stats(rewards: np.ndarray, std: StdMode = "sample",
                 eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, std, advantages and all-equal flags of N groups of G rewards each.

    rewards: (N, G) float64.
    Returns mean (N,), std (N,), advantages (N, G) float64, all_equal (N,) bool.
    The std is the ddof-1 std for "sample" and the ddof-0 std otherwise ("none"
    reports it but does not divide by it); rows with max == min get std 0 and
    advantages 0. The reductions are numpy's np.mean and np.std written out.
    """
    _, g = rewards.shape
    mean = rewards.sum(axis=1, keepdims=True) / g                    # (N, 1), as np.mean
    centred = rewards - mean                                         # (N, G)
    with np.errstate(divide="ignore", invalid="ignore"):   # G = 1 with ddof 1: all-equal, zeroed below
        sd = np.sqrt((centred * centred).sum(axis=1, keepdims=True) / (g - (std == "sample")))  # (N, 1), as np.std
        adv = centred if std == "none" else centred / (sd + eps)     # (N, G)
    all_equal = rewards.max(axis=1) == rewards.min(axis=1)           # (N,)
    sd[all_equal] = 0.0
    adv[all_equal] = 0.0
    return mean[:, 0], sd[:, 0], adv, all_equal


def group_reward_stats(rewards: Sequence[float], std: StdMode = "sample",
                       eps: float = 1e-6) -> tuple[float, float, np.ndarray]:
    """Mean, std and advantages (G,) float32 of one group's rewards (G,); see `reward_stats`."""
    mean, sd, adv, _ = reward_stats(np.asarray(rewards, dtype=np.float64)[None, :], std, eps)
    return float(mean[0]), float(sd[0]), adv[0].astype(np.float32)


def ragged_reward_stats(rewards: np.ndarray, sizes: np.ndarray, std: StdMode = "sample",
                        eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`reward_stats` of P groups of any sizes at once, bit for bit the per-group values.

    rewards: (R,) float64, the groups one after another; sizes: (P,), R = sum(sizes).
    Returns mean (P,), std (P,), advantages (R,) float32, all_equal (P,) bool.
    Groups of one size go through `reward_stats` together, as one (k, G) array.
    """
    n_groups = len(sizes)
    if sizes.min() == sizes.max():       # the usual case: one G for all
        buckets = [(slice(None), slice(None), int(sizes[0]))]
    else:
        starts = np.cumsum(sizes) - sizes
        buckets = []
        for size in np.unique(sizes).tolist():
            gi = np.flatnonzero(sizes == size)
            buckets.append((gi, (starts[gi][:, None] + np.arange(size)).ravel(), size))
    mean, sd = np.zeros(n_groups), np.zeros(n_groups)
    adv = np.zeros(len(rewards), dtype=np.float32)
    equal = np.ones(n_groups, dtype=bool)
    for gi, rows, size in buckets:
        m, s, a, eq = reward_stats(rewards[rows].reshape(-1, size), std, eps)    # (k,), (k,), (k, G), (k,)
        mean[gi], sd[gi], equal[gi], adv[rows] = m, s, eq, a.astype(np.float32).ravel()
    return mean, sd, adv, equal


def filter_reason(rewards: Sequence[float], correct: Sequence[bool | None]) -> FilterReason | None:
    """Why a group carries no gradient (all rewards equal), or None if it does."""
    if max(rewards) != min(rewards):
        return None
    return all_equal_reason(correct)


def all_equal_reason(correct: Sequence[bool | None]) -> FilterReason:
    """`filter_reason` of a group already known to have all rewards equal."""
    if all(c is True for c in correct):
        return "all_correct"
    if all(c is False for c in correct):
        return "all_wrong"
    return "all_equal"
