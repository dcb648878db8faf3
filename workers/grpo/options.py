"""The names the GRPO functions accept, and PolicyLossConfig: no torch.

Configs are read and checked (`asyncgrpo config`, bad input to every command)
without importing torch; the torch modules take their names from here, and the
registries of KL estimators and aggregation modes must hold exactly these. The
advantage's std modes are the buffer's (`buffer.groups`, which stores advantages
too), re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from buffer.groups import STD_MODES, StdMode  # noqa: F401 - re-exported as workers.grpo.STD_MODES, StdMode
from workers.checks import is_num

ISLevel = Literal["token", "sequence-product", "sequence-geomean"]
ISMode = Literal["truncate", "mask"]
IS_LEVELS: tuple[ISLevel, ...] = ("token", "sequence-product", "sequence-geomean")
IS_MODES: tuple[ISMode | None, ...] = ("truncate", "mask", None)
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATOR_NAMES: tuple[KLEstimator, ...] = ("k1", "k2", "k3")
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[LossAggMode, ...] = ("token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean")
Objective = Literal["bypass", "decoupled"]
RatioLevel = Literal["token", "sequence"]
OBJECTIVES: tuple[Objective, ...] = ("bypass", "decoupled")
RATIO_LEVELS: tuple[RatioLevel, ...] = ("token", "sequence")


def check_registry(table: dict, names: tuple[str, ...], what: str) -> None:
    """Raise if a registry's functions and the names configs accept have drifted apart."""
    if tuple(table) != names:
        raise RuntimeError(f"{what} registry holds {tuple(table)}, but workers.grpo.options lists {names}")


@dataclass(frozen=True)
class PolicyLossConfig:
    """How the policy loss is computed; validated on construction."""

    objective: Objective = "bypass"
    """Old policy of the PPO ratio: "bypass" uses the behaviour log-probs (no extra forward pass),
    "decoupled" a proximal policy recomputed by the trainer (AReaL; holds up under staleness)."""
    is_level: ISLevel = "token"
    """Importance weight pi_old / mu per "token", or per sequence as the product ("sequence-product")
    or its geometric mean over tokens ("sequence-geomean"). Only matters for "decoupled"."""
    is_mode: ISMode | None = "truncate"
    """Treatment of the importance weight: "truncate" at `is_threshold`, "mask" (drop units outside
    [is_threshold_low, is_threshold]), or None (weight 1, no correction; still measured in is/...)."""
    is_threshold: float = 2.0
    """Truncation cap, and the upper bound in "mask" mode; >= 1, since on-policy weights are 1."""
    is_threshold_low: float | None = None
    """Lower bound in "mask" mode, in (0, 1]; None means 1 / is_threshold."""
    epsilon: float = 0.2
    """PPO clip range below 1: the ratio is clipped to [1 - epsilon, ...]; in [0, 1)."""
    epsilon_high: float | None = None
    """Clip range above 1 (DAPO's clip-higher, e.g. 0.28); None means `epsilon`; >= 0."""
    ratio_level: RatioLevel = "token"
    """"token" (PPO, GRPO) or "sequence" (GSPO: geometric mean of the sequence's ratios;
    TRL calls this importance_sampling_level)."""
    beta: float = 0.0
    """Coefficient of the KL-to-reference loss term, >= 0; 0 needs no reference log-probs
    (the trainer then loads no reference model)."""
    entropy_coef: float = 0.0
    """Coefficient of an entropy bonus, >= 0 (verl's entropy_coeff): the loss subtracts entropy_coef
    times the policy's entropy (of softmax(logits / temperature)) over completion tokens, aggregated
    like the policy term. Meant to slow the policy's collapse onto one completion per prompt, which
    makes whole groups agree and so carry no gradient; on the default run 0.01 and 0.05 changed
    neither over 1,000 steps, 0.12 slowed it a little and 0.3 drowned the reward (README "Days,
    not minutes"). Needs the logits (the trainer passes them)."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator: "k1" (log ratio), "k2" (half squared log ratio), "k3" (GRPO's)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """"token-mean" (DAPO), "seq-mean-token-mean" (GRPO paper), "seq-mean-token-sum-norm" (Dr. GRPO)."""
    max_completion_length: int | None = None
    """Dr. GRPO's constant L: seq-mean-token-sum-norm divides each sequence's token sum by it
    (the generation budget). Required by that mode, > 0; other modes ignore it."""

    def __post_init__(self) -> None:
        def bad(field: str, need: str) -> ValueError:
            return ValueError(f"PolicyLossConfig.{field} must be {need}, got {getattr(self, field)!r}")

        for field, choices in (("objective", OBJECTIVES), ("is_level", IS_LEVELS), ("is_mode", IS_MODES),
                               ("ratio_level", RATIO_LEVELS), ("kl_estimator", KL_ESTIMATOR_NAMES),
                               ("loss_agg_mode", LOSS_AGG_MODES)):
            if getattr(self, field) not in choices:
                raise bad(field, f"one of {choices}")
        if not is_num(self.is_threshold) or self.is_threshold < 1:
            raise bad("is_threshold", "a finite number >= 1")
        if self.is_threshold_low is not None and not (is_num(self.is_threshold_low)
                                                      and 0 < self.is_threshold_low <= 1):
            raise bad("is_threshold_low", "a number in (0, 1] or None (1 / is_threshold)")
        if not is_num(self.epsilon) or not 0 <= self.epsilon < 1:
            raise bad("epsilon", "a number in [0, 1)")
        if self.epsilon_high is not None and not (is_num(self.epsilon_high) and self.epsilon_high >= 0):
            raise bad("epsilon_high", "a finite number >= 0 or None (same as epsilon)")
        if not is_num(self.beta) or self.beta < 0:
            raise bad("beta", "a finite number >= 0 (0 turns the KL term off)")
        if not is_num(self.entropy_coef) or self.entropy_coef < 0:
            raise bad("entropy_coef", "a finite number >= 0 (0 turns the entropy bonus off)")
        if self.max_completion_length is not None and (isinstance(self.max_completion_length, bool) or not
                                                       isinstance(self.max_completion_length, int)
                                                       or self.max_completion_length < 1):
            raise bad("max_completion_length", "an integer >= 1 or None")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.max_completion_length is None:
            raise bad("max_completion_length", "set (an integer >= 1, e.g. the generation budget) "
                      "when loss_agg_mode='seq-mean-token-sum-norm'")


