"""Loss aggregation: how per-token losses become one number (verl's `loss_agg_mode`).

With l_bt the per-token loss, m_bt the completion mask, T_b = sum_t m_bt and
S the number of sequences with T_b > 0:

    token-mean:               sum_bt m_bt l_bt / sum_bt m_bt                 (DAPO; long answers weigh more)
    seq-mean-token-mean:      (1/S) sum_b (sum_t m_bt l_bt / T_b)            (the GRPO paper)
    seq-mean-token-sum-norm:  sum_bt m_bt l_bt / (S * L)                      (Dr. GRPO, L a constant)

Every mode is "a sum over this batch divided by a normaliser": the token count,
S, or S * L; seq-mean-token-mean also divides inside each sequence, which is
local to it. So the normaliser can be computed once over the whole step batch
(`normalizer`), passed to every micro-batch, and the micro-batch losses then
sum to the full-batch loss exactly, gradient included. With data parallelism,
sum the normaliser over ranks too (and do not average gradients over ranks).

Departures: sequences with no completion token (padding rows) count in
neither S nor the token count; L is a configured constant (TRL's
`max_completion_length`; verl defaults to the padded width, which would change
with micro-batch padding); a normaliser of 0 (nothing to train on) gives loss 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.grpo.options import LOSS_AGG_MODES, LossAggMode, check_registry
from workers.grpo.registry import registrar

Aggregator = Callable[[torch.Tensor, torch.Tensor, "float | torch.Tensor"], torch.Tensor]
AGGREGATORS: dict[str, Aggregator] = {}


_register = registrar(AGGREGATORS, "loss aggregation mode")


def _sum_over(values: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor) -> torch.Tensor:
    """sum_bt m_bt l_bt / normalizer; values, mask: (B, T) -> ()."""
    return torch.where(mask, values, 0.0).sum() / normalizer


_register("token-mean")(_sum_over)
_register("seq-mean-token-sum-norm")(_sum_over)


@_register("seq-mean-token-mean")
def _seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor) -> torch.Tensor:
    """sum_b (sum_t m_bt l_bt / T_b) / normalizer; values, mask: (B, T) -> ()."""
    per_seq = torch.where(mask, values, 0.0).sum(dim=1) / mask.sum(dim=1).clamp_min(1)   # (B,)
    return per_seq.sum() / normalizer


check_registry(AGGREGATORS, LOSS_AGG_MODES, "loss aggregation mode")


def normalizer_for(mask: torch.Tensor, loss_agg_mode: LossAggMode,
                   max_completion_length: int | None = None) -> float:
    """The divisor of `aggregate` for a batch: mask (B, T) -> a number >= 1.

    token-mean: total completion tokens; seq-mean-token-mean: S;
    seq-mean-token-sum-norm: S * max_completion_length. 0 becomes 1 (loss 0).
    """
    if loss_agg_mode not in AGGREGATORS:
        raise ValueError(f"loss_agg_mode must be one of {tuple(AGGREGATORS)}, got {loss_agg_mode!r}")
    m = mask.bool()
    if loss_agg_mode == "token-mean":
        total = int(m.sum())
    else:
        total = int((m.sum(dim=1) > 0).sum())
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if max_completion_length is None:
                raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs max_completion_length "
                                 "(Dr. GRPO's constant L), got None")
            return float(max(total, 1) * max_completion_length)
    return float(max(total, 1))


def aggregate(values: torch.Tensor, mask: torch.Tensor, loss_agg_mode: LossAggMode,
              normalizer: float | torch.Tensor) -> torch.Tensor:
    """Aggregate per-token values (B, T) over mask (B, T) bool into a scalar ()."""
    if loss_agg_mode not in AGGREGATORS:
        raise ValueError(f"loss_agg_mode must be one of {tuple(AGGREGATORS)}, got {loss_agg_mode!r}")
    return AGGREGATORS[loss_agg_mode](values, mask.bool(), normalizer)
