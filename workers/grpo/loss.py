"""The GRPO policy loss: clipped surrogate, lag correction, KL to a reference.

Per completion token (b, t), with A_b the group advantage, w_bt the treated
importance weight pi_old / mu (`importance.py`), and r_bt = pi_theta / pi_old:

    l_bt = -w_bt * min(r_bt A_b, clip(r_bt, 1 - epsilon, 1 + epsilon_high) A_b)
           + beta * KL_est(pi_theta || pi_ref)_bt - entropy_coef * H(pi_theta)_bt

aggregated by `loss_agg_mode` (`aggregation.py`). pi_old is either

- "bypass": the behaviour policy mu itself (so w = 1): one forward pass,
  the ratio absorbs the whole lag and clipping limits it;
- "decoupled": the proximal policy, pi_theta's log-probs recomputed by the
  trainer at batch start (AReaL's decoupled PPO objective): the clip acts on
  the step's own change, w on the lag.

`ratio_level="sequence"` is GSPO: r_b = exp(mean_t log(pi_theta / pi_old)),
given to every token of sequence b (with its gradient), so seq-mean-token-mean
is GSPO's objective exactly. With a sequence-level (or no) IS weight this has
the gradient of verl's GSPO-token form, sg[r_b] * pi_theta(y_bt) / sg[pi_theta(y_bt)];
with token-level IS weights it stays the true gradient of the loss it reports,
which the stop-gradient form is not. GSPO uses far smaller epsilons (3e-4, 4e-4).

Departures: the advantage is per sequence and broadcast (a (B, T) advantage
is also accepted); the KL term is not importance-weighted and counts tokens
whose IS weight was masked (as in TRL and verl); clip-higher is DAPO's.
Only `logprobs` carries a gradient; every other input is detached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.checks import is_num
from workers.grpo.aggregation import aggregate, normalizer_for
from workers.grpo.importance import importance_weights
from workers.grpo.kl import kl_estimate, kl_k3
from workers.grpo.logprobs import entropy_from_logits
from workers.grpo.options import PolicyLossConfig

_ENTROPY_CHUNK_ROWS = 4096  # bounds the metric's (rows, V) working memory for large vocabularies


@dataclass(frozen=True)
class PolicyLossInputs:
    """One (micro-)batch of B sequences of T tokens for `policy_loss`; shapes checked on construction."""

    logprobs: torch.Tensor
    """(B, T) log pi_theta of the sampled tokens, with gradient (`token_logprobs`)."""
    behaviour_logprobs: torch.Tensor
    """(B, T) log mu, stored by the generator with each completion."""
    advantages: torch.Tensor
    """(B,) group advantage of each sequence (`group_advantages`), or (B, T) per token."""
    mask: torch.Tensor
    """(B, T) 1 (True) on completion tokens, 0 on prompt and padding, which contribute nothing."""
    old_logprobs: torch.Tensor | None = None
    """(B, T) log pi_old of the proximal policy; required by "decoupled", must be None for "bypass"."""
    ref_logprobs: torch.Tensor | None = None
    """(B, T) log pi_ref of the frozen reference; required when beta > 0."""
    logits: torch.Tensor | None = None
    """(B, T, V) logits of pi_theta at the completion positions: for the entropy metric (loss/entropy),
    and, with gradient, for the entropy bonus (required when entropy_coef > 0)."""
    temperature: float = 1.0
    """Sampling temperature the logits are divided by for the entropy; > 0."""

    def __post_init__(self) -> None:
        shape = tuple(self.logprobs.shape)
        if len(shape) != 2:
            raise ValueError(f"PolicyLossInputs.logprobs must be (B, T), got shape {shape}")
        for field in ("behaviour_logprobs", "mask", "old_logprobs", "ref_logprobs"):
            value = getattr(self, field)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"PolicyLossInputs.{field} must have the shape of logprobs {shape}, "
                                 f"got {tuple(value.shape)}")
        if tuple(self.advantages.shape) not in (shape[:1], shape):
            raise ValueError(f"PolicyLossInputs.advantages must be (B,) = {shape[:1]} or (B, T) = {shape}, "
                             f"got {tuple(self.advantages.shape)}")
        if self.logits is not None and (self.logits.ndim != 3 or tuple(self.logits.shape[:2]) != shape):
            raise ValueError(f"PolicyLossInputs.logits must be (B, T, V) with (B, T) = {shape}, "
                             f"got {tuple(self.logits.shape)}")
        if not is_num(self.temperature) or self.temperature <= 0:
            raise ValueError(f"PolicyLossInputs.temperature must be a finite number > 0, got {self.temperature!r}")


def loss_normalizer(mask: torch.Tensor, config: PolicyLossConfig) -> float:
    """Normaliser of the whole step batch, to pass to `policy_loss` for each micro-batch.

    mask: (B, T) completion mask of the full step batch (all micro-batches).
    Returns the completion-token count (token-mean), the number of non-empty
    sequences S (seq-mean-token-mean), or S * max_completion_length
    (seq-mean-token-sum-norm); at least 1.
    """
    return normalizer_for(mask, config.loss_agg_mode, config.max_completion_length)


def _masked_mean(x: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, 0.0).sum() / n


def policy_loss(inputs: PolicyLossInputs, config: PolicyLossConfig,
                normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one (micro-)batch and its metrics.

    inputs: tensors of shape (B, T) (see `PolicyLossInputs`). normalizer: the
    step batch's `loss_normalizer`; None computes it from `inputs.mask`, which
    is right only when this call sees the whole step batch. Summing the losses
    of micro-batches that share one normaliser gives the full batch's loss and
    gradient.
    Returns (loss (), metrics): 0-d detached tensors, means over this call's
    completion tokens unless named otherwise:
      loss/total, loss/policy, loss/kl (aggregated, before beta; when ref log-probs are given),
      loss/entropy (token mean, when logits are given), loss/entropy_bonus (aggregated, before
      entropy_coef; when entropy_coef > 0), loss/num_tokens, loss/num_seqs;
      clip/low_count, clip/high_count, clip/low_frac, clip/high_frac, clip/frac
        (tokens where the clip stops the gradient: r < 1-epsilon with A < 0, r > 1+epsilon_high with A > 0),
      clip/ratio_mean, clip/ratio_max;
      is/... from `importance_weights`;
      kl/new_behaviour, kl/new_old, kl/old_behaviour: k3 approximate KL (CleanRL's approx_kl,
        mean of (r - 1) - log r with r = new / behaviour, ...), kl/ref: the chosen estimator.
    """
    if config.objective == "decoupled" and inputs.old_logprobs is None:
        raise ValueError("objective='decoupled' needs old_logprobs (the proximal policy's log-probs), got None")
    if config.objective == "bypass" and inputs.old_logprobs is not None:
        raise ValueError("objective='bypass' takes the behaviour log-probs as the old policy, so old_logprobs "
                         "must be None, got a tensor; use objective='decoupled' to train against it")
    if config.beta > 0 and inputs.ref_logprobs is None:
        raise ValueError(f"beta={config.beta} > 0 needs ref_logprobs (the reference policy's), got None")
    if config.entropy_coef > 0 and inputs.logits is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} > 0 needs the policy's logits, got None")
    if isinstance(normalizer, (int, float)) and not (math.isfinite(normalizer) and normalizer > 0):
        raise ValueError(f"normalizer must be a finite number > 0 (see loss_normalizer), got {normalizer!r}")

    m = inputs.mask.bool()                                              # (B, T)
    # Masked positions are replaced, not multiplied, so that inf/NaN there cannot leak into the loss or its gradient.
    new = torch.where(m, inputs.logprobs, 0.0)                          # (B, T)
    mu = torch.where(m, inputs.behaviour_logprobs.detach(), 0.0)        # (B, T)
    old = mu if inputs.old_logprobs is None else torch.where(m, inputs.old_logprobs.detach(), 0.0)
    adv = inputs.advantages.detach()
    adv = torch.where(m, adv[:, None] if adv.ndim == 1 else adv, 0.0)  # (B, T)
    if normalizer is None:
        normalizer = loss_normalizer(m, config)

    weights, is_metrics = importance_weights(old, mu, m, config.is_level, config.is_mode,
                                             config.is_threshold, config.is_threshold_low)   # (B, T)

    log_ratio = new - old                                               # (B, T)
    n_seq_tok = m.sum(dim=1)                                            # (B,)
    if config.ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(dim=1) / n_seq_tok.clamp_min(1)   # (B,), masked entries are 0
        log_ratio = torch.where(m, seq_log_ratio[:, None], 0.0)       # (B,) -> (B, T)
    ratio = torch.exp(log_ratio)                                        # (B, T)
    eps_low = config.epsilon
    eps_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)   # (B, T)
    policy_term = aggregate(-weights * surrogate, m, config.loss_agg_mode, normalizer)
    loss = policy_term

    kl_term = None
    if inputs.ref_logprobs is not None:
        ref = torch.where(m, inputs.ref_logprobs.detach(), 0.0)        # (B, T)
        with torch.set_grad_enabled(torch.is_grad_enabled() and config.beta > 0):
            kl_tok = kl_estimate(new, ref, config.kl_estimator)         # (B, T)
            kl_term = aggregate(kl_tok, m, config.loss_agg_mode, normalizer)
        if config.beta > 0:
            loss = loss + config.beta * kl_term

    entropy = bonus = None
    if inputs.logits is not None:
        with torch.set_grad_enabled(torch.is_grad_enabled() and config.entropy_coef > 0):   # else a metric only
            entropy = torch.where(m, entropy_from_logits(inputs.logits, inputs.temperature, _ENTROPY_CHUNK_ROWS)
                                  .to(new.dtype), 0.0)                 # (B, T)
        if config.entropy_coef > 0:
            bonus = aggregate(entropy, m, config.loss_agg_mode, normalizer)
            loss = loss - config.entropy_coef * bonus

    with torch.no_grad():
        n_tok = m.sum()
        denom = n_tok.clamp_min(1).to(new.dtype)
        low = m & (ratio < 1 - eps_low) & (adv < 0)
        high = m & (ratio > 1 + eps_high) & (adv > 0)
        metrics = {
            "loss/total": loss.detach(),
            "loss/policy": policy_term.detach(),
            "loss/num_tokens": n_tok.to(new.dtype),
            "loss/num_seqs": (n_seq_tok > 0).sum().to(new.dtype),
            "clip/low_count": low.sum().to(new.dtype),
            "clip/high_count": high.sum().to(new.dtype),
            "clip/low_frac": low.sum() / denom,
            "clip/high_frac": high.sum() / denom,
            "clip/frac": (low | high).sum() / denom,
            "clip/ratio_mean": _masked_mean(ratio, m, denom),
            "clip/ratio_max": torch.where(m, ratio, 0.0).amax() if m.numel() else denom * 0,   # ratios are > 0
            **is_metrics,
            # k3(q, p) estimates KL(q || p) with r = p / q: here (r - 1) - log r with r = new / behaviour, etc.
            "kl/new_behaviour": _masked_mean(kl_k3(mu, new), m, denom),
            "kl/new_old": _masked_mean(kl_k3(old, new), m, denom),
            "kl/old_behaviour": _masked_mean(kl_k3(mu, old), m, denom),
        }
        if kl_term is not None:
            metrics["loss/kl"] = kl_term.detach()
            metrics["kl/ref"] = _masked_mean(kl_tok, m, denom)
        if entropy is not None:
            metrics["loss/entropy"] = _masked_mean(entropy.detach(), m, denom)
        if bonus is not None:
            metrics["loss/entropy_bonus"] = bonus.detach()
    return loss, metrics
