"""The compactor daemon: merges a run's sealed small shards while the run goes on.

Generators flush a shard every `generator.flush_groups` groups, so a run of
hours leaves tens of thousands of small files, and every SQL query, `status`
and trainer restart pays per file. The compactor keeps the live file count
bounded:

    until SIGTERM / SIGINT:
        buffer.compact(<run>/buffer): shards older than min_age_s (sealed) and
            smaller than target_groups become c-files of about target_groups
            groups; replaced files are deleted after grace_s (readers that
            listed them can still read them until then)
        wait every_s

`buffer.compact` works under the buffer lock and through the manifest, so the
generators, the trainer and SQL readers never fail or count a group twice, and
a kill -9 in the middle of a pass leaves the buffer as it was or as it will be
(see buffer/compaction.py). `asyncgrpo run` starts one compactor beside the
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

    def __post_init__(self) -> None:
        require(self, "every_s", self.every_s is None or is_num(self.every_s, 0, lo_open=True),
                "a number of seconds > 0, or none (no compactor)")
        require(self, "min_age_s", is_num(self.min_age_s, 0), "a number of seconds >= 0")
        require(self, "grace_s", is_num(self.grace_s, 0), "a number of seconds >= 0")
        require(self, "target_groups", is_int(self.target_groups, 2), "an integer >= 2")


def run_compactor(run_dir: str | os.PathLike, cfg: CompactorConfig, stop: StopFlag | None = None) -> dict:
    """Compact <run_dir>/buffer every `cfg.every_s` seconds until stopped; returns the totals."""
    if cfg.every_s is None:
        raise ValueError("CompactorConfig.every_s is None: this run has no compactor")
    if stop is None:
        with StopFlag() as own:
            return run_compactor(run_dir, cfg, own)
    root = Path(run_dir) / "buffer"
    totals = {"passes": 0, "merged_files": 0, "written_files": 0, "deleted_files": 0, "groups": 0,
              "quarantined": 0, "seconds": 0.0}
    log.info("compacting %s every %.0f s (shards older than %.0f s, %d groups a c-file)", root, cfg.every_s,
             cfg.min_age_s, cfg.target_groups)
    while not stop:
        if buffer.BufferDir.is_buffer(root):    # the first generator flush creates it
            t0 = time.perf_counter()
            r = buffer.compact(root, target_groups=cfg.target_groups, min_age_s=cfg.min_age_s,
                               grace_s=cfg.grace_s)
            took = time.perf_counter() - t0
            totals["passes"] += 1
            totals["seconds"] += took
            for k in ("merged_files", "written_files", "deleted_files", "groups", "quarantined"):
                totals[k] += getattr(r, k)
            if r.merged_files or r.deleted_files or r.quarantined:
                log.info("merged %d shards (%d groups) into %d, deleted %d replaced, quarantined %d in %.2f s; "
                         "%d live shards", r.merged_files, r.groups, r.written_files, r.deleted_files,
                         r.quarantined, took, len(buffer.BufferDir(root).live_shards()))
        stop.wait(cfg.every_s)
    return totals
