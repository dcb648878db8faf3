"""The trainer daemon: wait -> pull (recorded in the ledger) -> train -> publish -> metrics -> checkpoint.

    open: newest checkpoint (resume) or model_folder; ledger, weights, metrics and
          checkpoints rolled back to its step; v0 published on a fresh run
    loop: until max_steps, a signal, (offline) no eligible group left, or max_wait_seconds:
        rank 0 waits for groups_per_step eligible groups and pulls them (the pull
          writes the ledger), then broadcasts the rows to the other ranks
        train_step (step.py): advantages per group, inner epochs, optimizer update
        step += 1, version += 1; beta moved by the KL controller
        rank 0: publish every publish_every steps, one metrics row, checkpoint every checkpoint_every
          (under strategy fsdp every rank joins the weight gather and writes its checkpoint shards)
    close (clean exit): publish and checkpoint the last step, flush metrics

A kill -9 loses at most the steps since the last checkpoint: on resume the
sampler moves their ledger records to ledger/abandoned/, their weight folders go
to weights/abandoned/ and their metrics rows are deleted, so they are taken again
on the same groups, and no group is trained on twice or skipped.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from buffer.store import as_path
from workers.proc import poll_delays, rss_mb
from workers.stop import StopFlag
from workers.trainer.batch import step_batch, table_from_bytes, table_to_bytes
from workers.trainer.checkpoint import save_checkpoint, save_sharded_checkpoint
from workers.trainer.config import TrainerConfig
from workers.trainer.control import lr_factor
from workers.trainer.distributed import init_dist
from workers.trainer.fsdp import full_state_dict
from workers.trainer.session import Session, TrainerError, open_session
from workers.trainer.step import train_step

log = logging.getLogger("asyncgrpo.trainer")


def run_trainer(run_dir: str | os.PathLike, cfg: TrainerConfig, *, model_folder: str | os.PathLike,
                resume: bool = False, offline: bool = False) -> None:
    """Run the trainer on the run directory `run_dir` until it stops; see the module doc.

    model_folder: the run's initial model (HF folder): the policy on a fresh run, the
    frozen reference when loss.beta > 0, and the source of the tokenizer files of every
    published version. resume: continue from the newest checkpoint (a fresh start if
    there is none); without it a run that has checkpoints is refused. offline: train on
    the buffer as it is (no staleness limit, reuse passes) and stop when nothing is left.
    Under torchrun every rank calls this; rank 0 alone pulls, publishes and writes.
    """
    dist = init_dist(cfg.device, cfg.strategy)
    stop = StopFlag()
    stop.install()
    s = None
    try:
        s = open_session(as_path(run_dir), cfg, Path(model_folder), resume, offline, dist, stop)
        reason = _loop(s)
        _close(s, reason)
    finally:
        if s is not None and s.publisher is not None:
            try:
                s.publisher.wait()  # never leave a publication half-done behind a crash elsewhere
            except (RuntimeError, OSError):
                log.exception("publishing failed")
        if s is not None and s.sampler is not None:
            s.sampler.close()
        if s is not None and s.metrics is not None:
            s.metrics.flush()
        stop.restore()
        # The session (model, DTensors under FSDP, optimizer state) is freed, reference cycles too, while
        # the process group still exists, so nothing distributed is left to the interpreter's teardown.
        # Hardening, not a proven cause: once, under a loaded test run, a rank of a 2-rank FSDP trainer
        # died at exit with "terminate called without an active exception" after a clean last step.
        s = None
        gc.collect()
        dist.close()


def _loop(s: Session) -> str:
    cfg = s.cfg
    while True:
        if cfg.max_steps is not None and s.step >= cfg.max_steps:
            return "max_steps"
        started = time.time()
        kind, table, pulled, (wait_s, pull_s) = _next_batch(s)
        if kind != "batch":
            return kind
        t0 = time.time()
        batch = step_batch(table, std=cfg.advantage_std, eps=cfg.advantage_eps)
        beta = s.kl.beta
        lr = cfg.lr * lr_factor(cfg, s.step + 1)
        loss_cfg = s.cfg.loss if beta == cfg.loss.beta else replace(cfg.loss, beta=beta)
        metrics, times = train_step(s.model, s.ref_model, s.optimizer, batch, cfg=cfg, loss_cfg=loss_cfg,
                                    dist=s.dist, step=s.step + 1, lr=lr, pad_id=s.pad_id, device=s.device)
        train_s = time.time() - t0
        s.step += 1
        s.version += 1
        s.kl.update(metrics.get("kl/ref"), batch.size)
        published = s.step % cfg.publish_every == 0
        publish_s = _publish(s) if published else 0.0
        if s.dist.is_main:
            row = _row(s, pulled, batch, metrics, times, wait_s=wait_s, pull_s=pull_s, train_s=train_s,
                       publish_s=publish_s, step_s=time.time() - started, lr=lr, beta=beta, published=published)
            s.metrics.add(row)
            _log_step(row)
        if s.step % cfg.checkpoint_every == 0:
            _checkpoint(s)
        # A signal during the step is seen by the next _wait_and_pull, which tells every rank.


def _next_batch(s: Session):
    """(kind, table, sampler Batch (rank 0), (wait_s, pull_s)); kind "batch" or why the loop ends."""
    if not s.dist.is_main:
        while True:
            msg = s.dist.broadcast(None)
            if msg["kind"] != "wait":
                break
        table = table_from_bytes(msg["ipc"]) if msg["kind"] == "batch" else None
        return msg["kind"], table, None, (0.0, 0.0)
    kind, pulled, waited = _wait_and_pull(s)
    msg = {"kind": kind}
    if kind == "batch" and s.dist.enabled:
        msg["ipc"] = table_to_bytes(pulled.table)
    s.dist.broadcast(msg)
    return kind, pulled.table if pulled is not None else None, pulled, waited


def _wait_and_pull(s: Session):
    """Rank 0: pull groups_per_step eligible groups, waiting (visibly) until there are enough.

    Returns (kind, Batch or None, (seconds waited before the pull that succeeded, seconds that pull took)).
    """
    cfg = s.cfg
    max_staleness = None if s.offline else cfg.max_staleness
    started = last_log = time.time()
    delays = poll_delays(cfg.poll_seconds)
    while True:
        if s.stop.requested:
            return "signal", None, (time.time() - started, 0.0)
        pull = dict(trainer_version=s.pull_version, trainer_step=s.step + 1, max_staleness=max_staleness)
        t0 = time.time()
        batch = s.sampler.pull(cfg.groups_per_step, **pull)
        if batch is None and s.offline:
            left = s.sampler.counts(s.pull_version, None, by_version=False)["eligible"]
            if left == 0:
                return "exhausted", None, (time.time() - started, 0.0)
            batch = s.sampler.pull(left, **pull)  # the last, smaller step of the pass (None: retry)
        if batch is not None:
            return "batch", batch, (t0 - started, time.time() - t0)
        now = time.time()
        if cfg.max_wait_seconds is not None and now - started >= cfg.max_wait_seconds:
            log.info("gave up after waiting %.1f s for %d eligible groups (max_wait_seconds)",
                     now - started, cfg.groups_per_step)
            return "gave_up", None, (now - started, 0.0)
        if now - last_log >= cfg.log_wait_seconds:
            c = s.sampler.counts(s.pull_version, max_staleness, by_version=False)
            log.info("step %d (v%d): waiting for %d eligible groups: %d eligible, %d expired, %d filtered, "
                     "%d future, %d consumed; waited %.0f s", s.step + 1, s.version, cfg.groups_per_step,
                     c["eligible"], c["expired"], c["filtered"], c["future"], c["consumed"], now - started)
            last_log = now
        s.dist.broadcast({"kind": "wait"})
        time.sleep(next(delays))


def _publish(s: Session, wait: bool = False) -> float:
    """Every rank: publish the current version (in the background unless `wait`); returns seconds spent.

    Rank 0 writes; under FSDP every rank first takes part in gathering the full weights.
    """
    t0 = time.perf_counter()
    if s.dist.sharded and s.dist.is_main:
        s.publisher.wait()   # the last version's gathered copy is let go of first: one full copy on rank 0
    state = full_state_dict(s.model) if s.dist.sharded else None
    if not s.dist.is_main:
        return 0.0
    gather_s = time.perf_counter() - t0
    return gather_s + s.publisher.publish(state if state is not None else s.model.state_dict(), s.version,
                                          info={"step": s.step}, wait=wait)


def _checkpoint(s: Session) -> None:
    """Every rank: a checkpoint of this step (rank 0 alone writes it, except under strategy fsdp)."""
    if s.dist.is_main:
        s.metrics.flush()  # rows up to this step are on disk before the checkpoint that keeps them
        if s.ckpt_mirror is not None:
            s.ckpt_mirror.wait()   # the last upload reads a checkpoint this save's prune may delete
    t0 = time.time()
    kwargs = dict(step=s.step, version=s.version, model=s.model, optimizer=s.optimizer, kl_state=s.kl.state_dict(),
                  config=s.cfg, keep=s.cfg.keep_checkpoints,
                  extra={"offline_offset": s.offline_offset, "world_size": s.dist.world})
    if s.cfg.strategy == "fsdp":
        path = save_sharded_checkpoint(s.ckpt_dir, dist=s.dist, **kwargs)
    elif s.dist.is_main:
        path = save_checkpoint(s.ckpt_dir, **kwargs)
    s.last_checkpoint = s.step
    if s.dist.is_main:
        log.info("checkpoint %s (%.2f s)", path.name, time.time() - t0)
        if s.ckpt_mirror is not None:   # a run on an object store: to the store too, in the background
            s.ckpt_mirror.upload(path)


def _close(s: Session, reason: str) -> None:
    """Clean exit: the last step's weights and checkpoint on disk, metrics flushed."""
    if s.dist.is_main:
        s.publisher.wait()
    if s.dist.broadcast(s.dist.is_main and not s.weights.folder(s.version).exists()):
        _publish(s, wait=True)
    if s.step > 0 and s.last_checkpoint != s.step:
        _checkpoint(s)
    if s.dist.is_main:
        s.metrics.flush()
        if s.ckpt_mirror is not None:
            s.ckpt_mirror.wait()
        log.info("trainer stopped (%s) at step %d, version %d", reason, s.step, s.version)
    s.dist.barrier()


def _row(s: Session, pulled, batch, m: dict, times, *, wait_s: float, pull_s: float, train_s: float,
         publish_s: float, step_s: float, lr: float, beta: float, published: bool) -> dict:
    """One metrics row: namespaced columns, plain floats and ints."""
    counts = s.sampler.counts(pulled.trainer_version, None if s.offline else s.cfg.max_staleness,
                              by_version=False)
    stale = pulled.staleness.astype(np.float64)
    tokens = int(batch.prompt_lengths.sum() + batch.completion_lengths.sum())
    judged = batch.correct[~np.isnan(batch.correct)]
    row = {
        "step": s.step, "version": s.version, "time": time.time(), "lr": lr, "beta": beta,
        "grad_norm": m.pop("grad_norm"),
        **{k: float(v) for k, v in m.items()},
        "reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std()),
        "reward/max": float(batch.rewards.max()), "reward/min": float(batch.rewards.min()),
        "batch/accuracy": float(judged.mean()) if len(judged) else None,
        "batch/groups": pulled.num_groups, "batch/sequences": batch.size, "batch/tokens": tokens,
        "batch/completion_tokens": int(batch.completion_lengths.sum()),
        "batch/completion_len_mean": float(batch.completion_lengths.mean()),
        "batch/truncated_frac": float(batch.truncated.mean()),
        "staleness/min": float(stale.min()), "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "buffer/groups": counts["groups"], "buffer/eligible": counts["eligible"],
        "buffer/filtered": counts["filtered"], "buffer/expired": counts["expired"],
        "buffer/consumed": counts["consumed"], "buffer/future": counts["future"],
        "buffer/unavailable": counts["unavailable"],
        "perf/tokens_per_s": tokens * s.cfg.num_iterations / train_s if train_s > 0 else None,
        "perf/sequences_per_s": batch.size * s.cfg.num_iterations / train_s if train_s > 0 else None,
        "time/wait_s": wait_s, "time/pull_s": pull_s, "time/train_s": train_s, "time/forward_s": times.forward_s,
        "time/backward_s": times.backward_s, "time/optim_s": times.optim_s, "time/publish_s": publish_s,
        "time/publish_background_s": s.publisher.last_seconds,
        "time/step_s": step_s, "weights/published": int(published), "memory/rss_mb": rss_mb(),
    }
    if s.cfg.kl_control == "adaptive":
        row["kl/beta_next"] = s.kl.beta
    return row


def _log_step(row: dict) -> None:
    acc = row["batch/accuracy"]
    kl = row.get("kl/ref")
    log.info("step %d v%d | loss %.4f | reward %.3f acc %s | kl/ref %s | is/mean %.3f clip %.3f | stale %.1f | "
             "%.2f s (wait %.2f) %.0f tok/s", row["step"], row["version"], row["loss/total"], row["reward/mean"],
             "-" if acc is None else f"{acc:.3f}", "-" if kl is None else f"{kl:.4f}", row["is/mean"],
             row["clip/frac"], row["staleness/mean"], row["time/step_s"], row["time/wait_s"],
             row["perf/tokens_per_s"] or 0.0)


__all__ = ["TrainerError", "run_trainer"]
