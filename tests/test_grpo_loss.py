"""policy_loss: hand-computed values for every mode and option, metric counts, bad configs."""

import math

import pytest
import torch

from workers.grpo import PolicyLossConfig, PolicyLossInputs, importance_weights, loss_normalizer, policy_loss

D = torch.float64
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)      # (B=2, T=3); seq 0 has one pad token
ADV = torch.tensor([1.0, -1.0], dtype=D)                             # (B,)
MU = torch.tensor([[0.5, 0.4, 0.2], [0.3, 0.6, 0.5]], dtype=D).log()
RATIO = torch.tensor([[1.1, 1.5, 1.0], [0.9, 0.5, 1.0]], dtype=D)    # pi_theta / pi_old
IS_W = torch.tensor([[3.0, 1.0, 1.0], [0.25, 1.5, 1.8]], dtype=D)    # pi_old / mu
# Per-token PPO terms at epsilon 0.2 (A=+1: -min(r, clip r); A=-1: +max(r, clip r)):
SEQ0, SEQ1 = [-1.1, -1.2], [0.9, 0.8, 1.0]


def bypass_inputs(**kw):
    return PolicyLossInputs(logprobs=MU + RATIO.log(), behaviour_logprobs=MU, advantages=ADV, mask=MASK, **kw)


def decoupled_inputs(**kw):
    old = MU + IS_W.log()
    return PolicyLossInputs(logprobs=old + RATIO.log(), behaviour_logprobs=MU, advantages=ADV, mask=MASK,
                            old_logprobs=old, **kw)


def run(inputs, **cfg):
    loss, metrics = policy_loss(inputs, PolicyLossConfig(**cfg))
    return loss.item(), {k: v.item() for k, v in metrics.items()}


@pytest.mark.parametrize("mode, extra, want", [
    ("token-mean", {}, (sum(SEQ0) + sum(SEQ1)) / 5),                                # 0.08
    ("seq-mean-token-mean", {}, (sum(SEQ0) / 2 + sum(SEQ1) / 3) / 2),               # -0.125
    ("seq-mean-token-sum-norm", {"max_completion_length": 4}, (sum(SEQ0) + sum(SEQ1)) / (2 * 4)),   # 0.05
])
def test_bypass_aggregation_modes(mode, extra, want):
    loss, m = run(bypass_inputs(), loss_agg_mode=mode, **extra)
    assert loss == pytest.approx(want, abs=1e-12)
    assert (m["clip/high_count"], m["clip/low_count"]) == (1, 1)     # 1.5 with A>0; 0.5 with A<0
    assert m["clip/high_frac"] == m["clip/low_frac"] == pytest.approx(1 / 5)
    assert m["clip/frac"] == pytest.approx(2 / 5)
    # bypass: old == behaviour, so the IS weight is exactly 1 whatever is_mode says
    assert (m["is/mean"], m["is/max"], m["is/truncated_count"], m["is/masked_count"]) == (1, 1, 0, 0)
    assert (m["loss/num_tokens"], m["loss/num_seqs"]) == (5, 2)
    r = [1.1, 1.5, 0.9, 0.5, 1.0]
    assert m["kl/new_behaviour"] == m["kl/new_old"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 5)
    assert m["kl/old_behaviour"] == 0
    assert m["clip/ratio_max"] == pytest.approx(1.5) and m["clip/ratio_mean"] == pytest.approx(5.0 / 5)


def test_clip_higher_and_epsilon():
    loss, m = run(bypass_inputs(), epsilon_high=0.6)
    assert loss == pytest.approx((-1.1 - 1.5 + sum(SEQ1)) / 5, abs=1e-12)       # 1.5 no longer clipped
    assert (m["clip/high_count"], m["clip/low_count"]) == (0, 1)
    loss, m = run(bypass_inputs(), epsilon=0.0)                                  # clip to exactly 1
    assert loss == pytest.approx((-1 - 1 + 1 + 1 + 1) / 5, abs=1e-12)
    assert (m["clip/high_count"], m["clip/low_count"]) == (2, 2)   # 1.1, 1.5 above 1 with A>0; 0.9, 0.5 below with A<0


@pytest.mark.parametrize("is_mode, weights, truncated, masked", [
    ("truncate", [[2.0, 1.0], [0.25, 1.5, 1.8]], 1, 0),      # 3.0 capped at 2
    ("mask", [[0.0, 1.0], [0.0, 1.5, 1.8]], 0, 2),           # 3.0 > 2 and 0.25 < 1/2 dropped
    (None, [[1.0, 1.0], [1.0, 1.0, 1.0]], 0, 0),
])
def test_decoupled_token_is_modes(is_mode, weights, truncated, masked):
    loss, m = run(decoupled_inputs(), objective="decoupled", is_mode=is_mode)
    terms = SEQ0 + SEQ1
    want = sum(w * t for w, t in zip(weights[0] + weights[1], terms)) / 5
    assert loss == pytest.approx(want, abs=1e-12)
    assert (m["is/truncated_count"], m["is/masked_count"], m["is/num_units"]) == (truncated, masked, 5)
    assert m["is/truncated_frac"] == pytest.approx(truncated / 5) and m["is/masked_frac"] == pytest.approx(masked / 5)
    assert m["is/mean"] == pytest.approx((3 + 1 + 0.25 + 1.5 + 1.8) / 5)
    assert (m["is/max"], m["is/min"]) == pytest.approx((3.0, 0.25))
    w = [3.0, 1.0, 0.25, 1.5, 1.8]
    assert m["kl/old_behaviour"] == pytest.approx(sum(x - 1 - math.log(x) for x in w) / 5)
    assert m["kl/new_behaviour"] == pytest.approx(
        sum(x - 1 - math.log(x) for x in [3 * 1.1, 1.5, 0.25 * 0.9, 1.5 * 0.5, 1.8]) / 5)


def test_mask_mode_custom_low_bound():
    loss, m = run(decoupled_inputs(), objective="decoupled", is_mode="mask", is_threshold=4.0, is_threshold_low=0.2)
    assert m["is/masked_count"] == 0
    assert loss == pytest.approx(sum(w * t for w, t in zip([3, 1, 0.25, 1.5, 1.8], SEQ0 + SEQ1)) / 5, abs=1e-12)


PROD = [3.0, 0.25 * 1.5 * 1.8]                                   # 3.0, 0.675
GEO = [math.sqrt(3.0), (0.25 * 1.5 * 1.8) ** (1 / 3)]            # 1.732, 0.877


@pytest.mark.parametrize("level, is_mode, seq_w, truncated, masked", [
    ("sequence-product", "truncate", [2.0, PROD[1]], 1, 0),
    ("sequence-product", "mask", [0.0, PROD[1]], 0, 1),
    ("sequence-geomean", "truncate", GEO, 0, 0),
    ("sequence-geomean", "mask", GEO, 0, 0),
    ("sequence-product", None, [1.0, 1.0], 0, 0),
])
def test_decoupled_sequence_is_levels(level, is_mode, seq_w, truncated, masked):
    loss, m = run(decoupled_inputs(), objective="decoupled", is_level=level, is_mode=is_mode)
    assert loss == pytest.approx((seq_w[0] * sum(SEQ0) + seq_w[1] * sum(SEQ1)) / 5, abs=1e-12)
    assert (m["is/truncated_count"], m["is/masked_count"], m["is/num_units"]) == (truncated, masked, 2)
    raw = PROD if level == "sequence-product" else GEO
    assert m["is/mean"] == pytest.approx(sum(raw) / 2) and m["is/max"] == pytest.approx(max(raw))


def test_gspo_sequence_ratio():
    s0, s1 = math.sqrt(1.1 * 1.5), (0.9 * 0.5 * 1.0) ** (1 / 3)   # 1.2845, 0.7663
    loss, m = run(bypass_inputs(), ratio_level="sequence", loss_agg_mode="seq-mean-token-mean")
    assert loss == pytest.approx((-1.2 + 0.8) / 2, abs=1e-12)      # both sequences clipped
    assert (m["clip/high_count"], m["clip/low_count"]) == (2, 3)    # counted per token
    loss, _ = run(bypass_inputs(), ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", epsilon=0.3)
    assert loss == pytest.approx((-s0 + s1) / 2, abs=1e-12)
    loss, _ = run(bypass_inputs(), ratio_level="sequence", epsilon=0.3)   # token-mean weighs by length
    assert loss == pytest.approx((-2 * s0 + 3 * s1) / 5, abs=1e-12)


DELTA = torch.tensor([[0.1, -0.2, 7.0], [0.0, 0.3, -0.1]], dtype=D)   # log ref - log new; 7.0 is padding
D5 = [0.1, -0.2, 0.0, 0.3, -0.1]
KL = {"k1": [-d for d in D5], "k2": [d * d / 2 for d in D5], "k3": [math.exp(d) - 1 - d for d in D5]}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_to_reference(estimator):
    inputs = bypass_inputs(ref_logprobs=MU + RATIO.log() + DELTA)
    loss, m = run(inputs, beta=0.1, kl_estimator=estimator)
    kl = sum(KL[estimator]) / 5
    assert loss == pytest.approx((sum(SEQ0) + sum(SEQ1)) / 5 + 0.1 * kl, abs=1e-12)
    assert m["loss/kl"] == pytest.approx(kl, abs=1e-12) and m["kl/ref"] == pytest.approx(kl, abs=1e-12)
    assert m["loss/policy"] == pytest.approx((sum(SEQ0) + sum(SEQ1)) / 5, abs=1e-12)
    loss, m = run(bypass_inputs(), beta=0.1 * 0, kl_estimator=estimator)          # beta 0: no reference needed
    assert loss == pytest.approx(0.08, abs=1e-12) and "kl/ref" not in m


def test_kl_with_seq_mean_aggregation_and_metric_only_reference():
    inputs = bypass_inputs(ref_logprobs=MU + RATIO.log() + DELTA)
    loss, m = run(inputs, beta=0.5, loss_agg_mode="seq-mean-token-mean")
    kl = (sum(KL["k3"][:2]) / 2 + sum(KL["k3"][2:]) / 3) / 2
    assert loss == pytest.approx(-0.125 + 0.5 * kl, abs=1e-12)
    loss, m = run(inputs)                                                        # beta 0, ref given: metric only
    assert loss == pytest.approx(0.08, abs=1e-12) and m["kl/ref"] == pytest.approx(sum(KL["k3"]) / 5)


def test_entropy_metric_from_logits():
    logits = torch.zeros(2, 3, 8, dtype=D)
    logits[0, 2] = float("nan")                                                 # padding: ignored
    logits[1, 0, 0] = 2 * math.log(3)   # at T = 2: p ∝ [3, 1, ..., 1] over 8
    _, m = run(bypass_inputs(logits=logits, temperature=2.0))
    p = [3 / 10] + [1 / 10] * 7
    h = -sum(x * math.log(x) for x in p)
    assert m["loss/entropy"] == pytest.approx((4 * math.log(8) + h) / 5, abs=1e-12)


def test_entropy_bonus_subtracts_the_aggregated_entropy_and_pushes_toward_uniform():
    """entropy_coef * H is subtracted, aggregated like the policy term; its gradient raises the entropy
    of every completion position (and of none under the mask), and is zero where the policy is uniform."""
    logits = torch.zeros(2, 3, 8, dtype=D)
    logits[0, 2] = 5.0                                                          # padding: ignored
    logits[1, 0, 0] = 2 * math.log(3)   # at T = 2: p ∝ [3, 1, ..., 1] over 8
    logits.requires_grad_(True)
    p = [3 / 10] + [1 / 10] * 7
    h = -sum(x * math.log(x) for x in p)
    loss, m = policy_loss(bypass_inputs(logits=logits, temperature=2.0), PolicyLossConfig(entropy_coef=0.1))
    assert loss.item() == pytest.approx(0.08 - 0.1 * (4 * math.log(8) + h) / 5, abs=1e-12)
    assert m["loss/entropy_bonus"].item() == pytest.approx((4 * math.log(8) + h) / 5, abs=1e-12)
    assert m["loss/entropy"].item() == pytest.approx((4 * math.log(8) + h) / 5, abs=1e-12)
    loss, m = policy_loss(bypass_inputs(logits=logits, temperature=2.0),
                          PolicyLossConfig(entropy_coef=0.1, loss_agg_mode="seq-mean-token-mean"))
    bonus = (2 * math.log(8) / 2 + (2 * math.log(8) + h) / 3) / 2
    assert m["loss/entropy_bonus"].item() == pytest.approx(bonus, abs=1e-12)
    assert loss.item() == pytest.approx(-0.125 - 0.1 * bonus, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad[0, 2].abs().sum().item() == 0                                   # masked: exactly none
    assert grad[0, :2].abs().max().item() < 1e-15 and grad[1, 1:].abs().max().item() < 1e-15   # uniform
    # the one peaked position: d(-H)/dz_v = p_v (log p_v + H) / T, lowering the peak, raising the rest
    want = [0.1 / 6 * x * (math.log(x) + h) / 2.0 for x in p]
    assert grad[1, 0].tolist() == pytest.approx(want, abs=1e-12)
    assert grad[1, 0, 0] > 0 > grad[1, 0, 1]
    _, m = policy_loss(bypass_inputs(logits=logits, temperature=2.0), PolicyLossConfig())
    assert "loss/entropy_bonus" not in m                                        # off: the metric only


def test_importance_weight_counts_on_a_larger_batch():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    w = torch.tensor([[5.0, 0.1, 1.0, 2.5], [0.4, 0.6, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0], [1.9, 9.0, 0.0 + 1, 1]])
    mu = torch.full((4, 4), -1.0, dtype=D)
    old = mu + w.to(D).log()
    _, m = importance_weights(old, mu, mask, "token", "truncate", 2.0)
    assert (m["is/truncated_count"].item(), m["is/num_units"].item()) == (2, 7)   # 5.0, 2.5
    _, m = importance_weights(old, mu, mask, "token", "mask", 2.0)
    assert m["is/masked_count"].item() == 4                                          # 5.0, 0.1, 2.5, 0.4
    _, m = importance_weights(old, mu, mask, "token", "mask", 3.0, 0.5)
    assert m["is/masked_count"].item() == 3                                          # 5.0, 0.1, 0.4
    weights, m = importance_weights(old, mu, mask, "sequence-product", "truncate", 2.0)
    # products: 1.25, 0.24, (empty: not a unit), 1.9
    assert (m["is/truncated_count"].item(), m["is/num_units"].item()) == (0, 3)
    assert weights[0].tolist() == pytest.approx([1.25] * 4) and weights[2].tolist() == [0.0] * 4
    assert weights[1].tolist() == pytest.approx([0.24, 0.24, 0, 0])
    _, m = importance_weights(old, mu, mask, "sequence-product", "mask", 2.0)
    assert m["is/masked_count"].item() == 1 and m["is/masked_frac"].item() == pytest.approx(1 / 3)   # 0.24


def test_normalizer_helper():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert loss_normalizer(mask, PolicyLossConfig()) == 5.0
    assert loss_normalizer(mask, PolicyLossConfig(loss_agg_mode="seq-mean-token-mean")) == 2.0
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm", max_completion_length=16)
    assert loss_normalizer(mask, cfg) == 32.0
    assert loss_normalizer(torch.zeros(2, 3), PolicyLossConfig()) == 1.0
    empty = PolicyLossInputs(MU, MU, ADV, torch.zeros_like(MASK))
    loss, m = policy_loss(empty, PolicyLossConfig())
    assert loss.item() == 0.0 and all(math.isfinite(v.item()) for v in m.values())


@pytest.mark.parametrize("field, value", [
    ("objective", "proximal"), ("is_level", "sequence"), ("is_mode", "clip"), ("ratio_level", "seq"),
    ("kl_estimator", "k4"), ("loss_agg_mode", "seq-mean-token-sum"), ("is_threshold", 0.5),
    ("is_threshold", float("inf")), ("is_threshold_low", 1.5), ("is_threshold_low", 0.0), ("epsilon", 1.0),
    ("epsilon", -0.1), ("epsilon_high", -0.2), ("beta", -0.01), ("beta", float("nan")), ("epsilon", True),
    ("entropy_coef", -0.001), ("entropy_coef", float("inf")),
    ("max_completion_length", 0), ("max_completion_length", 12.5),
])
def test_bad_config_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"PolicyLossConfig\.{field} must .*got {repr(value)}"):
        PolicyLossConfig(**{field: value})


def test_sum_norm_requires_its_constant():
    with pytest.raises(ValueError, match=r"max_completion_length .*seq-mean-token-sum-norm.*got None"):
        PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm")


def test_inputs_and_mode_mismatches():
    with pytest.raises(ValueError, match=r"decoupled.*old_logprobs"):
        policy_loss(bypass_inputs(), PolicyLossConfig(objective="decoupled"))
    with pytest.raises(ValueError, match=r"bypass.*old_logprobs must be None"):
        policy_loss(decoupled_inputs(), PolicyLossConfig())
    with pytest.raises(ValueError, match=r"beta=0.1 .*ref_logprobs"):
        policy_loss(bypass_inputs(), PolicyLossConfig(beta=0.1))
    with pytest.raises(ValueError, match=r"entropy_coef=0.01 > 0 needs the policy's logits"):
        policy_loss(bypass_inputs(), PolicyLossConfig(entropy_coef=0.01))
    with pytest.raises(ValueError, match=r"normalizer .*got 0"):
        policy_loss(bypass_inputs(), PolicyLossConfig(), normalizer=0)
    with pytest.raises(ValueError, match=r"behaviour_logprobs .*\(2, 3\), got \(2, 4\)"):
        PolicyLossInputs(MU, torch.zeros(2, 4), ADV, MASK)
    with pytest.raises(ValueError, match=r"advantages .*got \(3,\)"):
        PolicyLossInputs(MU, MU, torch.zeros(3), MASK)
    with pytest.raises(ValueError, match=r"temperature .*got 0"):
        PolicyLossInputs(MU, MU, ADV, MASK, temperature=0)
