"""The generator daemon: newest weights -> prompts -> G samples each -> rewards -> buffer.

Loop, top to bottom (DESIGN.md, "Generators"):

    wait for <run>/weights/LATEST, load the backend at that version
    repeat until stopped:
        reload the weights when a newer version is published
        admission: wait while admitted groups >= (max_staleness + t + 1) * groups_per_step
          (flushing first: the trainer may be waiting for exactly those groups)
        take a batch of prompts from the scheduler
        sample G completions per prompt (behaviour log-probs included)
        score each completion; build the group; append it (the writer computes group
        mean/std, advantages and the filter flag, and flushes shards every N groups / T s)
        record each prompt's pass rate with the scheduler
        one row of timings in <run>/generator_metrics (wait, reload, generate, score)
    on SIGTERM / SIGINT / a time or group limit: flush and return

Every group carries the version of the weights that sampled it. Reward
functions that fail give the configured fallback reward and a recorded error
(`reward_error` column); the generator goes on.

Staleness 0 is lockstep, i.e. synchronous GRPO: the generator samples with
version t only until the trainer has its groups_per_step trainable groups of
version t, then waits for version t + 1. With any staleness limit, a batch is
sized by the measured share of trainable (non-filtered) groups so that one
batch usually fills the admission allowance (which counts trainable groups).
In lockstep, trainable groups beyond the step's need are appended all the same
(nothing generated is dropped) and will expire unused; they are counted as
`surplus_groups`.

Idle time: every batch writes a row to `<run>/generator_metrics/` (SQL view
`generator_metrics`), with `wait_s` (admission, i.e. waiting for the trainer
or, in lockstep, for the next version; the first row also holds the wait for
v0) and `seconds` (the whole iteration), so that

    SELECT generator_id, sum(wait_s) / sum(seconds) AS idle_share FROM generator_metrics GROUP BY 1

is the generator idle share.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from workers.backends.base import SamplingConfig
from workers.checks import is_int, is_num, require
from workers.generator_stats import GeneratorStats
from workers.model import ModelError
from workers.proc import arrow_allocator, poll_delays
from workers.scheduler import SchedulerConfig
from workers.stop import StopFlag

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
    """How often to look for new weights while waiting for the first ones; the longest pause between
    looks while waiting for admission (whose first looks come sooner: 10 ms, doubling up to this);
    how long an admission check's answer may be spent while other generators append (a lone
    generator's: 10 times this)."""
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


def run_generator(run_dir: str | os.PathLike, cfg: GeneratorConfig, *, task, scorer,
                  admission: Admission, generator_id: str = "gen0", seed: int = 0,
                  model_dtype: str = "float32", device: str = "cpu",
                  stop: StopFlag | None = None) -> dict:
    """Run the generator loop until stopped; returns totals (groups, filtered, tokens, seconds).

    Without `stop`, the run catches SIGTERM / SIGINT itself (see workers.stop) and puts the
    previous handlers back when it returns.
    """
    if stop is None:
        with StopFlag() as own:
            return run_generator(run_dir, cfg, task=task, scorer=scorer, admission=admission,
                                 generator_id=generator_id, seed=seed, model_dtype=model_dtype,
                                 device=device, stop=own)
    import torch

    from buffer import GroupIndex, ShardWriter, filter_reason
    from workers.backends import make_backend
    from workers.scheduler import PromptScheduler
    from buffer.store import store_path
    from workers.remote_weights import open_weights

    run = store_path(run_dir)       # a local folder, or a run on an object store (s3://...)
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    store = open_weights(run)       # on an object store: versions downloaded into a local cache
    started = time.time()
    # vLLM returns tempered log-probs of the untruncated distribution only when asked for all of them.
    options = {"full_vocab_logprobs": cfg.sampling.truncated} if cfg.backend == "vllm" else {}
    options["chat"] = task.chat   # prompts through the chat template when task.chat_template is set
    backend, tries = None, 0
    while backend is None:
        version = _wait_for_weights(store, cfg, stop)
        if version is None:
            return {"groups": 0, "filtered": 0, "tokens": 0, "seconds": 0.0}
        waited_for_v0 = time.time() - started
        try:
            backend = make_backend(cfg.backend, store.folder(version), dtype=model_dtype, device=device,
                                   seed=seed, **options)
        except (OSError, ModelError):
            tries += 1
            if not _lost_a_race(store, version) or tries >= 10:  # 10 lost races in a row: not a race
                raise
            log.info("weights v%d were pruned or replaced while loading; reading LATEST again", version)
            stop.wait(cfg.poll_seconds)
    log.info("generator %s: loaded weights v%d (%s backend; Arrow allocator %s)", generator_id, version,
             cfg.backend, arrow_allocator())
    writer = ShardWriter(run / "buffer", generator_id=generator_id, flush_groups=cfg.flush_groups,
                         flush_seconds=cfg.flush_seconds)
    stats = GeneratorStats(run, generator_id, writer.writer_id, cfg.flush_seconds)
    stats.add(batch=0, version=version, started_at=started, wait_s=waited_for_v0,
              reload_s=time.time() - started - waited_for_v0)   # start-up: waiting for v0, loading it
    index = GroupIndex(run / "buffer", retire=True)
    scheduler = PromptScheduler(task.train, cfg.scheduler, seed=seed)
    scheduler.load_history(run / "buffer")
    trainable = TrainableShare()
    gate = AdmissionGate(index, writer, trainable, admission, store, cfg, stats, local=isinstance(run, Path))
    totals = {"groups": 0, "filtered": 0, "tokens": 0, "reward_errors": 0, "admission_wait_s": 0.0,
              "surplus_groups": 0}
    last_log = time.time()
    batch_seed = seed * 1_000_003
    try:
        while not stop:
            t_start = time.time()
            version, reload_s = _timed_reload(store, backend, version, generator_id)
            allowance, waited = gate.wait(stop, version)
            totals["admission_wait_s"] += waited
            if stop:
                stats.add(batch=stats.batches + 1, version=version, started_at=t_start, wait_s=waited,
                          reload_s=reload_s)
                break
            version, reload2_s = _timed_reload(store, backend, version, generator_id)
            n = _batch_size(cfg, allowance, trainable)
            if cfg.max_groups is not None:
                n = min(n, cfg.max_groups - totals["groups"])
            prompts = scheduler.next_batch(n)
            batch_seed += 1
            t_gen = time.time()
            rollouts = backend.generate([p.text for p in prompts], n=cfg.num_generations,
                                        sampling=cfg.sampling, seed=batch_seed)
            prompt_ids = backend.prompt_token_ids([p.text for p in prompts])
            t_score = time.time()
            row = {"prompts": len(prompts), "groups": 0, "filtered": 0, "surplus_groups": 0, "tokens": 0}
            room = allowance if admission.max_staleness == 0 else None  # lockstep: no group can wait
            for p, pids, group_rollouts in zip(prompts, prompt_ids, rollouts):
                group = _score_group(p, pids, group_rollouts, scorer, version, task.name, cfg.sampling)
                filtered = filter_reason([c.reward for c in group.completions],
                                         [c.correct for c in group.completions]) is not None
                correct = [c.correct for c in group.completions if c.correct is not None]
                scheduler.record(p.prompt_id, sum(correct) / len(correct) if correct else None)
                trainable.record(not filtered)
                if not filtered and room is not None:   # beyond the step's need: appended, it will expire
                    row["surplus_groups"] += room <= 0
                    room -= 1
                writer.append(group)
                trainable.appended(not filtered)
                row["groups"] += 1
                row["filtered"] += filtered
                row["tokens"] += sum(len(c.token_ids) for c in group.completions)
                totals["reward_errors"] += sum(c.reward_error is not None for c in group.completions)
            for k in ("groups", "filtered", "tokens", "surplus_groups"):
                totals[k] += row[k]
            now = time.time()
            stats.add(batch=stats.batches + 1, version=version, started_at=t_start, wait_s=waited,
                      reload_s=reload_s + reload2_s, generate_s=t_score - t_gen, score_s=now - t_score, **row)
            if cfg.max_groups is not None and totals["groups"] >= cfg.max_groups:
                break
            if now - last_log >= cfg.log_every_seconds:
                _log_progress(generator_id, version, totals, now - started)
                last_log = now
    finally:
        writer.close()
        stats.close()
        backend.close()
    totals["seconds"] = time.time() - started
    _log_progress(generator_id, version, totals, totals["seconds"], final=True)
    return totals


class TrainableShare:
    """This generator's recent share of trainable (non-filtered) groups, and its unflushed ones.

    The share sizes lockstep batches; the pending flags make the admission count
    exact without reading the writer's unflushed groups.
    """

    def __init__(self, window: int = 256):
        self.recent: deque[bool] = deque(maxlen=window)
        self.pending: deque[bool] = deque(maxlen=100_000)   # appended groups, newest last
        self.appended_trainable = 0                        # trainable groups appended so far

    def record(self, trainable: bool) -> None:
        self.recent.append(trainable)

    def appended(self, trainable: bool) -> None:
        self.pending.append(trainable)
        self.appended_trainable += trainable

    def share(self) -> float:
        """Share of trainable groups among recent ones; 1.0 before any (no over-sampling yet)."""
        return sum(self.recent) / len(self.recent) if self.recent else 1.0

    def pending_trainable(self, pending_groups: int) -> int:
        """Trainable groups among the writer's `pending_groups` unflushed ones (the newest appended)."""
        while len(self.pending) > pending_groups:
            self.pending.popleft()
        return sum(self.pending)


def _batch_size(cfg: GeneratorConfig, allowance: int | None,
                trainable: TrainableShare) -> int:
    """Prompts in the next batch.

    Unlimited staleness: prompts_per_batch. With a limit, the allowance counts trainable
    groups, so the batch is sized to fill it in one go: allowance / (recent trainable
    share, floored at 1/8), at most prompts_per_batch. Capping the batch at the allowance
    itself (as before) made the batches shrink geometrically once most groups were
    filtered (a 32-group allowance at a 30% trainable share took batches of about 32, 22,
    16, 11, ... prompts), so each batch's fixed cost (admission, reload check, shard
    flush) was paid ever more often per trainable group. The limit may be overshot by
    the share's error, a few groups: at staleness > 0 they queue, and some expire (1.6%
    of the trainable groups of a 60-minute soak, none before); at 0 (lockstep) they are
    counted as surplus.
    """
    if allowance is None:
        return cfg.prompts_per_batch
    return min(cfg.prompts_per_batch, math.ceil(allowance / max(trainable.share(), 0.125)))


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


def _lost_a_race(store, version: int) -> bool:
    """Whether loading `version` failed because the trainer moved its folder meanwhile (pruned, or
    abandoned by a resume and perhaps published again, whole) rather than because it is damaged."""
    return not store.folder(version).is_dir() or store.is_complete(version)


def _maybe_reload(store, backend, version: int, generator_id: str) -> int:
    newest = store.latest()
    if newest is None or newest == version:  # != rather than >: a resumed trainer moves LATEST back
        return version
    try:
        backend.load_weights(store.folder(newest))
    except (OSError, ModelError):
        if not _lost_a_race(store, newest):
            raise
        return version  # the next poll reads LATEST again
    log.info("generator %s: reloaded weights v%d -> v%d", generator_id, version, newest)
    return newest


def _timed_reload(store, backend, version: int, generator_id: str) -> tuple[int, float]:
    t0 = time.time()
    new = _maybe_reload(store, backend, version, generator_id)
    return new, (time.time() - t0 if new != version else 0.0)


class AdmissionGate:
    """Whether this generator may start a batch now, and how many trainable groups it may add.

    AReaL's rule (buffer.admission_limit): at trainer version t at most
    (max_staleness + t + 1) * groups_per_step groups may have been admitted, where
    admitted counts only groups that are or can still be trained on: consumed,
    eligible or waiting, i.e. neither filtered (they never will be) nor expired
    (they never will be again), plus this writer's unflushed trainable groups.
    t is the newest published version. Counting filtered groups would shrink the
    allowance to a few prompts per batch when many groups are filtered; counting
    expired ones would leave a step short for ever once any group expired. Before
    waiting, unflushed groups are written: the trainer may be waiting for them.

    A check refreshes the group index: 9 ms a batch (median) late in a 60-minute run on
    2 cores, a tenth of its ~92 ms batches. So a check's answer is spent by the batches
    that follow it: while what is left of it (its allowance, plus what newer versions
    added to the limit, less the trainable groups appended since) still fills a whole
    batch, a batch starts without a check. With one writer that changes nothing: only
    its own appends lower the allowance, a newer version raises the limit by
    groups_per_step a version, and expiry lowers the count, so a check would have sized
    the batch alike or larger. Other writers' groups appended meanwhile go unseen, as two
    writers that check at once miss each other's, so a grant lives at most poll_seconds
    while another writer's new groups have been seen in the last OTHERS_WINDOW_S seconds
    (at the first check, any other writer's groups count as new), and LONE_GRANT_POLLS
    times longer otherwise: late in a 60-minute soak, checks every poll_seconds took 4%
    of the lone generator's time, at the moments it was behind the trainer (4.5-5.0%
    against 1.7% with the longer grant, in two A/B pairs at the end of a 90-minute soak).
    A LATEST that moved back (a resumed trainer) ends a grant. Lockstep (max_staleness 0)
    checks before every batch.

    While the limit is reached, only LATEST is read (every 10 ms, doubling up to 50 ms on
    a local run; up to poll_seconds on an object store), with a check when it names a new
    version and at least every poll_seconds otherwise: until the trainer publishes, the
    count can fall only in rare cases (a shard in flight counted twice, a quarantined
    shard). Looking at LATEST that often rather than checking every poll_seconds is what
    lets the generator start its next batch soon after a publish.
    """

    LONE_GRANT_POLLS = 10      # a grant lives this many poll_seconds while no other writer appends
    OTHERS_WINDOW_S = 60.0     # another writer's new groups seen this recently: grants live poll_seconds

    def __init__(self, index, writer, trainable: TrainableShare, admission: Admission, store,
                 cfg: GeneratorConfig, stats: GeneratorStats, *, local: bool = True):
        from buffer.index import writer_seqs

        self.index, self.writer, self.trainable, self.admission = index, writer, trainable, admission
        self.store, self.cfg, self.stats = store, cfg, stats
        self.look_seconds = min(cfg.poll_seconds, 0.05) if local else cfg.poll_seconds
        self.checks = 0                                # index refreshes so far
        # (allowance, appended trainable, monotonic time, version) of the last check that allowed groups
        self._grant: tuple[int, int, float, int] | None = None
        self._mine = int(writer_seqs([f"{writer.writer_id}-0"])[0][0])   # this writer's number
        self._tops: dict[int, int] = {}               # writer number -> highest sequence seen by a check
        self._others_at: float | None = None          # monotonic time a check last saw another writer's new groups

    def wait(self, stop: StopFlag, version: int | None = None) -> tuple[int | None, float]:
        """Wait until the trainer may use more groups; (trainable groups allowed now or None, seconds waited).

        `version`: the newest published version the caller knows (it just read LATEST); None reads it.
        """
        from buffer import admission_limit

        left = self._spend(self.store.latest() or 0 if version is None else version)
        if left is not None:
            return left, 0.0
        t0 = time.time()
        delays = poll_delays(self.look_seconds)
        checked: tuple[int, float] | None = None      # (version, monotonic time) of the last check
        while not stop:
            t = self.store.latest() or 0
            limit = admission_limit(t, self.admission.max_staleness, self.admission.groups_per_step)
            if limit is None:
                return None, time.time() - t0
            if checked is None or checked[0] != t or time.monotonic() - checked[1] >= self.cfg.poll_seconds:
                allowance = limit - self._admitted(t)
                checked = (t, time.monotonic())
                if allowance > 0:
                    if self.admission.max_staleness:
                        self._grant = (allowance, self.trainable.appended_trainable, checked[1], t)
                    return allowance, time.time() - t0
                if self.writer.pending_groups:
                    self.writer.flush()
                self.stats.flush_if_due()
            stop.wait(next(delays))
        return 0, time.time() - t0

    def _spend(self, t: int) -> int | None:
        """What is left of the last check's allowance at version t, if it still fills a whole batch and is fresh."""
        from buffer import admission_limit

        if self._grant is None:
            return None
        allowance, appended, at, checked_t = self._grant
        now = time.monotonic()
        alone = self._others_at is None or now - self._others_at >= self.OTHERS_WINDOW_S
        life = self.cfg.poll_seconds * (self.LONE_GRANT_POLLS if alone else 1)
        if t < checked_t or now - at >= life:   # LATEST moved back (a resume), or the grant is old
            self._grant = None
            return None
        raised = (admission_limit(t, self.admission.max_staleness, self.admission.groups_per_step)
                  - admission_limit(checked_t, self.admission.max_staleness, self.admission.groups_per_step))
        left = allowance + raised - (self.trainable.appended_trainable - appended)
        if _batch_size(self.cfg, left, self.trainable) < self.cfg.prompts_per_batch:
            self._grant = None
            return None
        return left

    def _admitted(self, t: int) -> int:
        # Shards in flight are counted with the unflushed groups, before the index looks: one made
        # visible in between is counted twice (admission errs on the safe side), none is missed.
        # Waiting for them instead (writer.wait) put each shard's encode, fsync and rename on the
        # generator's path: the check took 10.5 ms a batch against 5.8 ms (medians, 2 cores, on the
        # buffer of a 60-minute run; the rest is the index's refresh), with batches of ~85 ms.
        self.writer.reap()
        pending = self.trainable.pending_trainable(self.writer.pending_groups)
        self.index.refresh()
        self.checks += 1
        for w, q in self.index.last_tops().items():   # another writer's new groups: grants stay short
            if q > self._tops.get(w, -1):
                self._tops[w] = q
                if w != self._mine:
                    self._others_at = time.monotonic()
        counts = self.index.counts(t, self.admission.max_staleness, by_version=False)
        return counts["admitted"] - counts["expired"] - counts["unavailable"] + pending


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
             "reward errors %d, admission wait %.1fs (%.0f%% idle), surplus %d", generator_id, " done" if final else "",
             version, totals["groups"], totals["groups"] / max(seconds, 1e-9), totals["tokens"] / max(seconds, 1e-9),
             100 * totals["filtered"] / g, totals["reward_errors"], totals["admission_wait_s"],
             100 * totals["admission_wait_s"] / max(seconds, 1e-9), totals["surplus_groups"])
