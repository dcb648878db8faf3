"""Per-token log-probabilities and entropies from logits at a sampling temperature.

The behaviour policy mu stored with each completion is
`log_softmax(logits / temperature)` of the generator's weights, so the trainer
scores pi_theta the same way:

    log pi(y_t) = z_t[y_t] - logsumexp(z_t),    z_t = logits_t / temperature

`log_softmax` over the whole (B, T, V) tensor would materialise a second
(B, T, V) tensor (two, counting what autograd keeps). `token_logprobs` instead
computes one logsumexp and one gather per row, optionally `chunk_rows` rows at
a time, and its backward recomputes the softmax chunk by chunk from the logits
(which the model keeps anyway): extra memory is O(chunk_rows * V) plus (B, T).

Alignment is the caller's: `logits[b, t]` must be the scores for `tokens[b, t]`
(a causal LM's logits shifted by one). Low-precision logits (bf16, fp16) are
upcast to float32 chunk by chunk; results are float32 (float64 for float64).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def _check(temperature: float, chunk_rows: int | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be an integer >= 1 or None (no chunking), got {chunk_rows!r}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunks(rows: int, chunk_rows: int | None):
    step = rows if chunk_rows is None else chunk_rows
    for start in range(0, rows, max(step, 1)):
        yield start, min(start + step, rows)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(x / temperature)[y] for x: (R, V), y: (R,), with a chunked backward.

    d/dx_j = (1[j = y] - softmax(x / temperature)_j) / temperature * grad
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                chunk_rows: int | None) -> torch.Tensor:
        rows = logits.shape[0]
        dtype = _compute_dtype(logits.dtype)
        out = logits.new_empty(rows, dtype=dtype)               # (R,)
        lse = logits.new_empty(rows, dtype=dtype)               # (R,)
        for s, e in _chunks(rows, chunk_rows):
            z = logits[s:e].to(dtype) / temperature             # (r, V)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            out[s:e] = z.gather(-1, tokens[s:e, None]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, tokens, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)                         # (R, V)
        for s, e in _chunks(logits.shape[0], ctx.chunk_rows):
            z = logits[s:e].to(lse.dtype) / temperature         # (r, V)
            g = grad_out[s:e, None].to(lse.dtype) / temperature # (r, 1)
            d = torch.exp(z - lse[s:e, None]).neg_()            # -softmax, (r, V)
            d.scatter_add_(-1, tokens[s:e, None], torch.ones_like(g))
            grad[s:e] = (d * g).to(logits.dtype)
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   chunk_rows: int | None = None) -> torch.Tensor:
    """Log-probability of each given token under softmax(logits / temperature).

    logits: (B, T, V) (any leading shape ..., V); tokens: (B, T) int64, values
    in [0, V) everywhere (padding positions may hold any valid id; mask them
    later). chunk_rows: rows of B*T handled at once, None for all.
    Returns (B, T): logits[b, t, y]/temperature - logsumexp(logits[b, t]/temperature),
    differentiable in `logits` (first order only).
    """
    _check(temperature, chunk_rows)
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits (..., V) and tokens (...) disagree: logits {tuple(logits.shape)}, "
                         f"tokens {tuple(tokens.shape)}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)                            # (B*T, V)
    out = _TokenLogprobs.apply(flat, tokens.reshape(-1).long(), float(temperature), chunk_rows)
    return out.reshape(tokens.shape)                            # (B, T)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0,
                        chunk_rows: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at each position.

    logits: (B, T, V) (any leading shape ..., V). Returns (B, T):
    H = -sum_v p_v log p_v with p = softmax(logits / temperature).
    Differentiable through plain autograd (meant for metrics, under no_grad,
    or a small entropy bonus); chunking bounds the forward's working memory.
    """
    _check(temperature, chunk_rows)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)                            # (B*T, V)
    dtype = _compute_dtype(logits.dtype)
    parts = []
    for s, e in _chunks(flat.shape[0], chunk_rows):
        z = flat[s:e].to(dtype) / temperature                   # (r, V)
        p = torch.softmax(z, dim=-1)                            # (r, V)
        parts.append(-torch.special.xlogy(p, p).sum(-1))        # 0 log 0 = 0: -inf logits are fine
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=dtype)
    return out.reshape(logits.shape[:-1])                       # (B, T)
