"""FSDP2 (`trainer.strategy = "fsdp"`): parameters, gradients and AdamW state sharded over ranks.

    fully_shard(layer) for every decoder layer, then fully_shard(model)   # 1-D mesh of WORLD ranks

Each parameter becomes a DTensor holding 1/WORLD of its rows on this rank; a
layer's forward all-gathers its full parameters and frees them after, and its
backward reduce-scatters the gradients, so each rank keeps only its shard of
the gradient and of AdamW's moments.

Departs from FSDP's default in one place: the reduce-scatter SUMS over ranks
instead of averaging (`set_gradient_divide_factor(1.0)`), because the step loss
is normalised over the whole step batch and the full-batch gradient is the sum
of the ranks' partial gradients (see distributed.py). gloo has no PREMUL_SUM,
so the reduction is forced to a plain SUM (`set_force_sum_reduction_for_comms`).
Every rank must run the same number of forward/backward passes (each one is a
collective); step.py pads with zero-weight passes (`padding_passes`).
"""

from __future__ import annotations

import math

import torch

from workers.trainer.distributed import Dist

# torch.distributed's FSDP, DTensor and checkpoint modules are imported inside the functions that use
# them: every trainer imports this module (step.py, session.py), and they add ~0.3 s to its start-up
# when the strategy is "ddp".


def shard_model(model: torch.nn.Module, *, world: int, device: torch.device, dtype: str) -> torch.nn.Module:
    """Apply fully_shard per decoder layer (the model's `_no_split_modules`) and to the root, in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy() if dtype == "float32" else MixedPrecisionPolicy(
        param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
                         "trainer.strategy='fsdp' shards per decoder layer")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)          # sum, not mean, over ranks (module doc)
            m.set_force_sum_reduction_for_comms(True)
    return model


def padding_passes(rows: int, batch: int, micro_batch_size: int, world: int) -> int:
    """Zero-weight forward/backward passes this rank adds so every rank runs the same number.

    A rank with `rows` of the `batch` rows runs ceil(rows / micro) passes; the largest share is
    ceil(batch / world) rows (Dist.shard gives the first batch % world ranks one more).
    """
    most = math.ceil(math.ceil(batch / world) / micro_batch_size)
    return most - math.ceil(rows / micro_batch_size)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, dist: Dist) -> float:
    """clip_grad_norm_ over sharded (DTensor) gradients: the global L2 norm before clipping.

    norm = sqrt(sum over ranks of the squared norm of the local shards); grads *= min(1, max / (norm + 1e-6))
    as torch.nn.utils.clip_grad_norm_ does.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    sq = torch.zeros((), dtype=torch.float64)
    for g in local:
        sq += g.detach().double().pow(2).sum().cpu()
    total = math.sqrt(float(dist.all_reduce(sq.to(local[0].device if local else "cpu"))))
    if math.isfinite(max_norm) and math.isfinite(total):
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for g in local:
                g.mul_(coef)
    return total


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's parameters on rank 0's CPU (an empty dict elsewhere); every rank must call it.

    Gathered one FSDP unit at a time and offloaded to the CPU, so rank 0 holds one full copy.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
