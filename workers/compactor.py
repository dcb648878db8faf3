"""The compactor daemon: merges a run's sealed small files while the run goes on.

Generators flush a shard every `generator.flush_groups` groups, the trainer
writes a ledger file per pull and a metrics file every few seconds, the
generators a metrics file each; a run of hours leaves tens of thousands of
small files, and every SQL query, `status` and trainer restart pays per file.
The compactor keeps the live file count bounded:

    until SIGTERM / SIGINT:
        compact_run(run, cfg):
            buffer.compact: rollout shards older than min_age_s (sealed) and smaller
                than target_groups become c-files of about target_groups groups
            buffer.compact_ledger: ledger files become merged files of about
                target_rows records, in step order
            metrics/ and generator_metrics/: likewise, target_rows rows a file
            in each: files replaced more than grace_s ago are deleted (readers
                that listed them can still read them until then)
        wait every_s

Each set works under its lock and through its manifest (buffer/fileset.py),
so the generators, the trainer and SQL readers never fail or count a row
twice, the trainer never waits on it, and a kill -9 in the middle of a pass
leaves every set as it was or as it will be. `asyncgrpo run` starts one compactor beside the
trainer and generators when `compactor.every_s` is set (the default);
`asyncgrpo compactor --run DIR` runs it alone, for a run whose daemons are on
several machines.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import buffer
from buffer.layout import run_file_set
from workers.checks import is_int, is_num, require
from workers.stop import StopFlag

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
    target_rows: int = 262_144
    """Rows per merged ledger, metrics or generator-metrics file, >= 2."""

    def __post_init__(self) -> None:
        require(self, "every_s", self.every_s is None or is_num(self.every_s, 0, lo_open=True),
                "a number of seconds > 0, or none (no compactor)")
        require(self, "min_age_s", is_num(self.min_age_s, 0), "a number of seconds >= 0")
        require(self, "grace_s", is_num(self.grace_s, 0), "a number of seconds >= 0")
        require(self, "target_groups", is_int(self.target_groups, 2), "an integer >= 2")
        require(self, "target_rows", is_int(self.target_rows, 2), "an integer >= 2")


KINDS = ("shards", "ledger", "metrics", "generator_metrics")


def compact_run(run_dir: str | os.PathLike, cfg: CompactorConfig) -> dict[str, buffer.CompactionReport]:
    """One pass over every file set of the run that exists yet; a report per kind (KINDS)."""
    run = Path(run_dir)
    root = run / "buffer"
    out = {}
    ages = dict(min_age_s=cfg.min_age_s, grace_s=cfg.grace_s)
    if buffer.BufferDir.is_buffer(root):    # the first generator flush creates it
        out["shards"] = buffer.compact(root, target_groups=cfg.target_groups, **ages)
        out["ledger"] = buffer.compact_ledger(root, target_rows=cfg.target_rows, **ages)
    if (run / "metrics").is_dir():
        out["metrics"] = buffer.compact_small(run_file_set(run / "metrics", "metrics"), target_rows=cfg.target_rows,
                                              sort_by="step", **ages)
    if (run / "generator_metrics").is_dir():
        out["generator_metrics"] = buffer.compact_small(run_file_set(run / "generator_metrics", "generator_metrics"),
                                                        target_rows=cfg.target_rows, **ages)
    return out


def live_files(run_dir: str | os.PathLike) -> dict[str, int]:
    """Live files of each kind (KINDS) in a run: what every reader lists."""
    run = Path(run_dir)
    out = dict.fromkeys(KINDS, 0)
    if buffer.BufferDir.is_buffer(run / "buffer"):
        d = buffer.BufferDir(run / "buffer")
        out["shards"], out["ledger"] = len(d.live_shard_names()), len(d.ledger_shard_names())
    for kind in ("metrics", "generator_metrics"):
        if (run / kind).is_dir():
            out[kind] = len(run_file_set(run / kind, kind).live_names())
    return out


def run_compactor(run_dir: str | os.PathLike, cfg: CompactorConfig, stop: StopFlag | None = None) -> dict:
    """Compact the run's files every `cfg.every_s` seconds until stopped; returns the totals."""
    if cfg.every_s is None:
        raise ValueError("CompactorConfig.every_s is None: this run has no compactor")
    if stop is None:
        with StopFlag() as own:
            return run_compactor(run_dir, cfg, own)
    totals = {"passes": 0, "merged_files": 0, "written_files": 0, "deleted_files": 0, "groups": 0,
              "quarantined": 0, "seconds": 0.0}
    log.info("compacting %s every %.0f s (files older than %.0f s; %d groups a shard, %d rows a ledger/metrics "
             "file)", run_dir, cfg.every_s, cfg.min_age_s, cfg.target_groups, cfg.target_rows)
    while not stop:
        t0 = time.perf_counter()
        reports = compact_run(run_dir, cfg)
        took = time.perf_counter() - t0
        totals["passes"] += 1
        totals["seconds"] += took
        for r in reports.values():
            for k in ("merged_files", "written_files", "deleted_files", "quarantined"):
                totals[k] += getattr(r, k)
        if "shards" in reports:
            totals["groups"] += reports["shards"].groups
        if any(r.merged_files or r.deleted_files or r.quarantined for r in reports.values()):
            live = live_files(run_dir)
            log.info("pass in %.2f s: %s; live files %s", took, "; ".join(
                f"{k} {r.merged_files} -> {r.written_files} (deleted {r.deleted_files})"
                for k, r in reports.items() if r.merged_files or r.deleted_files), live)
        stop.wait(cfg.every_s)
    return totals
