"""The compactor daemon: merges a run's sealed small files while the run goes on.

Generators flush a shard every `generator.flush_groups` groups, the trainer
writes a ledger file per pull and a metrics file every few seconds, the
generators a metrics file each; a run of hours leaves tens of thousands of
small files, and every SQL query, `status` and trainer restart pays per file.
The compactor keeps the live file count bounded:

    until SIGTERM / SIGINT:
        compact_run(run, cfg):
            buffer.compact: rollout shards older than min_age_s (sealed) and smaller
                than target_groups become c-files of about target_groups groups (younger
                ones too, all but the newest max_unmerged // 2); fanout c-files of a level
                become one of the next, up to max_file_mb a file (and max_groups groups; by
                default only with retention): planned here, written on the LevelMerges
                thread (local runs), whose lock is taken only to swap each file in
            buffer.compact_ledger: ledger files become merged files of about
                target_rows records, in step order
            retention (only with keep_versions set): live shards whose groups are all
                more than keep_versions versions old leave the hot buffer, archived
                or deleted (buffer/retention.py)
            metrics/ and generator_metrics/: likewise, target_rows rows a file
            in each: files replaced more than grace_s ago are deleted (readers
                that listed them can still read them until then)
        DiskWatch: warn when the run directory nears disk_budget_gb, or its disk
            has less than min_free_gb free (each at most every 10 minutes)
        on an object store, at most every hour: abort the run's multipart uploads
            older than STALE_UPLOAD_S (a process killed inside a large upload
            leaves its parts stored and billed under no name)
        wait every_s, or until a set will hold more than max_unmerged files not yet
            merged by the time a pass ends (counted every second, looking ahead by
            their arrival rate times the last pass's length: EarlyTrigger)

Each set works under its lock and through its manifest (buffer/fileset.py),
so the generators, the trainer and SQL readers never fail or count a row
twice, the trainer never waits on it, and a kill -9 in the middle of a pass
leaves every set as it was or as it will be. `asyncgrpo run` starts one compactor beside the
trainer and generators when `compactor.every_s` is set (the default);
`asyncgrpo compactor --run DIR` runs it alone, for a run whose daemons are on
several machines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import buffer
from buffer.layout import run_file_set
from buffer.retention import ACTIONS, RetentionReport, newest_trainer_version, retire_old_shards
from buffer.store import RemotePath, as_path
from workers.checks import is_int, is_num, require
from workers.proc import arrow_allocator, rss_mb
from workers.remote_weights import work_dir
from workers.stop import StopFlag

if TYPE_CHECKING:
    from buffer.fileset import FileSet

log = logging.getLogger("asyncgrpo.compactor")


@dataclass(frozen=True)
class CompactorConfig:
    """When and how the run's buffer is compacted in the background; validated on construction."""

    every_s: float | None = 30.0
    """Seconds between compaction passes; None: `asyncgrpo run` starts no compactor (compact by hand
    with `asyncgrpo compact`)."""
    min_age_s: float = 30.0
    """A shard is merged only when it is at least this old (sealed: its writer is done with it), >= 0."""
    grace_s: float = 120.0
    """Merged-away shards stay on disk this long for readers that listed them before, >= 0."""
    target_groups: int = 4096
    """Groups per merged shard (c-file), >= 2."""
    fanout: int | None = 4
    """Level merges of rollout shards: this many c-files of one level (target_groups * fanout^(k-1) to
    target_groups * fanout^k groups) become one of the next, up to max_groups groups and max_file_mb a
    file, so a long run keeps few large c-files (SQL and `status` pay per file and per row group) and
    rewrites each group about once per level; >= 2, or none (c-files stay at about target_groups)."""
    max_groups: int | None = None
    """Largest c-file a level merge writes, in groups, >= target_groups. None: 65,536 with keep_versions
    (retention retires whole files, so this bounds how far the hot buffer exceeds keep_versions), else
    no limit but max_file_mb, so the c-file count grows with the log of the run's groups, not with
    them (at 65,536 a file, a run of days would keep one more file per 65,536 groups)."""
    max_file_mb: float | None = 256.0
    """Largest c-file a level merge writes, in MiB (its sources' sizes summed), > 0. It bounds a
    pass: a level merge decodes and re-encodes its rows (row groups of 4 MiB), 5-9 MB a second on 2
    cores (a 139 MiB file took a 15.6 s pass in the synthetic soak), and meanwhile the compactor
    merges nothing else and holds the buffer's lock (which a starting generator takes for its
    writer id). None: no limit."""
    target_rows: int = 262_144
    """Rows per merged ledger, metrics or generator-metrics file, >= 2."""
    keep_versions: int | None = None
    """Retention: rollout shards all of whose groups are more than this many versions behind the
    trainer leave the hot buffer each pass (see `retention`); only whole files leave. At least
    trainer.max_staleness (which must be set), so no group that may still be pulled leaves. The
    trainer's version is its newest in the ledger capped at its oldest checkpoint's step, so a resumed
    trainer finds every group (nothing leaves before the first checkpoint). None: keep everything."""
    retention: Literal["archive", "delete"] = "archive"
    """What happens to the shards keep_versions retires: "archive" moves them to
    <buffer>/archive/shards/ (SQL view `archived_rollouts`; archive/ may be a symlink to another
    disk), "delete" removes them (after grace_s)."""
    disk_budget_gb: float | None = None
    """Warn (at most every 10 minutes) when the run directory holds more than 90% of this many GB
    (10^9 bytes; a symlinked archive/ on another disk is not counted), > 0. None: no budget."""
    min_free_gb: float | None = 1.0
    """Warn (at most every 10 minutes) when the run directory's filesystem has less than this many GB
    free, > 0. None: no check."""
    max_unmerged: int | None = 256
    """Most files a set (rollout shards, ledger, metrics, generator metrics) holds unmerged, as their
    writers left them, before the compactor merges early: every pass merges a set's unmerged files
    whatever their age when it holds more than max_unmerged // 2, all but the newest max_unmerged // 2;
    between passes the daemon counts them every second (a listing, no file read; every 5 s on an object
    store), and when a set holds more than this, and max_unmerged // 2 more than after the last pass, a
    pass starts at once. Without it the unmerged files number the writers' output over min_age_s +
    every_s, so the live files grow with the output (a 60-minute soak's peaks rose 4-6 files a minute
    as the generator sped up); with it they stay under about this many a set, whatever the writers'
    rate. >= 2, or none (min_age_s and every_s alone decide)."""
    nice: int = 10
    """How much lower the compactor daemon's CPU priority is than the other daemons' (added to its
    niceness, Unix; 0-19): on cores the trainer and generators keep busy, its merges then run in
    their gaps rather than taking turns with them. 0: the same priority."""

    @property
    def level_max_groups(self) -> int | None:
        """max_groups, with its default filled in (see there)."""
        if self.max_groups is None and self.keep_versions is not None:
            from buffer.compaction import LEVEL_MAX_GROUPS   # lazily: --help loads no pyarrow
            return max(LEVEL_MAX_GROUPS, self.target_groups)
        return self.max_groups

    @property
    def level_max_bytes(self) -> int | None:
        return None if self.max_file_mb is None else int(self.max_file_mb * (1 << 20))

    def __post_init__(self) -> None:
        require(self, "every_s", self.every_s is None or is_num(self.every_s, 0, lo_open=True),
                "a number of seconds > 0, or none (no compactor)")
        require(self, "min_age_s", is_num(self.min_age_s, 0), "a number of seconds >= 0")
        require(self, "grace_s", is_num(self.grace_s, 0), "a number of seconds >= 0")
        require(self, "target_groups", is_int(self.target_groups, 2), "an integer >= 2")
        require(self, "fanout", self.fanout is None or is_int(self.fanout, 2), "an integer >= 2, or none (no levels)")
        require(self, "max_groups", self.max_groups is None or (is_int(self.max_groups, 2)
                                                                and self.max_groups >= self.target_groups),
                f"an integer >= compactor.target_groups ({self.target_groups}), or none")
        require(self, "max_file_mb", self.max_file_mb is None or is_num(self.max_file_mb, 0, lo_open=True),
                "a number of MiB > 0, or none (no limit)")
        require(self, "target_rows", is_int(self.target_rows, 2), "an integer >= 2")
        require(self, "keep_versions", self.keep_versions is None or is_int(self.keep_versions, 0),
                "an integer >= 0 (at least trainer.max_staleness), or none (keep everything)")
        require(self, "retention", self.retention in ACTIONS, "'archive' or 'delete'")
        require(self, "max_unmerged", self.max_unmerged is None or is_int(self.max_unmerged, 2),
                "an integer >= 2, or none (no early merges)")
        require(self, "nice", is_int(self.nice, 0, 19), "an integer from 0 to 19")
        require(self, "disk_budget_gb", self.disk_budget_gb is None or is_num(self.disk_budget_gb, 0, lo_open=True),
                "a number of GB > 0, or none (no budget)")
        require(self, "min_free_gb", self.min_free_gb is None or is_num(self.min_free_gb, 0, lo_open=True),
                "a number of GB > 0, or none (no check)")


KINDS = ("shards", "ledger", "metrics", "generator_metrics")
GB = 1e9
DISK_WARN_EVERY_S = 600.0      # each disk warning at most this often
BUDGET_SHARE = 0.9             # warn above this share of compactor.disk_budget_gb
SWEEP_EVERY_S = 3600.0         # abort_stale_uploads at most this often
COUNT_EVERY_S = 1.0            # the daemon counts unmerged files this often between passes (max_unmerged)
COUNT_EVERY_REMOTE_S = 5.0     # on an object store (each count lists four prefixes and reads their manifests)
RATE_MIN_S = 2.0               # EarlyTrigger measures the files' arrival rate over at least this long
STALE_UPLOAD_S = 6 * 3600.0
"""A multipart upload older than this was left by a killed process: the largest upload of a run (a
c-file, a model's weights) takes minutes, and one in progress must never be aborted."""
_CHECKPOINT = re.compile(r"^step-(\d+)\.(pt|dcp)$")   # workers/trainer/checkpoint.py's names (it imports torch)


def compact_run(run_dir: str | os.PathLike, cfg: CompactorConfig, *, defer_levels: bool = False) -> dict:
    """One pass over every file set of the run that exists yet; a CompactionReport per kind (KINDS).
    With `defer_levels`, the rollout shards' level merges are planned, not written (their report's
    `levels`, for buffer.merge_levels: LevelMerges).

    With cfg.keep_versions set, also a RetentionReport ("retention"): of a retention pass before
    the merges and one after (so that merged c-files old enough leave too), summed.
    """
    run = as_path(run_dir)
    root = run / "buffer"
    out = {}
    ages = dict(min_age_s=cfg.min_age_s, grace_s=cfg.grace_s, max_unmerged=cfg.max_unmerged)
    if buffer.BufferDir.is_buffer(root):    # the first generator flush creates it
        # With retention, files old enough leave before the merges too: a level merge would otherwise
        # put them in one file with newer groups, which keeps them all until the newest is old enough.
        before = retire(run, cfg) if cfg.keep_versions is not None else None
        out["shards"] = buffer.compact(root, target_groups=cfg.target_groups, fanout=cfg.fanout,
                                       max_groups=cfg.level_max_groups, max_bytes=cfg.level_max_bytes,
                                       defer_levels=defer_levels, **ages)
        out["ledger"] = buffer.compact_ledger(root, target_rows=cfg.target_rows, **ages)
        if before is not None:
            after = retire(run, cfg)
            out["retention"] = dataclasses.replace(after, files=before.files + after.files,
                                                   groups=before.groups + after.groups,
                                                   deleted_files=before.deleted_files + after.deleted_files)
    if (run / "metrics").is_dir():
        out["metrics"] = buffer.compact_small(run_file_set(run / "metrics", "metrics"), target_rows=cfg.target_rows,
                                              sort_by="step", **ages)
    if (run / "generator_metrics").is_dir():
        out["generator_metrics"] = buffer.compact_small(run_file_set(run / "generator_metrics", "generator_metrics"),
                                                        target_rows=cfg.target_rows, **ages)
    return out


def oldest_checkpoint_step(run_dir: str | os.PathLike) -> int | None:
    """Step of the oldest trainer checkpoint in <run>/checkpoints/ (names only); None without one. For a
    run on an object store, of those on this machine and those on the store (a resume may take either)."""
    run = as_path(run_dir)
    try:
        names = os.listdir(work_dir(run) / "checkpoints")
    except FileNotFoundError:
        names = []
    steps = [int(m.group(1)) for n in names if (m := _CHECKPOINT.match(n))]
    if isinstance(run, RemotePath):
        from workers.trainer.checkpoint import RemoteCheckpoints

        steps += [step for step, _ in RemoteCheckpoints(run).steps()]
    return min(steps, default=None)


def retention_version(run_dir: str | os.PathLike) -> int | None:
    """The trainer version retention measures against: the newest in the ledger, but no newer than the
    oldest checkpoint's step; None (retire nothing) without a ledger or a checkpoint.

    A resumed trainer starts at one of the checkpoints on disk, at a version >= its step (the
    version moves by one per step, offline training adds an offset), so a group it may pull
    is never retired.
    """
    step = oldest_checkpoint_step(run_dir)
    if step is None:
        return None
    newest = newest_trainer_version(as_path(run_dir) / "buffer")
    return None if newest is None else min(newest, step)


def retire(run_dir: str | os.PathLike, cfg: CompactorConfig) -> RetentionReport:
    """Retention's pass over the run's buffer (cfg.keep_versions must be set); see buffer/retention.py."""
    root = as_path(run_dir) / "buffer"
    version = retention_version(run_dir)
    if version is None:   # no trainer state yet: nothing is known to be too old
        return RetentionReport(cfg.retention)
    return retire_old_shards(root, keep_versions=cfg.keep_versions, action=cfg.retention, grace_s=cfg.grace_s,
                             trainer_version=version)


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under `path`, each inode once (hard links), symlinks not followed."""
    total, seen = 0, set()
    stack = [Path(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
            except FileNotFoundError:
                continue   # deleted meanwhile (compaction's grace deletions)
    return total


class DiskWatch:
    """The compactor's disk warnings: the run directory over BUDGET_SHARE of compactor.disk_budget_gb,
    or its filesystem's free space under compactor.min_free_gb; each kind at most once every `every_s`.

    A run of days fills a disk slowly and then fails at once (a generator's flush, the trainer's
    checkpoint); the warning comes while there is time to act: turn on retention, archive to a
    bigger disk, or free space.
    """

    def __init__(self, every_s: float = DISK_WARN_EVERY_S):
        self.every_s = every_s
        self._last: dict[str, float] = {}     # kind ("budget", "free") -> when it was last logged

    def _due(self, kind: str, now: float) -> bool:
        last = self._last.get(kind)
        return last is None or now - last >= self.every_s

    def check(self, run_dir: str | os.PathLike, cfg: CompactorConfig, now: float | None = None) -> list[str]:
        """Log (log.warning) and return the warnings due now."""
        now = time.time() if now is None else now
        out = []
        if isinstance(as_path(run_dir), RemotePath):
            return []   # an object store has no disk to fill: budgets are for local disks
        if cfg.disk_budget_gb is not None and self._due("budget", now):
            used = dir_bytes(run_dir)
            if used > BUDGET_SHARE * cfg.disk_budget_gb * GB:
                out.append(("budget", f"run directory {run_dir} holds {used / GB:.2f} GB, over "
                            f"{BUDGET_SHARE:.0%} of compactor.disk_budget_gb = {cfg.disk_budget_gb:g}; "
                            + _advice(cfg)))
        if cfg.min_free_gb is not None and self._due("free", now):
            try:
                free = shutil.disk_usage(run_dir).free
            except FileNotFoundError:
                free = None
            if free is not None and free < cfg.min_free_gb * GB:
                out.append(("free", f"only {free / GB:.2f} GB free on the filesystem of {run_dir}, under "
                            f"compactor.min_free_gb = {cfg.min_free_gb:g}; " + _advice(cfg)))
        for kind, msg in out:
            self._last[kind] = now
            log.warning("%s", msg)
        return [msg for _, msg in out]


def _advice(cfg: CompactorConfig) -> str:
    if cfg.keep_versions is None:
        return ("set compactor.keep_versions (retention: old shards leave the hot buffer) and "
                "compactor.retention = 'delete' or an archive/ on another disk, or free space")
    if cfg.retention == "archive":
        return ("the archive grows: make <buffer>/archive a symlink to a bigger disk, set "
                "compactor.retention = 'delete', or free space")
    return "lower compactor.keep_versions, or free space"


def abort_stale_uploads(run_dir: str | os.PathLike, older_than_s: float | None = None) -> list[str]:
    """Abort the run's incomplete multipart uploads older than `older_than_s` (default STALE_UPLOAD_S);
    the keys they were for. A local run has none."""
    run = as_path(run_dir)
    if not isinstance(run, RemotePath):
        return []
    aborted = run.store.abort_incomplete_uploads(STALE_UPLOAD_S if older_than_s is None else older_than_s)
    if aborted:
        log.info("aborted %d incomplete multipart uploads left by killed processes: %s", len(aborted),
                 ", ".join(aborted[:5]) + (" ..." if len(aborted) > 5 else ""))
    return aborted


def run_file_sets(run_dir: str | os.PathLike) -> dict[str, "FileSet"]:
    """The file sets of a run that exist yet, by kind (KINDS)."""
    run = as_path(run_dir)
    out = {}
    if buffer.BufferDir.is_buffer(run / "buffer"):
        d = buffer.BufferDir(run / "buffer")
        out["shards"], out["ledger"] = d.shard_set, d.ledger_set
    for kind in ("metrics", "generator_metrics"):
        if (run / kind).is_dir():
            out[kind] = run_file_set(run / kind, kind)
    return out


def live_files(run_dir: str | os.PathLike) -> dict[str, int]:
    """Live files of each kind (KINDS) in a run: what every reader lists."""
    sets = run_file_sets(run_dir)
    return {k: len(sets[k].live_names()) if k in sets else 0 for k in KINDS}


def unmerged_names(run_dir: str | os.PathLike) -> dict[str, set[str]]:
    """Names of the live files of each kind (KINDS) in a run that are not merged yet (as their writers
    left them)."""
    sets = run_file_sets(run_dir)
    return {k: {n for n in sets[k].live_names() if not sets[k].is_compacted(n)} if k in sets else set()
            for k in KINDS}


def unmerged_files(run_dir: str | os.PathLike) -> dict[str, int]:
    """How many unmerged_names of each kind."""
    return {k: len(v) for k, v in unmerged_names(run_dir).items()}


class EarlyTrigger:
    """When the compactor daemon's next pass starts: `every_s` after the last, or at once when a set
    will hold more than `max_unmerged` unmerged files by the time a pass started now would have merged
    them (its count now, plus its files' arrival rate since the last pass times the last pass's length
    and one count's interval), and max_unmerged // 2 more than the last pass saw and left (so files a
    pass cannot merge, such as writer shards of target_groups or more, do not start one pass after
    another). The look-ahead is at most max_unmerged // 4 files (a burst of files measured as a rate,
    or a slow pass, would otherwise start passes that merge next to nothing). Counts every
    `count_every_s`.

    Without the look-ahead the files that arrive while a pass runs came on top of max_unmerged, and a
    pass's length grows with the CPU the other daemons leave the compactor; with the files that
    arrived during the pass counted in the hysteresis too, each pass started later still: a 60-minute
    soak's peaks rose with the generator's rate and the passes' length (+0.65 files a minute over its
    last half hour, passes from 1.0 to 3.2 s long).
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: CompactorConfig, *, clock=time.monotonic):
        self.run_dir, self.cfg, self.clock = run_dir, cfg, clock
        self.count_every_s = COUNT_EVERY_REMOTE_S if isinstance(as_path(run_dir), RemotePath) else COUNT_EVERY_S
        self.after_pass: dict[str, int] = dict.fromkeys(KINDS, 0)   # what the last pass saw and left
        self.pass_s = 0.0                                          # how long the last pass took
        self._seen: dict[str, set[str]] | None = None              # unmerged names when the pass began
        self._base: tuple[float, dict[str, int]] | None = None     # when the last pass ended, the counts then
        self._rate: dict[str, float] = dict.fromkeys(KINDS, 0.0)   # files a second since then

    def starting(self) -> None:
        """Call before each pass: the files it will see."""
        if self.cfg.max_unmerged is not None:
            self._seen = unmerged_names(self.run_dir)

    def passed(self, took: float = 0.0) -> None:
        """Call after each pass (`took` seconds): the files it saw and left, which the next trigger must
        exceed by max_unmerged // 2 (all it left, without a starting() call), and the base of the rate."""
        if self.cfg.max_unmerged is None:
            return
        names = unmerged_names(self.run_dir)
        seen = self._seen
        self.after_pass = {k: len(v & seen[k]) if seen is not None else len(v) for k, v in names.items()}
        self._seen = None
        self.pass_s = took
        self._base = (self.clock(), {k: len(v) for k, v in names.items()})

    def over(self) -> list[str]:
        """The kinds whose unmerged files call for a pass now."""
        m = self.cfg.max_unmerged
        if m is None:
            return []
        now = unmerged_files(self.run_dir)
        elapsed = None if self._base is None else self.clock() - self._base[0]
        if elapsed is not None and elapsed >= RATE_MIN_S:
            self._rate = {k: max(0, n - self._base[1].get(k, 0)) / elapsed for k, n in now.items()}
        lag = self.pass_s + self.count_every_s if self.pass_s > 0 else 0.0
        out = []
        for k, n in now.items():
            ahead = n + min(self._rate.get(k, 0.0) * lag, m // 4)   # a burst is no rate: a pass merges >= m / 4
            if ahead > m and ahead >= self.after_pass[k] + m // 2:
                out.append(k)
        return out

    def wait(self, stop: StopFlag) -> list[str]:
        """Wait for the next pass; the kinds that started it early ([] when every_s ran out or on stop)."""
        deadline = time.monotonic() + self.cfg.every_s
        while not stop:
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            if self.cfg.max_unmerged is None:
                stop.wait(left)
                continue
            stop.wait(min(self.count_every_s, left))
            if stop:
                break
            try:
                kinds = self.over()
            except Exception as e:  # noqa: BLE001 - a count only hastens a pass: every_s still starts the next
                log.debug("could not count unmerged files of %s: %s", self.run_dir, e)
                continue
            if kinds:
                return kinds
        return []


class LevelMerges:
    """The compactor daemon's level merges, on a thread of their own (local runs).

    A level merge re-encodes up to compactor.max_file_mb (a 139 MiB one took 15.6 s on 2 cores), and
    the writers' files kept coming meanwhile, unmerged, since the pass held the buffer's lock and
    merged nothing else: the live file count's peaks followed the level merges. Now each pass plans
    the level merges (compact_run with defer_levels) and, when no level merge is running, hands them
    to this thread (buffer.merge_levels: the lock only for each file's swap); the next passes' base
    merges go on meanwhile. On an object store the pass merges levels itself, as before: there the
    lock is a lease of the process, which two of its threads cannot take from each other.

    While a pass runs (`yielding`), the level merge waits at its next source row group (holding no
    lock) and goes on when the pass ends: the daemon takes one core, as when the pass merged levels
    itself, not two beside the trainer and generators. With both at once, the synthetic soak's pull
    p99 rose 43 -> 71 ms over its tenths (bccfdac), where it stayed flat at 082fc2a on the same host;
    with the pause it went 40.8 -> 48.2 ms (1.18x, 9e6b4a4; README, "Where the targets stand").
    10,000-step runs do not show it: their level merges are small.
    """

    def __init__(self, run_dir: str | os.PathLike, stop: StopFlag):
        self.root = as_path(run_dir) / "buffer"
        self.stop = stop
        self.totals = {"level_merges": 0, "merged_files": 0, "written_files": 0, "groups": 0, "abandoned": 0,
                       "seconds": 0.0, "paused_s": 0.0}
        self._thread: threading.Thread | None = None
        self._no_pass = threading.Event()
        self._no_pass.set()

    @contextlib.contextmanager
    def yielding(self) -> Iterator[None]:
        """Around a pass: the level merge in progress pauses at its next row group until the block ends."""
        self._no_pass.clear()
        try:
            yield
        finally:
            self._no_pass.set()

    def _stopping(self) -> bool:
        """merge_levels' stop(): True when the daemon stops; while a pass runs, waits for its end first."""
        if not self._no_pass.is_set():
            t0 = time.perf_counter()
            while not self._no_pass.wait(0.2) and not self.stop:
                pass
            self.totals["paused_s"] += time.perf_counter() - t0
        return bool(self.stop)

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, batches: list) -> None:
        """Merge `batches` (a CompactionReport's `levels`) on the thread; call only when not busy."""
        self._thread = threading.Thread(target=self._merge, args=(batches,), name="level-merges", daemon=True)
        self._thread.start()

    def _merge(self, batches: list) -> None:
        t0, paused = time.perf_counter(), self.totals["paused_s"]
        try:
            r = buffer.merge_levels(self.root, batches, stop=self._stopping)
        except Exception as e:  # noqa: BLE001 - the next pass plans them again
            log.warning("level merges of %s failed (the next pass tries again): %s: %s", self.root,
                        type(e).__name__, e)
            return
        took = time.perf_counter() - t0
        t = self.totals
        t["level_merges"] += 1
        t["seconds"] += took
        for k in ("merged_files", "written_files", "groups", "abandoned"):
            t[k] += getattr(r, k)
        log.info("level merges in %.2f s (%.2f s of it paused for passes): shards %d -> %d (%d groups)%s; rss "
                 "%.0f MiB", took, t["paused_s"] - paused, r.merged_files, r.written_files, r.groups,
                 f", {r.abandoned} dropped (a source left meanwhile, or stopping)" if r.abandoned else "", rss_mb())

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def release_arrow_memory() -> None:
    """Give the memory Arrow's allocator keeps after a pass back to the system (see
    workers.proc.use_system_allocator)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def run_compactor(run_dir: str | os.PathLike, cfg: CompactorConfig, stop: StopFlag | None = None) -> dict:
    """Compact the run's files every `cfg.every_s` seconds, and early when a set holds more than
    `cfg.max_unmerged` unmerged files (EarlyTrigger), until stopped; returns the totals."""
    if cfg.every_s is None:
        raise ValueError("CompactorConfig.every_s is None: this run has no compactor")
    if stop is None:
        with StopFlag() as own:
            return run_compactor(run_dir, cfg, own)
    totals = {"passes": 0, "early_passes": 0, "merged_files": 0, "written_files": 0, "deleted_files": 0, "groups": 0,
              "quarantined": 0, "retired_files": 0, "retired_groups": 0, "aborted_uploads": 0, "seconds": 0.0,
              "level_merges": 0, "level_seconds": 0.0, "level_paused_s": 0.0}
    log.info("compacting %s every %.0f s (files older than %.0f s; %d groups a shard, %d rows a ledger/metrics "
             "file)%s; Arrow allocator %s", run_dir, cfg.every_s, cfg.min_age_s, cfg.target_groups, cfg.target_rows,
             "" if cfg.max_unmerged is None else f", and at once when a set has over {cfg.max_unmerged} unmerged files",
             arrow_allocator())
    if cfg.keep_versions is not None:
        log.info("retention: shards more than %d versions behind the trainer's oldest checkpoint are %s",
                 cfg.keep_versions, "archived to buffer/archive/shards/" if cfg.retention == "archive" else "deleted")
    disk = DiskWatch()
    trigger = EarlyTrigger(run_dir, cfg)
    levels = None if cfg.fanout is None or isinstance(as_path(run_dir), RemotePath) else LevelMerges(run_dir, stop)
    try:
        _compact_until_stopped(run_dir, cfg, stop, totals, disk, trigger, levels)
    finally:
        if levels is not None:
            levels.join()   # stop() is asked before each row group: a merge in progress is dropped at once
            for k in ("merged_files", "written_files", "groups"):
                totals[k] += levels.totals[k]
            totals["level_merges"], totals["level_seconds"] = levels.totals["level_merges"], levels.totals["seconds"]
            totals["level_paused_s"] = levels.totals["paused_s"]
    return totals


def _compact_until_stopped(run_dir, cfg: CompactorConfig, stop: StopFlag, totals: dict, disk: DiskWatch,
                           trigger: EarlyTrigger, levels: LevelMerges | None) -> None:
    """run_compactor's passes, until stopped."""
    swept = None       # when abort_stale_uploads last ran (monotonic)
    early: list[str] = []
    while not stop:
        trigger.starting()
        t0 = time.perf_counter()
        with levels.yielding() if levels is not None else contextlib.nullcontext():
            reports = compact_run(run_dir, cfg, defer_levels=levels is not None)
        took = time.perf_counter() - t0
        planned = reports["shards"].levels if "shards" in reports else []
        if planned and levels is not None and not levels.busy():
            levels.start(planned)
        trigger.passed(took)
        totals["early_passes"] += bool(early)
        kept = reports.pop("retention", None)
        totals["passes"] += 1
        totals["seconds"] += took
        for r in reports.values():
            for k in ("merged_files", "written_files", "deleted_files", "quarantined"):
                totals[k] += getattr(r, k)
        if "shards" in reports:
            totals["groups"] += reports["shards"].groups
        if kept is not None:
            totals["retired_files"] += kept.files
            totals["retired_groups"] += kept.groups
            totals["deleted_files"] += kept.deleted_files
        parts = [f"{k} {r.merged_files} -> {r.written_files} (deleted {r.deleted_files})"
                 for k, r in reports.items() if r.merged_files or r.deleted_files]
        if kept is not None and (kept.files or kept.deleted_files):
            parts.append(f"retention {kept.action}d {kept.files} shards ({kept.groups} groups, all older than "
                         f"version {kept.below_version}; trainer version {kept.trainer_version}), "
                         f"deleted {kept.deleted_files}")
        if parts or any(r.quarantined for r in reports.values()):
            log.info("pass%s in %.2f s: %s; live files %s; rss %.0f MiB",
                     f" (early: {', '.join(early)} over {cfg.max_unmerged} unmerged)" if early else "", took,
                     "; ".join(parts), live_files(run_dir), rss_mb())
        release_arrow_memory()
        disk.check(run_dir, cfg)
        if swept is None or time.monotonic() - swept >= SWEEP_EVERY_S:
            try:
                totals["aborted_uploads"] += len(abort_stale_uploads(run_dir))
            except Exception as e:  # noqa: BLE001 - housekeeping: the next sweep tries again
                log.warning("could not abort stale multipart uploads of %s: %s", run_dir, e)
            swept = time.monotonic()
        early = trigger.wait(stop)
