"""GRPO math as pure tensor functions: advantages, log-probs, importance weights, KL, the loss.

Shapes: N prompts, G group size (num_generations), B = N * G sequences,
T tokens, V vocabulary. Typical trainer use:

    adv = group_advantages(rewards_NG, std="sample").reshape(-1)          # (B,)
    norm = loss_normalizer(mask_BT, cfg)                                   # over the whole step batch
    for micro in split(batch):
        logp = token_logprobs(model(micro.ids).logits[:, :-1], micro.targets, temperature)
        loss, metrics = policy_loss(PolicyLossInputs(logp, micro.mu, micro.adv, micro.mask), cfg, norm)
        loss.backward()                                                    # sums to the full-batch gradient
"""

from workers.grpo.advantages import STD_MODES, StdMode, group_advantages
from workers.grpo.aggregation import AGGREGATORS, LossAggMode, aggregate
from workers.grpo.importance import IS_LEVELS, IS_MODES, ISLevel, ISMode, importance_weights
from workers.grpo.kl import KL_ESTIMATORS, KLEstimator, kl_estimate, kl_k1, kl_k2, kl_k3
from workers.grpo.logprobs import entropy_from_logits, token_logprobs
from workers.grpo.loss import PolicyLossConfig, PolicyLossInputs, loss_normalizer, policy_loss

__all__ = [
    "AGGREGATORS", "IS_LEVELS", "IS_MODES", "KL_ESTIMATORS", "STD_MODES",
    "ISLevel", "ISMode", "KLEstimator", "LossAggMode", "StdMode",
    "PolicyLossConfig", "PolicyLossInputs",
    "aggregate", "entropy_from_logits", "group_advantages", "importance_weights",
    "kl_estimate", "kl_k1", "kl_k2", "kl_k3", "loss_normalizer", "policy_loss", "token_logprobs",
]
