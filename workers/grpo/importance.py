"""Importance weights that correct for the policy lag between behaviour and old policy.

The generator sampled from mu (the weights of `group.version`); the PPO ratio
is taken against pi_old. Unless pi_old is mu itself ("bypass"), every token's
loss is weighted by

    token level:          w_bt = pi_old(y_bt) / mu(y_bt)
    sequence, product:    w_b  = prod_t pi_old(y_bt) / mu(y_bt)
    sequence, geo. mean:  w_b  = (prod_t pi_old(y_bt) / mu(y_bt)) ** (1 / T_b)

(T_b the completion length), broadcast to the tokens of a sequence, and then
treated by one of

    "truncate":  w <- min(w, threshold)                      (truncated IS, V-trace's rho-bar)
    "mask":      w <- w if low <= w <= threshold, else 0     (the unit is dropped)
    None:        w <- 1                                      (no correction; still measured)

The weight is a constant (no gradient). Everything is done in log space, so a
long sequence's product cannot overflow; the raw weights reported in metrics
are clamped to exp(+-20) so that a metric never reads inf.
"""

from __future__ import annotations

import math

import torch

from workers.grpo.options import IS_LEVELS, IS_MODES, ISLevel, ISMode

_METRIC_LOG_CLAMP = 20.0


def importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       level: ISLevel = "token", mode: ISMode | None = "truncate", threshold: float = 2.0,
                       threshold_low: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Treated importance weights pi_old / mu per token, and their metrics.

    old_logprobs, behaviour_logprobs: (B, T); mask: (B, T) bool, True on
    completion tokens. threshold: the truncation cap, and the upper bound in
    "mask" mode; threshold_low: the lower bound in "mask" mode (None: 1 / threshold).
    Returns weights: (B, T), detached, 0 where mask is False; and metrics over
    units (completion tokens at token level, non-empty sequences at sequence
    level): is/mean, is/min, is/max of the raw weight, is/truncated_count,
    is/truncated_frac (raw weight > threshold, "truncate" only), is/masked_count,
    is/masked_frac (outside [low, threshold], "mask" only), is/num_units.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"is_level must be one of {IS_LEVELS}, got {level!r}")
    if mode not in IS_MODES:
        raise ValueError(f"is_mode must be one of {IS_MODES}, got {mode!r}")
    m = mask.bool()
    log_w = torch.where(m, old_logprobs.detach() - behaviour_logprobs.detach(), 0.0)   # (B, T)
    if level == "token":
        units = m                                                  # (B, T)
    else:
        n_tok = m.sum(dim=1)                                       # (B,)
        log_w = log_w.sum(dim=1)                                   # (B,)
        if level == "sequence-geomean":
            log_w = log_w / n_tok.clamp_min(1)
        units = n_tok > 0                                          # (B,)

    low = 1.0 / threshold if threshold_low is None else threshold_low
    truncated = units & (log_w > math.log(threshold)) if mode == "truncate" else torch.zeros_like(units)
    dropped = units & ((log_w > math.log(threshold)) | (log_w < math.log(low))) if mode == "mask" \
        else torch.zeros_like(units)
    if mode == "truncate":
        w = torch.exp(log_w.clamp(max=math.log(threshold)))
    elif mode == "mask":
        w = torch.where(dropped, 0.0, torch.exp(log_w.clamp(max=math.log(threshold))))
    else:
        w = torch.ones_like(log_w)
    if level != "token":
        w = w[:, None].expand_as(m)                                # (B,) -> (B, T)
    w = torch.where(m, w, 0.0)

    raw = torch.exp(log_w.clamp(-_METRIC_LOG_CLAMP, _METRIC_LOG_CLAMP))
    n_units = units.sum()
    denom = n_units.clamp_min(1).to(raw.dtype)
    metrics = {
        "is/mean": torch.where(units, raw, 0.0).sum() / denom,
        # No units (an empty batch) reads 1, the on-policy weight, instead of +-inf.
        "is/min": torch.where(n_units > 0, torch.where(units, raw, math.inf).amin(), 1.0),
        "is/max": torch.where(n_units > 0, torch.where(units, raw, -math.inf).amax(), 1.0),
        "is/truncated_count": truncated.sum().to(raw.dtype),
        "is/truncated_frac": truncated.sum() / denom,
        "is/masked_count": dropped.sum().to(raw.dtype),
        "is/masked_frac": dropped.sum() / denom,
        "is/num_units": n_units.to(raw.dtype),
    }
    return w, metrics
