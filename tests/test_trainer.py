"""The trainer on the tiny model: it learns, its metrics, staleness, clean and unclean exits, exact resume."""

import json
import logging
import math
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from buffer import BufferSQL
from conftest import kill_9_at_pause
from helpers.trainer_fixtures import (REPO, env, model_folder, newest_checkpoint, sampled,  # noqa: F401
                                      trainer_args, trainer_cmd, write_buffer)
from helpers.trainer_rollouts import make_prompts, mean_reward
from workers.grpo import PolicyLossConfig
from workers.trainer import TrainerConfig, TrainerError, run_trainer
from workers.weights import WeightStore

FAST = dict(num_threads=1, checkpoint_every=1000, publish_every=1000, metrics_flush_seconds=0.0)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_training_on_a_fixed_buffer_raises_reward(tmp_path, model_folder):  # noqa: F811
    """Reward 1 when the completion starts with a digit (about 10/64 at random): 12 offline steps."""
    from workers.model import load_model, load_tokenizer

    groups = sampled(str(model_folder), 32)
    write_buffer(tmp_path, groups)
    cfg = TrainerConfig(groups_per_step=4, lr=2e-3, reuse=2, **FAST)
    run_trainer(tmp_path, cfg, model_folder=model_folder, offline=True)

    db = BufferSQL(tmp_path)
    trainable = db.query("SELECT count(*) n FROM groups WHERE NOT filtered").column("n")[0].as_py()
    steps = db.query("SELECT count(*) n, max(step) last FROM metrics").to_pylist()[0]
    assert steps["n"] == steps["last"] == -(-2 * trainable // 4)          # two passes, 4 groups a step
    store = WeightStore(tmp_path / "weights")
    assert store.latest() == steps["last"]
    tok = load_tokenizer(model_folder)
    before, after = load_model(model_folder), load_model(store.folder(store.latest()))
    prompts = make_prompts(32, seed=2)                                      # unseen prompts
    r0 = mean_reward(before, tok, prompts, 8, seed=3, max_new_tokens=1)
    r1 = mean_reward(after, tok, prompts, 8, seed=3, max_new_tokens=1)
    assert r0 < 0.2 and r1 > r0 + 0.25, (r0, r1)

    # The surrogate on the fixed buffer, -sum_b A_b sum_t log pi(y_bt), went down.
    def surrogate(model):
        total = 0.0
        with torch.no_grad():
            for g in groups:
                r = torch.tensor([c.reward for c in g.completions])
                if r.std() == 0:
                    continue
                adv = (r - r.mean()) / (r.std() + 1e-6)
                for a, c in zip(adv, g.completions):
                    ids = torch.tensor([list(g.prompt_ids) + list(c.token_ids)])
                    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
                    lp = logp[torch.arange(len(g.prompt_ids) - 1, ids.shape[1] - 1), ids[0, len(g.prompt_ids):]]
                    total -= float(a) * float(lp.sum())
        return total
    assert surrogate(after) < surrogate(before) - 1.0


def test_metrics_rows_and_on_policy_alignment(tmp_path, model_folder):  # noqa: F811
    groups = sampled(str(model_folder), 12, temperature=0.7)
    write_buffer(tmp_path, groups)
    cfg = TrainerConfig(groups_per_step=3, max_steps=2, micro_batch_size=7, num_iterations=2,
                        loss=PolicyLossConfig(objective="decoupled", beta=0.04, entropy_coef=0.01), **FAST)
    run_trainer(tmp_path, cfg, model_folder=model_folder, offline=True)
    rows = BufferSQL(tmp_path).query("SELECT * FROM metrics ORDER BY step").to_pylist()
    assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [1, 2]
    for name in ("loss/total", "loss/policy", "loss/kl", "loss/entropy", "kl/ref", "kl/new_behaviour",
                 "kl/new_old", "kl/old_behaviour", "clip/low_frac", "clip/high_frac", "clip/frac", "is/mean",
                 "is/max", "is/truncated_frac", "staleness/min", "staleness/mean", "staleness/max",
                 "reward/mean", "reward/std", "batch/accuracy", "buffer/filtered", "buffer/expired",
                 "buffer/eligible", "perf/tokens_per_s", "time/wait_s", "time/forward_s", "time/backward_s",
                 "time/publish_s", "time/step_s", "step", "version", "lr", "beta", "grad_norm", "grad/clipped"):
        assert name in rows[0] and rows[0][name] is not None, name
    assert all(r["memory/rss_mb"] > 100 for r in rows)   # torch and the model are resident
    first = rows[0]
    # Step 1 trains on data its own weights sampled (at temperature 0.7): the trainer's log-probs
    # (logits / temperature, right-padded micro-batches) match the stored behaviour log-probs.
    assert first["kl/old_behaviour"] < 1e-9 and first["is/mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["kl/ref"] > 0          # the second inner epoch moved away from the reference
    for r in rows:   # the entropy bonus (token-mean, like the policy term) is the logged token-mean entropy
        assert r["loss/entropy_bonus"] == pytest.approx(r["loss/entropy"], rel=1e-6)   # float32 sums
        assert r["loss/total"] == pytest.approx(r["loss/policy"] + 0.04 * r["loss/kl"] - 0.01 * r["loss/entropy_bonus"],
                                                rel=1e-6, abs=1e-6)
    assert first["beta"] == 0.04 and first["lr"] == 1e-4 and first["staleness/max"] == 0
    taken = [g for g in groups if len({c.reward for c in g.completions}) > 1][:3]   # oldest unfiltered
    assert first["reward/mean"] == pytest.approx(sum(c.reward for g in taken for c in g.completions) / 24)
    filtered = sum(len({c.reward for c in g.completions}) == 1 for g in groups)
    assert first["buffer/filtered"] == filtered
    assert rows[1]["staleness/mean"] == 1.0 and rows[1]["kl/old_behaviour"] > 0
    assert sum(r["batch/sequences"] for r in rows) == 2 * 3 * 8


def test_bfloat16_gradient_checkpointing_and_adaptive_kl(tmp_path, model_folder):  # noqa: F811
    write_buffer(tmp_path, sampled(str(model_folder), 12))
    cfg = TrainerConfig(groups_per_step=3, max_steps=2, dtype="bfloat16", gradient_checkpointing=True,
                        num_iterations=2, kl_control="adaptive", kl_target=1e-6, kl_horizon=100,
                        loss=PolicyLossConfig(beta=0.1), lr=3e-4, lr_schedule="linear", warmup_steps=1, **FAST)
    run_trainer(tmp_path, cfg, model_folder=model_folder, offline=True)
    rows = BufferSQL(tmp_path).query("SELECT * FROM metrics ORDER BY step").to_pylist()
    assert [r["lr"] for r in rows] == [1.5e-4, 0.0]          # warm-up 1/2, then linear decay to 0 at max_steps
    assert rows[0]["kl/ref"] > 1e-6 and rows[0]["kl/beta_next"] == pytest.approx(0.1 * (1 + 0.2 * 24 / 100))
    assert rows[1]["beta"] == rows[0]["kl/beta_next"]
    assert all(math.isfinite(r["loss/total"]) and r["grad_norm"] > 0 for r in rows)
    assert newest_checkpoint(tmp_path)["kl"]["beta"] == rows[1]["kl/beta_next"]
    # bfloat16 is autocast only: master weights (and what is published) stay float32.
    assert newest_checkpoint(tmp_path)["model"]["model.embed_tokens.weight"].dtype == torch.float32
    assert WeightStore(tmp_path / "weights").latest() == 2


def test_staleness_limit_is_never_exceeded(tmp_path, model_folder):  # noqa: F811
    """12 groups of v0 and 4 of each v1..v5, 4 groups a step, max_staleness 1: v0 groups expire."""
    groups = sampled(str(model_folder), 48)
    trainable = [g for g in groups if len({c.reward for c in g.completions}) > 1][:32]
    versions = [0] * 12 + [v for v in range(1, 6) for _ in range(4)]
    write_buffer(tmp_path, trainable, versions)
    cfg = TrainerConfig(groups_per_step=4, max_staleness=1, max_wait_seconds=0.3, poll_seconds=0.05, **FAST)
    run_trainer(tmp_path, cfg, model_folder=model_folder)
    db = BufferSQL(tmp_path)
    c = db.query("SELECT max(staleness) smax, count(*) n, count(DISTINCT group_id) d FROM consumed").to_pylist()[0]
    assert c["smax"] == 1 and c["n"] == c["d"]
    expired = db.query("SELECT count(*) n FROM groups WHERE version = 0 AND times_consumed = 0").column("n")[0]
    assert expired.as_py() == 4                                   # v0: 8 taken at v0 and v1, 4 expired
    m = db.query("SELECT max(\"buffer/expired\") e, max(\"staleness/max\") s FROM metrics").to_pylist()[0]
    assert m == {"e": 4, "s": 1.0}


def test_waits_for_a_live_generator_and_trains_on_policy(tmp_path, model_folder):  # noqa: F811
    """A generator thread writes 2 groups stamped with each new version as soon as LATEST shows it."""
    import dataclasses
    import threading

    from buffer import ShardWriter

    pool = [g for g in sampled(str(model_folder), 24) if len({c.reward for c in g.completions}) > 1][:10]
    store = WeightStore(tmp_path / "weights")
    errors = []

    def generator():
        try:
            writer = ShardWriter(tmp_path / "buffer", generator_id="gen0", flush_groups=2, flush_seconds=None)
            for v in range(5):
                deadline = time.time() + 120
                while store.latest() is None or store.latest() < v:
                    assert time.time() < deadline, f"v{v} never published"
                    time.sleep(0.01)
                for g in pool[2 * v:2 * v + 2]:
                    writer.append(dataclasses.replace(g, version=store.latest()))
        except Exception as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    thread = threading.Thread(target=generator)
    thread.start()
    cfg = TrainerConfig(groups_per_step=2, max_steps=5, max_staleness=0, poll_seconds=0.02, max_wait_seconds=60,
                        **{**FAST, "publish_every": 1})
    run_trainer(tmp_path, cfg, model_folder=model_folder)
    thread.join(timeout=60)
    assert not errors, errors
    rows = BufferSQL(tmp_path).query('SELECT step, "staleness/max" s, "time/wait_s" w FROM metrics ORDER BY step')
    assert rows.column("step").to_pylist() == [1, 2, 3, 4, 5]
    assert rows.column("s").to_pylist() == [0.0] * 5                  # on-policy: each batch sampled by v = step - 1
    assert min(rows.column("w").to_pylist()[1:]) > 0                   # it waited for the generator each step
    consumed = BufferSQL(tmp_path).query("SELECT count(DISTINCT group_id) n, max(staleness) s FROM consumed")
    assert consumed.to_pylist() == [{"n": 10, "s": 0}]


@pytest.mark.slow
def test_sigterm_while_waiting_checkpoints_and_exits_0(tmp_path, model_folder):  # noqa: F811
    write_buffer(tmp_path, [g for g in sampled(str(model_folder), 12)
                            if len({c.reward for c in g.completions}) > 1][:3])
    cfg = dict(groups_per_step=2, num_threads=1, log_wait_seconds=0.2, checkpoint_every=100)
    proc = subprocess.Popen(trainer_cmd(tmp_path, model_folder, cfg), cwd=REPO, env=env(),
                            stderr=subprocess.PIPE, text=True)
    log = []
    for line in proc.stderr:
        log.append(line)
        if "waiting for 2 eligible groups" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=60)
    log.append(rest)
    assert proc.returncode == 0, "".join(log)
    assert "1 eligible" in "".join(log) and "stopped (signal) at step 1" in "".join(log)
    assert newest_checkpoint(tmp_path)["step"] == 1
    assert WeightStore(tmp_path / "weights").latest() == 1
    with pytest.raises(TrainerError, match="pass --resume"):
        run_trainer(tmp_path, TrainerConfig(**FAST), model_folder=model_folder)


def _consumed_by_step(run):
    rows = BufferSQL(run).query("SELECT trainer_step, group_id FROM consumed ORDER BY trainer_step, group_id")
    out: dict[int, list[str]] = {}
    for r in rows.to_pylist():
        out.setdefault(r["trainer_step"], []).append(r["group_id"])
    return out


@pytest.mark.slow
def test_kill_9_mid_step_then_resume_continues_exactly(tmp_path, model_folder, caplog):  # noqa: F811
    """kill -9 in the middle of step 5, after its pull (checkpoint at 3); the resumed run equals an unbroken one."""
    groups = [g for g in sampled(str(model_folder), 48) if len({c.reward for c in g.completions}) > 1][:16]
    # 4 epochs of 4 micro-batches: the resumed step reshuffles its epochs exactly as the unbroken one.
    cfg = dict(groups_per_step=2, num_iterations=4, micro_batch_size=4, checkpoint_every=3, num_threads=1,
               metrics_flush_seconds=0.0)
    broken, whole = tmp_path / "broken", tmp_path / "whole"
    write_buffer(broken, groups)
    shutil.copytree(broken, whole)

    # The trainer pauses inside step 5 (trainer_pause.py) and is killed there: no race with the step's end.
    marker = tmp_path / "paused"
    kill_9_at_pause([sys.executable, str(REPO / "tests" / "helpers" / "trainer_pause.py"), "5", str(marker),
                     *trainer_args(broken, model_folder, cfg, "--offline")], marker, timeout=240)
    ledger = broken / "buffer" / "ledger"
    assert (ledger / "step-000000005-0000.parquet").exists()     # step 5's pull is recorded
    metrics_steps = BufferSQL(broken).query("SELECT step FROM metrics").column("step").to_pylist()
    assert max(metrics_steps) == 4            # killed mid-step 5: pulled, not finished

    with caplog.at_level(logging.INFO, logger="asyncgrpo.trainer"):
        run_trainer(broken, TrainerConfig(**cfg), model_folder=model_folder, offline=True, resume=True)
    assert "trainer at step 3, version 3 (resumed, offline)" in caplog.text
    abandoned = sorted(p.name for p in (ledger / "abandoned").iterdir())
    assert [n.split("-")[-2] for n in abandoned] == ["000000004", "000000005"]

    run_trainer(whole, TrainerConfig(**cfg), model_folder=model_folder, offline=True)
    got, want = _consumed_by_step(broken), _consumed_by_step(whole)
    assert got == want and list(got) == list(range(1, 9))           # steps contiguous, same groups each step
    ids = [g for gs in got.values() for g in gs]
    assert len(ids) == len(set(ids)) == 16                           # none twice, none skipped
    m = BufferSQL(broken).query("SELECT step, count(*) n FROM metrics GROUP BY step ORDER BY step").to_pylist()
    assert m == [{"step": s, "n": 1} for s in range(1, 9)]
    a, b = newest_checkpoint(broken), newest_checkpoint(whole)
    assert a["step"] == b["step"] == 8
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert WeightStore(broken / "weights").latest() == 8
    assert json.loads((WeightStore(broken / "weights").folder(8) / "weights.json").read_text())["step"] == 8
