"""What changes from step to step by rule: the learning rate and the KL coefficient beta."""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.trainer.config import TrainerConfig


def lr_factor(cfg: TrainerConfig, step: int) -> float:
    """Multiplier of cfg.lr for trainer step `step` (1-based: the step being taken).

    warm-up (step <= W):   step / (W + 1)
    constant:              1
    cosine:   m + (1 - m) * (1 + cos(pi * p)) / 2,   p = clamp((step - W) / (D - W), 0, 1)
    linear:   m + (1 - m) * (1 - p)
    with W = warmup_steps, D = decay_end, m = min_lr_ratio.
    """
    w = cfg.warmup_steps
    if step <= w:
        return step / (w + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    end = cfg.decay_end
    p = 1.0 if end <= w else min(max((step - w) / (end - w), 0.0), 1.0)
    m = cfg.min_lr_ratio
    shape = (1 + math.cos(math.pi * p)) / 2 if cfg.lr_schedule == "cosine" else 1 - p
    return m + (1 - m) * shape


@dataclass
class KLController:
    """beta of the KL-to-reference term: fixed, or PPO's adaptive controller (Ziegler et al. 2019).

    adaptive: e = clip(kl / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * B / horizon)
    after each step of B sequences, with kl the step's mean per-token KL to the reference (kl/ref).
    """

    beta: float
    target: float | None = None
    horizon: int = 10000
    adaptive: bool = False

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> "KLController":
        return cls(beta=float(cfg.loss.beta), target=cfg.kl_target, horizon=cfg.kl_horizon,
                   adaptive=cfg.kl_control == "adaptive")

    def update(self, kl: float | None, num_sequences: int) -> float:
        """Move beta after a step; returns the new beta. kl None (not measured) leaves it."""
        if self.adaptive and kl is not None and math.isfinite(kl):
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.beta *= 1.0 + error * num_sequences / self.horizon
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = float(state["beta"])
