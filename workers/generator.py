"""The generator daemon: newest weights -> prompts -> G samples each -> rewards -> buffer.

Loop, top to bottom (DESIGN.md, "Generators"):

    wait for <run>/weights/LATEST, load the backend at that version
    repeat until stopped:
        reload the weights when a newer version is published
        admission: wait while admitted groups >= (max_staleness + t + 1) * groups_per_step
        take a batch of prompts from the scheduler
        sample G completions per prompt (behaviour log-probs included)
        score each completion; build the group; append it (the writer computes group
        mean/std, advantages and the filter flag, and flushes shards every N groups / T s)
        record each prompt's pass rate with the scheduler
    on SIGTERM / SIGINT / a time or group limit: flush and return

Every group carries the version of the weights that sampled it. Reward
functions that fail give the configured fallback reward and a recorded error
(`reward_error` column); the generator goes on.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from workers.backends.base import SamplingConfig
from workers.checks import is_int, is_num, require
from workers.model import ModelError
from workers.scheduler import SchedulerConfig

log = logging.getLogger("asyncgrpo.generator")


@dataclass(frozen=True)
class GeneratorConfig:
    """How generators sample, score and append groups."""

    backend: Literal["hf", "vllm"] = "hf"
    """Rollout backend: "hf" (transformers, prefix sharing; the CPU default) or "vllm"."""
    num_generations: int = 8
    """G, completions sampled per prompt (the group size); >= 2, since a group of one has no
    relative advantage."""
    prompts_per_batch: int = 32
    """Prompts sampled together in one backend call (N); each gives one group of G."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Temperature, top-p, top-k and the completion budget."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Which prompts to sample next (difficulty-aware or uniform)."""
    flush_groups: int = 32
    """Write a buffer shard every this many groups (many small files slow SQL; see DESIGN.md)."""
    flush_seconds: float = 5.0
    """... or when the oldest unwritten group has waited this long, whichever comes first."""
    poll_seconds: float = 0.2
    """How often to look for new weights while waiting (for the first weights, or for admission)."""
    num_threads: int | None = None
    """torch CPU threads for this process; None leaves torch's default."""
    max_groups: int | None = None
    """Stop after appending this many groups (None: run until stopped)."""
    log_every_seconds: float = 10.0
    """Seconds between throughput log lines."""

    def __post_init__(self) -> None:
        require(self, "num_generations", is_int(self.num_generations, 2), "an integer >= 2")
        require(self, "prompts_per_batch", is_int(self.prompts_per_batch, 1), "an integer >= 1")
        require(self, "flush_groups", is_int(self.flush_groups, 1), "an integer >= 1")
        require(self, "flush_seconds", is_num(self.flush_seconds, 0, lo_open=True), "a number > 0")
        require(self, "poll_seconds", is_num(self.poll_seconds, 0, lo_open=True), "a number > 0")
        require(self, "num_threads", self.num_threads is None or is_int(self.num_threads, 1),
                "an integer >= 1 or omitted")
        require(self, "max_groups", self.max_groups is None or is_int(self.max_groups, 1),
                "an integer >= 1 or omitted (no limit)")
        require(self, "log_every_seconds", is_num(self.log_every_seconds, 0, lo_open=True), "a number > 0")


@dataclass(frozen=True)
class Admission:
    """The trainer's settings that bound how far generators may run ahead."""

    max_staleness: int | None
    groups_per_step: int


class StopFlag:
    """Set by SIGTERM / SIGINT (or by a caller); checked between batches."""

    def __init__(self, install_signals: bool = True):
        self._event = threading.Event()
        if install_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._event.set())

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)


def run_generator(run_dir: str | os.PathLike, cfg: GeneratorConfig, *, task, scorer,
                  admission: Admission, generator_id: str = "gen0", seed: int = 0,
                  model_dtype: str = "float32", device: str = "cpu",
                  stop: StopFlag | None = None) -> dict:
    """Run the generator loop until stopped; returns totals (groups, filtered, tokens, seconds)."""
    import torch

    from buffer import GroupIndex, ShardWriter, admission_limit
    from workers.backends import make_backend
    from workers.scheduler import PromptScheduler
    from workers.weights import WeightStore

    run = Path(run_dir)
    stop = stop if stop is not None else StopFlag()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    store = WeightStore(run / "weights")
    # vLLM returns tempered log-probs of the untruncated distribution only when asked for all of them.
    options = {"full_vocab_logprobs": cfg.sampling.truncated} if cfg.backend == "vllm" else {}
    backend = None
    while backend is None:
        version = _wait_for_weights(store, cfg, stop)
        if version is None:
            return {"groups": 0, "filtered": 0, "tokens": 0, "seconds": 0.0}
        try:
            backend = make_backend(cfg.backend, store.folder(version), dtype=model_dtype, device=device,
                                   seed=seed, **options)
        except (FileNotFoundError, ModelError):
            if store.folder(version).is_dir():
                raise
            log.info("weights v%d were pruned while loading; reading LATEST again", version)
    log.info("generator %s: loaded weights v%d (%s backend)", generator_id, version, cfg.backend)
    writer = ShardWriter(run / "buffer", generator_id=generator_id, flush_groups=cfg.flush_groups,
                         flush_seconds=cfg.flush_seconds)
    index = GroupIndex(run / "buffer")
    scheduler = PromptScheduler(task.train, cfg.scheduler, seed=seed)
    scheduler.load_history(run / "buffer")
    totals = {"groups": 0, "filtered": 0, "tokens": 0, "reward_errors": 0, "admission_wait_s": 0.0}
    started = last_log = time.time()
    batch_seed = seed * 1_000_003
    try:
        while not stop:
            version = _maybe_reload(store, backend, version, generator_id)
            allowance, waited = _admit(index, writer, admission, store, stop, cfg)
            totals["admission_wait_s"] += waited
            if stop:
                break
            version = _maybe_reload(store, backend, version, generator_id)
            n = cfg.prompts_per_batch if allowance is None else min(cfg.prompts_per_batch, allowance)
            if cfg.max_groups is not None:
                n = min(n, cfg.max_groups - totals["groups"])
            prompts = scheduler.next_batch(n)
            batch_seed += 1
            rollouts = backend.generate([p.text for p in prompts], n=cfg.num_generations,
                                        sampling=cfg.sampling, seed=batch_seed)
            prompt_ids = backend.prompt_token_ids([p.text for p in prompts])
            for p, pids, group_rollouts in zip(prompts, prompt_ids, rollouts):
                group = _score_group(p, pids, group_rollouts, scorer, version, task.name, cfg.sampling)
                writer.append(group)
                correct = [c.correct for c in group.completions if c.correct is not None]
                scheduler.record(p.prompt_id, sum(correct) / len(correct) if correct else None)
                totals["groups"] += 1
                totals["filtered"] += len({c.reward for c in group.completions}) == 1
                totals["tokens"] += sum(len(c.token_ids) for c in group.completions)
                totals["reward_errors"] += sum(c.reward_error is not None for c in group.completions)
            if cfg.max_groups is not None and totals["groups"] >= cfg.max_groups:
                break
            now = time.time()
            if now - last_log >= cfg.log_every_seconds:
                _log_progress(generator_id, version, totals, now - started)
                last_log = now
    finally:
        writer.close()
        backend.close()
    totals["seconds"] = time.time() - started
    _log_progress(generator_id, version, totals, totals["seconds"], final=True)
    return totals


def _wait_for_weights(store, cfg: GeneratorConfig, stop: StopFlag) -> int | None:
    """The newest published version, waiting for the trainer to publish v0 if need be."""
    last_note = 0.0
    while not stop:
        v = store.latest()
        if v is not None:
            return v
        if time.time() - last_note > 10:
            log.info("waiting for the trainer to publish weights in %s", store.root)
            last_note = time.time()
        stop.wait(cfg.poll_seconds)
    return None


def _maybe_reload(store, backend, version: int, generator_id: str) -> int:
    newest = store.latest()
    if newest is None or newest == version:  # != rather than >: a resumed trainer moves LATEST back
        return version
    try:
        backend.load_weights(store.folder(newest))
    except (FileNotFoundError, ModelError):  # pruned between LATEST and the read: the next poll sees a newer one
        if store.folder(newest).is_dir():
            raise
        return version
    log.info("generator %s: reloaded weights v%d -> v%d", generator_id, version, newest)
    return newest


def _admit(index, writer, admission: Admission, store, stop: StopFlag,
           cfg: GeneratorConfig) -> tuple[int | None, float]:
    """Wait until the trainer may use more groups; (groups allowed now or None, seconds waited).

    AReaL's rule (buffer.admission_limit): at trainer version t at most
    (max_staleness + t + 1) * groups_per_step non-filtered groups may have been
    admitted, counting this writer's unflushed groups. t is the newest published
    version. The allowance caps the next batch, so the limit is never overshot
    by this generator (several generators may overshoot by one batch each).
    """
    from buffer import admission_limit

    t0 = time.time()
    while not stop:
        t = store.latest() or 0
        limit = admission_limit(t, admission.max_staleness, admission.groups_per_step)
        if limit is None:
            return None, time.time() - t0
        index.refresh()
        admitted = index.counts(t, admission.max_staleness)["admitted"] + writer.pending_groups
        if admitted < limit:
            return limit - admitted, time.time() - t0
        writer.flush_if_due()
        stop.wait(cfg.poll_seconds)
    return 0, time.time() - t0


def _score_group(prompt, prompt_ids, rollouts, scorer, version: int, task_name: str,
                 sampling: SamplingConfig):
    from buffer import Completion, Group

    completions = []
    for r in rollouts:
        s = scorer.score(prompt, r.text)
        completions.append(Completion(
            text=r.text, token_ids=r.token_ids, logprobs=r.logprobs, reward=s.reward,
            finish_reason=r.finish_reason, reward_components=s.components, correct=s.correct,
            reward_error=s.error))
    return Group(prompt_id=prompt.prompt_id, prompt=prompt.text, prompt_ids=prompt_ids, version=version,
                 completions=completions, task=task_name, temperature=sampling.temperature,
                 top_p=sampling.top_p, top_k=sampling.top_k)


def _log_progress(generator_id: str, version: int, totals: dict, seconds: float, final: bool = False) -> None:
    g = max(totals["groups"], 1)
    log.info("generator %s%s: v%d, %d groups (%.1f/s), %.0f tokens/s, filtered %.0f%%, "
             "reward errors %d, admission wait %.1fs", generator_id, " done" if final else "", version,
             totals["groups"], totals["groups"] / max(seconds, 1e-9), totals["tokens"] / max(seconds, 1e-9),
             100 * totals["filtered"] / g, totals["reward_errors"], totals["admission_wait_s"])
