"""Trainer pieces without a model: config checks, LR schedule, KL controller, batch layout, metric merging."""


import numpy as np
import pyarrow as pa
import pytest
import torch

from workers.checks import ConfigError
from workers.grpo import PolicyLossConfig, PolicyLossInputs, group_advantages, loss_normalizer, policy_loss
from workers.trainer import TrainerConfig, config_from_dict
from workers.trainer.batch import make_micro_batch, step_batch, table_from_bytes, table_to_bytes
from workers.trainer.control import KLController, lr_factor
from workers.trainer.distributed import Dist
from workers.trainer.metrics import LossMetrics, MetricsWriter


@pytest.mark.parametrize("kw, field", [
    ({"lr": 0.0}, "TrainerConfig.lr must be a number > 0, got 0.0"),
    ({"groups_per_step": 0}, "TrainerConfig.groups_per_step must be an integer >= 1, got 0"),
    ({"max_staleness": -1}, "TrainerConfig.max_staleness must be an integer >= 0 or None"),
    ({"betas": (0.9, 1.0)}, "TrainerConfig.betas must be two numbers in [0, 1)"),
    ({"max_grad_norm": 0}, "TrainerConfig.max_grad_norm must be a number > 0 or None"),
    ({"lr_schedule": "cosine"}, "TrainerConfig.decay_steps must be set (or max_steps set)"),
    ({"kl_control": "adaptive", "kl_target": 0.1}, "TrainerConfig.kl_control must be 'fixed' when loss.beta is 0"),
    ({"kl_control": "adaptive", "loss": PolicyLossConfig(beta=0.1)}, "TrainerConfig.kl_target must be set"),
    ({"dtype": "float16"}, "TrainerConfig.dtype must be 'float32' or 'bfloat16', got 'float16'"),
    ({"device": "tpu"}, "TrainerConfig.device must be 'cpu' or 'cuda'"),
    ({"num_threads": 0}, "TrainerConfig.num_threads must be an integer >= 1 or None"),
    ({"max_wait_seconds": 0}, "TrainerConfig.max_wait_seconds must be a number > 0 or None"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        TrainerConfig(**kw)
    assert str(e.value).startswith(field)


def test_config_defaults_and_from_dict():
    cfg = TrainerConfig()
    assert (cfg.groups_per_step, cfg.lr, cfg.max_grad_norm, cfg.max_staleness) == (32, 1e-4, 1.0, 2)
    assert cfg.loss.objective == "decoupled" and cfg.loss.beta == 0.0 and cfg.loss.epsilon == 0.2
    c = config_from_dict({"lr": 1e-4, "betas": [0.9, 0.98], "max_staleness": "none", "loss": {"beta": 0.05}})
    assert c.lr == 1e-4 and c.betas == (0.9, 0.98) and c.max_staleness is None
    assert c.loss.beta == 0.05 and c.loss.objective == "decoupled"   # laid over the trainer's default loss
    with pytest.raises(ConfigError, match="unknown TrainerConfig keys \\['lrr'\\]"):
        config_from_dict({"lrr": 1.0})
    with pytest.raises(ConfigError, match="unknown PolicyLossConfig keys \\['eps'\\]"):
        config_from_dict({"loss": {"eps": 1.0}})


def test_lr_schedules():
    warm = TrainerConfig(warmup_steps=3)
    assert [lr_factor(warm, s) for s in (1, 2, 3, 4, 100)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = TrainerConfig(lr_schedule="cosine", warmup_steps=2, decay_steps=12, min_lr_ratio=0.1)
    assert lr_factor(cos, 2) == pytest.approx(2 / 3)
    assert lr_factor(cos, 7) == pytest.approx(0.1 + 0.9 * 0.5)          # halfway: p = 5/10
    assert lr_factor(cos, 12) == pytest.approx(0.1) and lr_factor(cos, 50) == pytest.approx(0.1)
    lin = TrainerConfig(lr_schedule="linear", max_steps=10)
    assert [lr_factor(lin, s) for s in (1, 5, 10)] == pytest.approx([0.9, 0.5, 0.0])


def test_kl_controller():
    fixed = KLController(beta=0.1)
    assert fixed.update(1.0, 256) == 0.1
    ada = KLController(beta=0.1, target=0.01, horizon=1000, adaptive=True)
    assert ada.update(0.1, 100) == pytest.approx(0.1 * (1 + 0.2 * 0.1))      # far above: +20% x B/horizon
    assert ada.update(0.008, 100) == pytest.approx(0.1 * 1.02 * (1 - 0.2 * 0.1))
    assert ada.update(None, 100) == pytest.approx(0.1 * 1.02 * 0.98)         # not measured: unchanged
    again = KLController(beta=1.0)
    again.load_state_dict(ada.state_dict())
    assert again.beta == ada.beta


def _table(groups):
    """Rows like the sampler's: groups contiguous; groups = [(rewards, temperature)]."""
    rows = []
    for g, (rewards, temp) in enumerate(groups):
        for i, r in enumerate(rewards):
            c = 1 + (g + i) % 3
            rows.append({"group_id": f"g{g}", "prompt_ids": [1, 5 + g] + [7] * (i % 2),
                         "completion_ids": list(range(20, 20 + c)),
                         "behavior_logprobs": [-0.5 * (k + 1) for k in range(c)],
                         "reward": float(r), "temperature": temp, "version": 0, "correct": bool(r),
                         "finish_reason": "length" if c == 3 else "stop", "group_size": len(rewards)})
    return pa.Table.from_pylist(rows)


def test_step_batch_advantages_are_per_whole_group():
    table = _table([([1, 0, 0, 1], 1.0), ([0, 0, 1, 1], 1.0), ([1, 0, 0], 0.5)])
    b = step_batch(table, std="sample")
    assert b.size == 11 and b.group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 3
    want = torch.cat([group_advantages(torch.tensor([[1.0, 0, 0, 1], [0, 0, 1, 1]])).reshape(-1),
                      group_advantages(torch.tensor([[1.0, 0, 0]]))[0]])
    assert torch.allclose(b.advantages, want)
    assert b.truncated.tolist() == [c == 3 for c in b.completion_lengths]
    assert table_from_bytes(table_to_bytes(table)).equals(table)


def test_micro_batch_layout():
    b = step_batch(_table([([1, 0], 0.7)]))
    mb = make_micro_batch(b, np.array([1, 0]), pad_id=0)
    # row 1: prompt [1, 5, 7], completion [20, 21]; row 0: prompt [1, 5], completion [20]
    assert mb.input_ids.tolist() == [[1, 5, 7, 20, 21], [1, 5, 20, 0, 0]]
    assert mb.logit_index.tolist() == [[2, 3], [1, 0]]      # logits at p-1+t predict completion token t
    assert mb.completion_ids.tolist() == [[20, 21], [20, 0]]
    assert mb.mask.tolist() == [[True, True], [True, False]]
    assert mb.behaviour_logprobs.tolist() == [[-0.5, -1.0], [-0.5, 0.0]]
    assert mb.advantages.tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-4)
    assert mb.temperature.tolist() == pytest.approx([0.7, 0.7])


def test_loss_metrics_merge_equals_full_batch():
    """policy_loss over 3 micro-batches, merged, gives the full batch's metrics (one process or two)."""
    g = torch.Generator().manual_seed(0)
    B, T = 10, 5
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True
    mu = -torch.rand(B, T, generator=g) * 2
    old = mu + 0.3 * torch.randn(B, T, generator=g)
    new = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    cfg = PolicyLossConfig(objective="decoupled", is_threshold=1.5)
    full_loss, full = policy_loss(PolicyLossInputs(new, mu, adv, mask, old_logprobs=old), cfg)
    norm = loss_normalizer(mask, cfg)
    acc = LossMetrics()
    total = 0.0
    for rows in (slice(0, 4), slice(4, 7), slice(7, 10)):
        loss, m = policy_loss(PolicyLossInputs(new[rows], mu[rows], adv[rows], mask[rows], old_logprobs=old[rows]),
                              cfg, norm)
        total += float(loss)
        acc.add(m)
    merged = acc.result(Dist(), epochs=1)
    assert total == pytest.approx(float(full_loss), abs=1e-6)
    assert set(merged) == set(full)
    for k, v in full.items():
        assert merged[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
    assert merged["is/truncated_count"] > 0 and merged["clip/low_count"] + merged["clip/high_count"] > 0


def test_metrics_writer_truncates_after_a_step(tmp_path):
    import pyarrow.parquet as pq

    w = MetricsWriter(tmp_path / "metrics", flush_seconds=1e9)
    for step in range(1, 8):
        w.add({"step": step, "loss/total": step / 10})
        if step in (3, 6):
            w.flush()
    w.flush()
    names = sorted(p.name for p in (tmp_path / "metrics").glob("*.parquet"))
    assert names == ["steps-000000001-000000003.parquet", "steps-000000004-000000006.parquet",
                     "steps-000000007-000000007.parquet"]
    assert w.truncate_after(4) == 3   # steps 5, 6 (shard rewritten) and 7 (shard deleted)
    rows = [r for p in sorted((tmp_path / "metrics").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert rows == [{"step": s, "loss/total": s / 10} for s in (1, 2, 3, 4)]


def test_poll_delays_start_short_and_double_to_the_poll_interval():
    from itertools import islice

    from workers.proc import poll_delays

    assert list(islice(poll_delays(0.25), 7)) == [0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.25]
    assert list(islice(poll_delays(0.005), 3)) == [0.005, 0.005, 0.005]   # an interval below the first pause
