"""Data parallelism under torchrun: rank 0 pulls and broadcasts, every rank trains on its share.

The step loss is normalised over the whole step batch (`loss_normalizer`), so
each rank's micro-batch losses are partial sums of one loss and the full-batch
gradient is the SUM of the ranks' gradients, not their mean. We all-reduce
(sum) the accumulated gradients once per optimizer update, in one flat buffer
per dtype: what DDP's bucketed all-reduce does, without DDP's divide-by-world
and without its requirement that every rank run the same number of backward
passes (ranks may get different numbers of micro-batches). Every rank then
takes the same AdamW step on the same gradient, so parameters stay identical.
Under trainer.strategy = "fsdp" (fsdp.py) FSDP2 does the reduction instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    """This process's place in the job; a single process is rank 0 of 1."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False   # we initialised the process group, so we tear it down
    strategy: str = "ddp"      # TrainerConfig.strategy

    @property
    def sharded(self) -> bool:
        """FSDP2 is on: the model's parameters are DTensor shards, and gathers are collectives."""
        return self.strategy == "fsdp" and self.enabled

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of n items (the first n % world ranks get one more)."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (pickled); the identity in a single process."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum .grad over ranks in place (a missing grad counts as zeros)."""
        if not self.enabled:
            return
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in group:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`t` reduced over ranks ("sum", "max" or "min"), in place."""
        if self.enabled:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                   "min": dist.ReduceOp.MIN}[op])
        return t

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def init_dist(device: str, strategy: str = "ddp") -> Dist:
    """Join the torchrun job described by the environment (WORLD_SIZE > 1), else a single process.

    Backend: gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for CPU ones.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(strategy=strategy)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    owns = False
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(local_rank)   # NCCL's object collectives use the current device
    if not dist.is_initialized():
        # NCCL for CUDA tensors, gloo for the CPU ones (metrics sums, pickled broadcasts)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo")
        owns = True
    return Dist(rank=rank, world=world, local_rank=local_rank, owns_group=owns, strategy=strategy)
