"""policy_loss gradients: gradcheck in every mode, masking, micro-batch accumulation, on-policy sanity."""

import itertools

import pytest
import torch

from workers.grpo import PolicyLossConfig, PolicyLossInputs, group_advantages, loss_normalizer, policy_loss

D = torch.float64
AGG = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def config(**kw):
    if kw.get("loss_agg_mode") == "seq-mean-token-sum-norm":
        kw.setdefault("max_completion_length", 8)
    return PolicyLossConfig(**kw)


def batch(seed=0, n=3, g=3, t=6):
    """B = n * g sequences: left prompt tokens and right padding masked, one row with no completion token."""
    gen = torch.Generator().manual_seed(seed)
    b = n * g
    start = torch.randint(0, 2, (b, 1), generator=gen)
    length = torch.randint(1, t - 1, (b, 1), generator=gen)
    pos = torch.arange(t)[None]
    mask = (pos >= start) & (pos < start + length)                    # (B, T)
    mask[-1] = False                                                  # a padding row
    rewards = torch.randint(0, 3, (n, g), generator=gen).to(D)
    adv = group_advantages(rewards, std="sample").reshape(-1)          # (B,)
    mu = -torch.rand(b, t, generator=gen, dtype=D) * 3                 # (B, T)
    old = mu + 0.6 * torch.randn(b, t, generator=gen, dtype=D)
    new = old + 0.3 * torch.randn(b, t, generator=gen, dtype=D)
    ref = new + 0.2 * torch.randn(b, t, generator=gen, dtype=D)
    return dict(new=new, mu=mu, old=old, ref=ref, adv=adv, mask=mask)


def loss_of(new, data, cfg, normalizer=None, rows=slice(None)):
    inputs = PolicyLossInputs(
        logprobs=new, behaviour_logprobs=data["mu"][rows], advantages=data["adv"][rows], mask=data["mask"][rows],
        old_logprobs=data["old"][rows] if cfg.objective == "decoupled" else None,
        ref_logprobs=data["ref"][rows] if cfg.beta > 0 else None)
    return policy_loss(inputs, cfg, normalizer)


MODES = (
    [dict(loss_agg_mode=a) for a in AGG]
    + [dict(objective="decoupled", is_level=lvl, is_mode=mode, loss_agg_mode=a)
       for lvl, mode, a in [("token", "truncate", "token-mean"), ("token", "mask", "seq-mean-token-mean"),
                            ("token", None, "token-mean"), ("sequence-product", "truncate", "seq-mean-token-mean"),
                            ("sequence-product", "mask", "token-mean"),
                            ("sequence-geomean", "truncate", "seq-mean-token-sum-norm"),
                            ("sequence-geomean", "mask", "token-mean")]]
    + [dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean"),
       dict(ratio_level="sequence", objective="decoupled", epsilon=0.1, epsilon_high=0.3)]
    + [dict(beta=0.2, kl_estimator=k, loss_agg_mode=a) for k, a in
       [("k1", "token-mean"), ("k2", "seq-mean-token-mean"), ("k3", "seq-mean-token-sum-norm")]]
    + [dict(epsilon=0.1, epsilon_high=0.28, objective="decoupled", beta=0.05)]
)
IDS = ["-".join(f"{k}={v}" for k, v in m.items()) for m in MODES]


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_gradcheck(mode):
    data, cfg = batch(), config(**mode)
    new = data["new"].clone().requires_grad_()
    _, m = loss_of(new, data, cfg)
    assert m["loss/num_tokens"] > 0
    assert torch.autograd.gradcheck(lambda x: loss_of(x, data, cfg)[0], (new,), eps=1e-6, atol=1e-7)


def test_the_batch_exercises_clipping_and_is_treatment():
    data = batch()
    _, m = loss_of(data["new"], data, config(objective="decoupled", is_mode="mask", epsilon=0.1))
    assert m["clip/frac"] > 0 and m["is/masked_count"] > 0
    _, m = loss_of(data["new"], data, config(objective="decoupled"))
    assert m["is/truncated_count"] > 0


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_masked_positions_contribute_nothing(mode):
    data, cfg = batch(seed=1), config(**mode)
    off = ~data["mask"]
    wild = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 7.0], dtype=D)
    fill = wild[torch.arange(int(off.sum())) % len(wild)]
    changed = {k: v.clone() for k, v in data.items()}
    for key in ("new", "mu", "old", "ref"):
        changed[key][off] = fill
    results = []
    for d in (data, changed):
        new = d["new"].clone().requires_grad_()
        loss, metrics = loss_of(new, d, cfg)
        loss.backward()
        results.append((loss, metrics, new.grad))
    (l0, m0, g0), (l1, m1, g1) = results
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)
    assert (g1[off] == 0).all() and g1[data["mask"]].abs().sum() > 0


def test_token_advantages_at_masked_positions_are_ignored():
    data, cfg = batch(seed=2), config()
    adv_bt = data["adv"][:, None].expand(-1, 6).clone()
    adv_bt[~data["mask"]] = float("nan")
    new = data["new"].clone().requires_grad_()
    loss = policy_loss(PolicyLossInputs(new, data["mu"], adv_bt, data["mask"]), cfg)[0]
    assert torch.equal(loss, loss_of(data["new"], data, cfg)[0])


@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("extra", [{}, dict(objective="decoupled", is_level="sequence-product", beta=0.1),
                                   dict(ratio_level="sequence", objective="decoupled", is_mode="mask")],
                         ids=["bypass", "decoupled-seq-is-kl", "gspo-mask"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(agg, extra):
    data, cfg = batch(seed=3, n=4, g=3, t=7), config(loss_agg_mode=agg, **extra)
    full = data["new"].clone().requires_grad_()
    full_loss = loss_of(full, data, cfg)[0]
    full_loss.backward()

    norm = loss_normalizer(data["mask"], cfg)
    leaf = data["new"].clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 8), slice(8, 12)):
        used = int(data["mask"][rows].any(0).nonzero().max()) + 1 if data["mask"][rows].any() else 1
        cut = {k: (v[rows, :used] if v.ndim == 2 else v[rows]) for k, v in data.items()}   # own padding width
        loss = loss_of(leaf[rows, :used], cut, cfg, normalizer=norm)[0]
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full_loss.item(), abs=1e-12)
    torch.testing.assert_close(leaf.grad, full.grad, rtol=0, atol=1e-6)
    assert full.grad.abs().sum() > 0
    # without the shared normaliser the micro-batch losses do not add up (the test can fail)
    unnormed = sum(loss_of(data["new"][r], {k: v[r] for k, v in data.items()}, cfg)[0].item()
                   for r in (slice(0, 2), slice(2, 12)))
    assert unnormed != pytest.approx(full_loss.item(), abs=1e-6)


@pytest.mark.parametrize("is_mode, is_level, objective",
                         list(itertools.product(["truncate", "mask", None],
                                                ["token", "sequence-product", "sequence-geomean"],
                                                ["bypass", "decoupled"])))
def test_on_policy_gradient_is_the_plain_policy_gradient(is_mode, is_level, objective):
    data = batch(seed=4)
    data["old"] = data["mu"] = data["new"].clone()          # new == old == behaviour
    m = data["mask"].to(D)
    adv = data["adv"][:, None]
    n_tok, lengths = m.sum(), m.sum(1, keepdim=True)
    n_seq = (lengths > 0).sum()
    plain = {                                                 # d/d log pi of the aggregated -A log pi
        "token-mean": -adv * m / n_tok,
        "seq-mean-token-mean": -adv * m / lengths.clamp_min(1) / n_seq,
        "seq-mean-token-sum-norm": -adv * m / (n_seq * 8),
    }
    for agg, ratio_level in itertools.product(AGG, ["token", "sequence"]):
        cfg = config(is_mode=is_mode, is_level=is_level, objective=objective, loss_agg_mode=agg,
                     ratio_level=ratio_level)
        new = data["new"].clone().requires_grad_()
        loss, metrics = loss_of(new, data, cfg)
        loss.backward()
        torch.testing.assert_close(new.grad, plain[agg], rtol=0, atol=1e-12)
        assert metrics["is/mean"] == 1 and metrics["clip/frac"] == 0 and metrics["kl/new_behaviour"] == 0
