"""Retention: rollout shards too old to be pulled again leave the hot buffer (opt-in).

A run of days writes millions of groups; every pull's index, `status` and SQL
query pays for every live shard. With `compactor.keep_versions = K` the
compactor retires, each pass, the live shards all of whose groups are more
than K versions behind the trainer:

    retired    max(version in the file) < T - K      (T: the trainer's version, see below)

With K >= trainer.max_staleness such a group is expired (or consumed or
filtered) for every trainer at version >= T, so it can never be pulled again.
Only whole files leave: a file holding any newer group stays (so the hot
buffer keeps up to about compactor.max_groups groups, a level merge's c-file,
more than K versions' worth; the compactor runs retention before its merges
too, so a file already old enough is not merged with newer ones). The max version of a file comes from its footer's column statistics,
read once per file (files never change).

Two actions, under the buffer's lock:

    archive    hard-link the file into <buffer>/archive/shards/<name> (os.link; where that
               fails, e.g. archive/ is a symlink to another disk, a copy written to
               archive/tmp/ and renamed), then mark it replaced in the shard manifest
    delete     only mark it replaced

A replaced file leaves every hot view at once (readers list through the
manifest) and is deleted from shards/ `grace_s` later by the usual
`FileSet.delete_expired`, so a reader that listed it before can still read it.
An archived file is complete before it is visible (link or rename), and the
SQL view `archived_rollouts` reads the archived files that are not live, so
`rollouts` and `archived_rollouts` never hold a row twice and never miss one
(the link comes before the manifest write, and readers list the manifest
before the archive). A kill -9 between the link and the manifest write leaves
the file live, and linked: the next pass finds the link and writes the
manifest; nothing is lost or counted twice.

Which T: `retire_old_shards` takes the trainer version it is given, by default
the newest `trainer_version` in the ledger. The compactor passes a version no
newer than the oldest trainer checkpoint's step (workers/compactor.py), so a
trainer resumed from any checkpoint on disk still finds every group it may
pull.

How readers tell a retired file from a lost one: before the manifest write,
retention records in <buffer>/archive/retention.json the bound it retired
below (`below_version`: T - K, only ever raised). Every file retention has
removed (archived or deleted) holds only groups of versions below it. A
`GroupIndex` that sees a file go away without its groups moving to a c-file
(buffer/index.py), and that is not in quarantine/, retires those groups (as
expired, consumed or filtered: what they are) when all of them are below the
bound; otherwise they stay "unavailable", as before. This one integer is
exact for both actions, also for files merged into a c-file that was retired
before the index saw it, and bounded however long the run.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from buffer.atomic import BufferError, atomic_file, atomic_write_bytes, clean_tmp_dir
from buffer.layout import SHARD_SUFFIX, BufferDir
from buffer.store import RemotePath, StoreError, list_names, read_metadata, read_table

if TYPE_CHECKING:   # pyarrow is imported where used: `asyncgrpo --help` reaches this module
    import pyarrow.parquet as pq

Action = Literal["archive", "delete"]
ACTIONS: tuple[Action, ...] = ("archive", "delete")
ARCHIVE = "archive"                 # <buffer>/archive/
FLOOR_FILE = "retention.json"       # <buffer>/archive/retention.json: {"below_version": v, "updated_at": t}


def archive_dir(root: str | os.PathLike) -> Path:
    """<buffer>/archive/: retired shards (shards/), the retention bound (retention.json), archive/tmp/."""
    return (root if isinstance(root, RemotePath) else Path(root).absolute()) / ARCHIVE


def archive_shards_dir(root: str | os.PathLike) -> Path:
    return archive_dir(root) / "shards"


def archived_shards(root: str | os.PathLike) -> list[Path]:
    """The archived rollout shards, sorted by name (a listing: no file is opened)."""
    folder = archive_shards_dir(root)
    try:
        names = list_names(folder)
    except FileNotFoundError:
        return []
    return [folder / n for n in sorted(names) if n.endswith(SHARD_SUFFIX)]


def read_floor(root: str | os.PathLike) -> int | None:
    """The bound retention retired below (every file it removed holds only older groups); None: never ran."""
    try:
        raw = json.loads((archive_dir(root) / FLOOR_FILE).read_text())
        return int(raw["below_version"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BufferError(f"unreadable retention record {archive_dir(root) / FLOOR_FILE}: {e}") from e


def _archive_tmp(d: BufferDir) -> Path:
    """archive/tmp/, for files written into the archive: beside it, since archive/ may be on another disk."""
    tmp = archive_dir(d.root) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def _raise_floor(d: BufferDir, below: int, now: float) -> None:
    """Record `below` as the bound (only ever raised); the caller holds the lock."""
    old = read_floor(d.root)
    if old is not None and old >= below:
        return
    atomic_write_bytes(_archive_tmp(d), archive_dir(d.root) / FLOOR_FILE,
                       json.dumps({"below_version": below, "updated_at": now}).encode())


def _column_max(meta: pq.FileMetaData, column: str) -> int | None:
    """Max of an integer column over every row group, from the footer's statistics; None if any lacks them."""
    leaves = [meta.schema.column(j).path for j in range(meta.num_columns)]   # Parquet columns, lists expanded
    if column not in leaves:
        return None
    i = leaves.index(column)
    best = None
    for rg in range(meta.num_row_groups):
        if meta.row_group(rg).num_rows == 0:
            continue
        stats = meta.row_group(rg).column(i).statistics
        if stats is None or not stats.has_min_max:
            return None
        best = stats.max if best is None else max(best, stats.max)
    return None if best is None else int(best)


def file_max(path: Path, column: str, meta: pq.FileMetaData | None = None) -> int | None:
    """Max of an integer column in a Parquet file: the footer's statistics, else the column read; None: no rows."""
    import pyarrow.compute as pc

    meta = read_metadata(path) if meta is None else meta
    best = _column_max(meta, column)
    if best is None and meta.num_rows:
        best = pc.max(read_table(path, columns=[column]).column(0)).as_py()
    return None if best is None else int(best)


def newest_trainer_version(root: str | os.PathLike) -> int | None:
    """The newest trainer version in the ledger (its newest file's max `trainer_version`); None without one."""
    return newest_in_ledger(BufferDir(root).ledger_shards())


def newest_in_ledger(ledger: list[Path]) -> int | None:
    """The max `trainer_version` of the newest of these ledger files (sorted by step); None: no file."""
    for p in reversed(ledger):     # newest first; one that vanished (merged meanwhile) is skipped
        try:
            return file_max(p, "trainer_version")
        except FileNotFoundError:
            continue
    return None


@dataclass
class RetentionReport:
    """What one retention pass did."""

    action: str
    trainer_version: int | None = None   # T measured against; None: unknown (no ledger, no checkpoint yet)
    below_version: int | None = None     # files whose groups are all older than this left: T - keep_versions
    files: int = 0                       # shards that left the hot buffer this pass
    groups: int = 0                      # their groups
    deleted_files: int = 0               # replaced shards deleted from shards/ after their grace period


# Per buffer: shard name -> (inode, mtime_ns, max version, groups). Files never change; the inode
# and mtime guard against a buffer rebuilt under the same path. Pruned to the live names each pass.
_FOOTERS: dict[Path, dict[str, tuple[int, int, int, int]]] = {}


def _footer_facts(path: Path, cache: dict, fresh: dict) -> tuple[int, int] | None:
    """(max version, groups) of a shard, from `cache` or its footer (recorded in `fresh`); None if unreadable."""
    try:
        st = path.stat()
        hit = cache.get(path.name)
        if hit is not None and hit[:2] == (st.st_ino, st.st_mtime_ns):
            fresh[path.name] = hit
            return hit[2], hit[3]
        meta = read_metadata(path)
        top = file_max(path, "version", meta)
    except FileNotFoundError:
        return None
    except StoreError:   # the store unreachable: not a damaged file
        raise
    except Exception:  # noqa: BLE001 - an unreadable footer: compaction and the index quarantine it
        return None
    if top is None:
        return None
    fresh[path.name] = (st.st_ino, st.st_mtime_ns, top, _groups(meta))
    return top, fresh[path.name][3]


def _groups(meta: pq.FileMetaData) -> int:
    """Groups in a shard: the count every writer puts in its footer (rows, an upper bound, without it)."""
    raw = (meta.metadata or {}).get(b"asyncgrpo.groups")
    return int(raw) if raw is not None else meta.num_rows


def retire_old_shards(root: str | os.PathLike, *, keep_versions: int, action: Action = "archive",
                      grace_s: float = 300.0, now: float | None = None,
                      trainer_version: int | None = None) -> RetentionReport:
    """Retire live shards all of whose groups are older than `trainer_version - keep_versions`; see module doc.

    trainer_version: None means the newest in the ledger (nothing is retired without a ledger).
    Then deletes, as compaction does, replaced shards older than `grace_s`.
    """
    if action not in ACTIONS:
        raise ValueError(f"retention action must be one of {ACTIONS}, got {action!r}")
    if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or keep_versions < 0:
        raise ValueError(f"keep_versions must be an integer >= 0, got {keep_versions!r}")
    d = BufferDir(root)
    fs = d.shard_set
    report = RetentionReport(action)
    with d.lock:
        now = time.time() if now is None else now
        t = newest_trainer_version(d.root) if trainer_version is None else trainer_version
        report.trainer_version = t
        if t is not None:
            below = t - keep_versions
            report.below_version = below
            cache = _FOOTERS.get(d.root, {})
            fresh: dict[str, tuple[int, int, int, int]] = {}
            old: list[tuple[Path, int]] = []                  # (shard, groups)
            for p in fs.live():
                facts = _footer_facts(p, cache, fresh)
                if facts is not None and facts[0] < below:
                    old.append((p, facts[1]))
            _FOOTERS[d.root] = fresh                          # only live names stay
            if old:
                clean_tmp_dir(_archive_tmp(d))                # copies a killed pass left half-written
                _raise_floor(d, below, now)                   # 1. the bound, before anything leaves
                if action == "archive":
                    for p, _ in old:                          # 2. complete archive files
                        _link_or_copy(d, p)
                fs.swap(fs.read_manifest(), [], [p.name for p, _ in old], now)   # 3. out of the hot views
                report.files = len(old)
                report.groups = sum(g for _, g in old)
        report.deleted_files = fs.delete_expired(grace_s, now)   # 4. after the grace period
    return report


def _link_or_copy(d: BufferDir, src: Path) -> Path:
    """`src` as archive/shards/<name>: a hard link, else an atomic copy; one there already is kept."""
    dest_dir = archive_shards_dir(d.root)
    dest = dest_dir / src.name
    dest_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(src, RemotePath):   # an object store: a server-side copy (one there already is kept)
        store = src.store
        if not dest.is_file():
            store._retry("copy", lambda: store.fs.copy(store._key(src.key), store._key(dest.key)))
        if dest.stat().st_size != src.stat().st_size:
            raise BufferError(f"cannot archive {src}: {dest} exists and is another file "
                              f"({dest.stat().st_size} bytes, not {src.stat().st_size}); move it aside")
        return dest
    try:
        os.link(src, dest)
        return dest
    except FileExistsError:
        pass   # a pass killed after its link, before its manifest write (or a copy): complete either way
    except OSError:   # no hard links here (EXDEV: archive/ on another disk; EPERM: the filesystem has none)
        with open(src, "rb") as f_in, atomic_file(_archive_tmp(d), dest) as f_out:
            shutil.copyfileobj(f_in, f_out, 1 << 20)
        return dest
    if dest.stat().st_size != src.stat().st_size:
        raise BufferError(f"cannot archive {src}: {dest} exists and is another file "
                          f"({dest.stat().st_size} bytes, not {src.stat().st_size}); move it aside")
    return dest
