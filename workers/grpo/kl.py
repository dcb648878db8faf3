"""KL estimators (Schulman, "Approximating KL divergence", 2020).

For KL(q || p) with samples y ~ q and r = p(y) / q(y):

    k1 = -log r                 unbiased, high variance, can be negative
    k2 = (log r)^2 / 2          biased, low variance, >= 0
    k3 = (r - 1) - log r        unbiased, low variance, >= 0 (DeepSeekMath's GRPO term)

As a loss term q is pi_theta and p the frozen reference, per completion token.
Departure shared with TRL and verl: the tokens were sampled from the behaviour
policy mu, not from pi_theta, and no importance weight corrects for that.
No clamping (verl clamps k3 to [-10, 10]); TRL does not either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.grpo.options import KL_ESTIMATOR_NAMES, KLEstimator, check_registry
from workers.grpo.registry import registrar

Estimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, Estimator] = {}


_register = registrar(KL_ESTIMATORS, "KL estimator")


@_register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log q - log p. logprobs (q), ref_logprobs (p): (B, T) -> (B, T)."""
    return logprobs - ref_logprobs


@_register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log p - log q)^2 / 2. logprobs (q), ref_logprobs (p): (B, T) -> (B, T)."""
    return 0.5 * (ref_logprobs - logprobs).square()


@_register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log p - log q) - 1 - (log p - log q). logprobs (q), ref_logprobs (p): (B, T) -> (B, T)."""
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


check_registry(KL_ESTIMATORS, KL_ESTIMATOR_NAMES, "KL estimator")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(q || p) by name; (B, T), (B, T) -> (B, T)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {tuple(KL_ESTIMATORS)}, got {estimator!r}")
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)
