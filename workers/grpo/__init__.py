"""GRPO math as pure tensor functions: advantages, log-probs, importance weights, KL, the loss.

Shapes: N prompts, G group size (num_generations), B = N * G sequences,
T tokens, V vocabulary. Typical trainer use:

    adv = group_advantages(rewards_NG, std="sample").reshape(-1)          # (B,)
    norm = loss_normalizer(mask_BT, cfg)                                   # over the whole step batch
    for micro in split(batch):
        logp = token_logprobs(model(micro.ids).logits[:, :-1], micro.targets, temperature)
        loss, metrics = policy_loss(PolicyLossInputs(logp, micro.mu, micro.adv, micro.mask), cfg, norm)
        loss.backward()                                                    # sums to the full-batch gradient

Names are imported on first use, and `workers.grpo.options` (the accepted
names and PolicyLossConfig) needs no torch, so configs are checked without it.
"""

from importlib import import_module

_WHERE = {
    **dict.fromkeys(["STD_MODES", "IS_LEVELS", "IS_MODES", "StdMode", "ISLevel", "ISMode", "KLEstimator",
                     "LossAggMode", "PolicyLossConfig"], "workers.grpo.options"),
    "group_advantages": "workers.grpo.advantages",
    **dict.fromkeys(["AGGREGATORS", "aggregate"], "workers.grpo.aggregation"),
    "importance_weights": "workers.grpo.importance",
    **dict.fromkeys(["KL_ESTIMATORS", "kl_estimate", "kl_k1", "kl_k2", "kl_k3"], "workers.grpo.kl"),
    **dict.fromkeys(["entropy_from_logits", "token_logprobs"], "workers.grpo.logprobs"),
    **dict.fromkeys(["PolicyLossInputs", "loss_normalizer", "policy_loss"], "workers.grpo.loss"),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'workers.grpo' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
