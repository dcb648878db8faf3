"""Compact a run and stop dead at one point, for kill -9 tests: compact_pause.py RUN KIND POINT MARKER.

KIND: shards, ledger, metrics or generator_metrics (the file set to pause in);
POINT: written (its c-file written, the manifest not yet swapped), swapped (the
manifest swapped, nothing deleted), deleting (one replaced source deleted, the
others and the manifest not yet). KIND levels: the rollout shards' level merges
as the daemon runs them (planned by a pass, written by buffer.merge_levels
without the lock; target_groups 4, fanout 2), POINT writing (its temp file
open) or written (renamed into place under the lock, not yet swapped in). At
the point the process writes MARKER and sleeps until killed. The pause is
patched in here, in the test's process only.
"""

import os
import sys
import time
from pathlib import Path

import buffer.fileset as fileset
from buffer import compact, merge_levels
from workers.compactor import CompactorConfig, compact_run

run, kind, point, marker = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])


def pause() -> None:
    marker.write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def ours(fs) -> bool:
    return fs.folder.name == ("shards" if kind == "levels" else kind)


swap, delete_expired, unlink = fileset.FileSet.swap, fileset.FileSet.delete_expired, os.unlink


def paused_swap(self, *a, **k):
    if ours(self) and point == "written":
        pause()
    out = swap(self, *a, **k)
    if ours(self) and point == "swapped":
        pause()
    return out


def paused_delete(self, *a, **k):
    if not ours(self) or point != "deleting":
        return delete_expired(self, *a, **k)
    deleted = []

    def unlink_then_pause(path, *ua, **uk):
        unlink(path, *ua, **uk)
        deleted.append(path)
        if Path(path).parent == self.folder and len(deleted) == 1:
            pause()

    fileset.os.unlink = unlink_then_pause
    try:
        return delete_expired(self, *a, **k)
    finally:
        fileset.os.unlink = unlink


fileset.FileSet.swap = paused_swap
fileset.FileSet.delete_expired = paused_delete
if kind == "levels":
    fileset.FileSet.swap = swap   # the pass's base swap (none: only c-files are live) is not the pause
    planned = compact(Path(run) / "buffer", target_groups=4, fanout=2, max_groups=None, min_age_s=0.0, grace_s=0.0,
                      defer_levels=True).levels
    fileset.FileSet.swap = paused_swap
    asked = []

    def stop() -> bool:
        asked.append(1)
        if point == "writing" and len(asked) == 2:   # the temp file open, a row group read
            pause()
        return False

    merge_levels(Path(run) / "buffer", planned, stop=stop)
else:
    compact_run(run, CompactorConfig(min_age_s=0.0, grace_s=0.0))
print("no pause reached", file=sys.stderr)
sys.exit(3)
