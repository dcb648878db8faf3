"""One trainer step on one step batch: inner epochs over micro-batches, then optimizer updates.

    normaliser = loss_normalizer(mask of the whole step batch)
    for epoch in 1..num_iterations:                      # one optimizer update each
        for micro-batch of this rank's rows:
            log pi_theta = token_logprobs(logits / temperature)
            (epoch 1: keep them, detached, as the proximal log pi_old; ref forward if beta > 0)
            policy_loss(..., normaliser).backward()      # accumulates the full-batch gradient
        (fsdp: zero-weight passes until every rank has run as many as the busiest)
        all-reduce (sum) grads over ranks (fsdp: done by the reduce-scatter); clip the global norm; AdamW step

The proximal policy of the decoupled objective is pi_theta at batch start.
Every row is scored once in epoch 1 before the first update, with those very
parameters, so its detached log-probs are exactly what a separate no-grad
pass would compute (dropout is off): the recompute costs no extra forward.
Each rank keeps its rows for every epoch (only their order within the rank
changes), so the proximal log-probs it stored are the ones it needs.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from workers.grpo import PolicyLossConfig, PolicyLossInputs, loss_normalizer, policy_loss, token_logprobs
from workers.trainer.batch import MicroBatch, StepBatch, make_micro_batch
from workers.trainer.config import TrainerConfig
from workers.trainer.distributed import Dist
from workers.trainer.fsdp import clip_grad_norm, padding_passes
from workers.trainer.metrics import LossMetrics


@dataclass
class StepTimes:
    forward_s: float = 0.0    # every forward pass (reference, policy) and the loss
    backward_s: float = 0.0
    optim_s: float = 0.0      # gradient all-reduce, clipping, AdamW


def completion_logprobs(model, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, float]:
    """log pi(completion tokens) of a micro-batch.

    Returns (logprobs (b, Tc) float32, logits (b, Tc, V) at the completion
    positions, temperature they are still to be divided by). Logits are divided
    by each sequence's sampling temperature before the log-softmax; when all
    rows share one temperature it is passed to token_logprobs instead of
    dividing here (one less (b, Tc, V) tensor).
    """
    logits = model(input_ids=mb.input_ids, use_cache=False).logits      # (b, L, V)
    vocab = logits.shape[-1]
    z = logits.gather(1, mb.logit_index[:, :, None].expand(-1, -1, vocab))  # (b, Tc, V)
    temps = mb.temperature
    if bool((temps == temps[0]).all()):
        t = float(temps[0])
    else:
        z = z / temps[:, None, None].to(z.dtype)
        t = 1.0
    return token_logprobs(z, mb.completion_ids, t), z, t


def autocast(cfg: TrainerConfig, device: torch.device):
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(model, ref_model, optimizer, batch: StepBatch, *, cfg: TrainerConfig, loss_cfg: PolicyLossConfig,
               dist: Dist, step: int, lr: float, pad_id: int, device: torch.device) -> tuple[dict, StepTimes]:
    """Train on `batch` (every rank holds all of it and takes its share); returns (metrics, times).

    metrics: the combined policy_loss metrics of the whole batch (per epoch), grad_norm
    (before clipping, of the last update), grad/clipped (updates whose norm was clipped),
    grad/nonfinite (updates skipped because the gradient had an inf or NaN).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    b_total, t_max = batch.size, batch.max_completion
    normalizer = loss_normalizer(batch.completion_mask(), loss_cfg)   # over the whole step batch
    decoupled = loss_cfg.objective == "decoupled"
    old = torch.zeros(b_total, t_max, device=device) if decoupled else None          # (B, Tmax)
    ref = torch.zeros(b_total, t_max, device=device) if ref_model is not None else None
    mine = np.arange(b_total)[dist.shard(b_total)]                     # this rank's rows
    acc = LossMetrics()
    times = StepTimes()
    grad_norms, clipped = [], 0
    for group in optimizer.param_groups:
        group["lr"] = lr
    for epoch in range(cfg.num_iterations):
        if epoch == 0:
            order = mine
        else:
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + epoch)
            order = mine[torch.randperm(len(mine), generator=gen).numpy()]
        for start in range(0, len(order), cfg.micro_batch_size):
            rows = order[start:start + cfg.micro_batch_size]
            mb = make_micro_batch(batch, rows, pad_id).to(device)
            tc = mb.mask.shape[1]
            t0 = time.perf_counter()
            with autocast(cfg, device):
                if ref is not None and epoch == 0:
                    with torch.no_grad():
                        ref[mb.rows, :tc] = completion_logprobs(ref_model, mb)[0].float()
                logp, logits, temp = completion_logprobs(model, mb)
            if old is not None and epoch == 0:
                old[mb.rows, :tc] = logp.detach()
            inputs = PolicyLossInputs(
                logprobs=logp, behaviour_logprobs=mb.behaviour_logprobs, advantages=mb.advantages, mask=mb.mask,
                old_logprobs=old[mb.rows, :tc] if old is not None else None,
                ref_logprobs=ref[mb.rows, :tc] if ref is not None else None,
                logits=logits, temperature=temp)
            loss, metrics = policy_loss(inputs, loss_cfg, normalizer)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            times.forward_s += t1 - t0
            times.backward_s += t2 - t1
            acc.add(metrics)
        if dist.sharded:
            for _ in range(padding_passes(len(order), b_total, cfg.micro_batch_size, dist.world)):
                t0 = time.perf_counter()
                _zero_weight_pass(model, ref_model if epoch == 0 else None, batch, pad_id, cfg, device)
                times.forward_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        limit = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
        if dist.sharded:
            norm = clip_grad_norm(params, limit, dist)
        else:
            dist.all_reduce_grads(params)
            norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        grad_norms.append(norm)
        clipped += int(cfg.max_grad_norm is not None and norm > cfg.max_grad_norm)
        if math.isfinite(norm):  # an inf/NaN gradient would poison AdamW's moments: skip, and count it
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.optim_s += time.perf_counter() - t0
    out = acc.result(dist, cfg.num_iterations)
    out["grad_norm"] = grad_norms[-1]
    out["grad/norm_max"] = max(grad_norms)
    out["grad/clipped"] = float(clipped)
    out["grad/nonfinite"] = float(sum(not math.isfinite(n) for n in grad_norms))
    return out, times


def _zero_weight_pass(model, ref_model, batch: StepBatch, pad_id: int, cfg: TrainerConfig,
                      device: torch.device) -> None:
    """One forward/backward on row 0 whose loss is multiplied by 0: FSDP's gathers and
    reduce-scatters run (every rank must join them), and the gradient does not change."""
    input_ids = make_micro_batch(batch, np.array([0]), pad_id).to(device).input_ids     # (1, L)
    with autocast(cfg, device):
        if ref_model is not None:
            with torch.no_grad():
                ref_model(input_ids=input_ids, use_cache=False)
        logits = model(input_ids=input_ids, use_cache=False).logits                     # (1, L, V)
    (logits.float().sum() * 0.0).backward()
