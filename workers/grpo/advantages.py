"""Group-relative advantages: GRPO's baseline is the mean reward of the group.

For the G completions of one prompt with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + eps)

with std the unbiased sample std ("sample", what verl and TRL compute), the
population std ("population", DeepSeekMath's formula read literally), or no
division at all ("none", Dr. GRPO: A_i = r_i - mean(r), which removes the bias
towards groups with a small reward spread). A group whose rewards are all
equal gets A = 0 exactly, never NaN; such groups carry no gradient and the
buffer flags them, but a trainer may still see one (e.g. G = 1).

This is the torch form of `buffer.groups.reward_stats` (numpy, applied at
append time for inspection; tests/test_grpo_advantages.py checks that the two
agree); the trainer recomputes advantages with this function over whole
groups, before any micro-batch split.
"""

from __future__ import annotations

import torch

from buffer.groups import STD_MODES, StdMode


def group_advantages(rewards: torch.Tensor, std: StdMode = "sample", eps: float = 1e-6,
                     num_generations: int | None = None) -> torch.Tensor:
    """Group-normalised advantages, same shape as `rewards`.

    rewards: (N, G), one row per prompt; or (B,) with B = N * G and
        `num_generations` = G, each group's G rewards contiguous (the order in
        which the sampler returns rows).
    std: "sample" (ddof 1), "population" (ddof 0) or "none" (Dr. GRPO).
    eps: added to the std, >= 0.
    Returns A: (N, G) or (B,), in the dtype of `rewards` (floating; integer
    rewards give float32).

    A_ng = (r_ng - mean_g r_ng) / (std_g r_ng + eps), or r_ng - mean_g r_ng for
    std="none"; rows with max == min give exactly 0.
    """
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    r = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    shape = r.shape
    if num_generations is not None:
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"num_generations must be an integer >= 1, got {num_generations!r}")
        if r.ndim != 1 or r.numel() % num_generations:
            raise ValueError(f"with num_generations={num_generations}, rewards must be (B,) with B a "
                             f"multiple of it, got shape {tuple(shape)}")
        r = r.reshape(-1, num_generations)                     # (N, G)
    elif r.ndim != 2:
        raise ValueError(f"rewards must be (N, G), or (B,) with num_generations set; got shape {tuple(shape)}")
    g = r.shape[1]
    centred = r - r.mean(dim=1, keepdim=True)                  # (N, G)
    if std == "none":
        adv = centred
    else:
        ddof = 1 if std == "sample" else 0
        # max(G - ddof, 1): a G = 1 group is all-equal and zeroed below, without a 0/0 on the way.
        sd = (centred.square().sum(dim=1, keepdim=True) / max(g - ddof, 1)).sqrt()   # (N, 1)
        adv = centred / (sd + eps)     # 0/0 only in all-equal rows, replaced just below
    all_equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)          # (N, 1)
    adv = torch.where(all_equal, torch.zeros_like(adv), adv)
    return adv.reshape(shape)
