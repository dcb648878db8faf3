"""Merging sealed small files into large ones, without disturbing concurrent readers.

DuckDB pays about 0.25 ms per file per query, so thousands of small files make
every query slow. Four kinds of file grow with a run, each a `FileSet` (see
buffer/fileset.py for the manifest protocol that keeps readers exact):

    rollout shards     <buffer>/shards/    compact(): c-files of about `target_groups` groups
    ledger records     <buffer>/ledger/    compact_ledger(): one file per pull -> c-files of about
                                            `target_rows` records, in step order
    trainer metrics    <run>/metrics/      compact_small(run_metrics_set(run), ...)
    generator metrics  <run>/generator_metrics/

Each pass, under the set's lock:

1. picks live files older than `min_age_s` (sealed) and smaller than the target,
   oldest first; with `max_unmerged` set and more than half that many files
   not yet merged (as their writers left them: the count grows with the
   writers' output, not with the run's length), also the younger ones, all
   but the newest `max_unmerged // 2`; for rollout shards with `fanout` set, c-files of at least
   half the target go to levels instead: `fanout` c-files of level k (t *
   fanout^(k-1) <= groups < t * fanout^k, t = target / 2, k >= 1, oldest
   first) become one of the next level, up to `max_groups` groups and
   `max_bytes` bytes a file (the sources' sizes summed), so a run of N groups
   keeps about N / (the largest file) + (fanout - 1) * levels c-files instead
   of N / target, and each group is rewritten about once per level;
2. writes each batch of them as one c-file (rollout shards keep their sources'
   row groups, each holding whole groups, so a pull still reads only the row
   groups it needs); the c-file is invisible until step 3; its footer names
   its sources and their rows;
3. replaces the manifest: the c-files become live and their sources replaced,
   in one atomic rename (rollout shards: once for the base merges, then once
   for the level merges);
   with `defer_levels`, compact() only plans the level merges (report.levels)
   and merge_levels() writes them without the lock, taking it per file only to
   check that the sources are still live, rename the c-file into place and swap
   it in: a level merge takes seconds to minutes (it re-encodes up to
   `max_bytes`), and base merges, the ledger's and a starting generator's
   writer id no longer wait for it (the compactor daemon runs it on a thread);
4. deletes files replaced more than `grace_s` ago, then drops them from the
   manifest. A reader that listed a file before step 3 can still read it for
   `grace_s` seconds.

A kill -9 anywhere leaves the set as it was before the pass or after it (at
worst a temp file, cleaned later, or a replaced file already deleted but still
in the manifest, which step 4 drops on the next pass).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from buffer.fileset import SHARD_SUMMARY, SOURCES_KEY, SUMMARY_KEY, FileSet, block_summary, pack_columns
from buffer.layout import BufferDir, atomic_file, ledger_range
from buffer.store import RemotePath, StoreError, parquet_file, read_metadata
from buffer.schema import parquet_write_options

LEDGER_TARGET_ROWS = 262_144   # ledger records per merged ledger file (one per group pulled)
C_ROW_GROUP_GROUPS = 256       # groups per row group of a merged rollout shard (at least; whole source row groups)
LEVEL_MAX_GROUPS = 65_536      # with retention, no level merge writes a file of more groups (compactor.max_groups)
LEVEL_MAX_BYTES = 256 << 20     # no level merge writes a file of more bytes (compactor.max_file_mb)
# A merge sums its groups per (version, filtered, reason) for the footer's summary every this many groups,
# so its memory is that many groups' first rows, not a level file's millions
SUMMARY_CHUNK_GROUPS = 65_536
# Row groups of a level merge (old data, rarely pulled) hold at least this many bytes (Arrow, uncompressed)
# as well: DuckDB pays per row group, and an aggregate over row groups of 2,048 rows took twice as long
# as over 16,384 (10.7M rows, 2 cores); a pull from such a file reads one of them.
LEVEL_ROW_GROUP_BYTES = 4 << 20
# ... and at least 1/LEVEL_ROW_GROUPS of the merge's groups, up to LEVEL_ROW_GROUP_MAX_BYTES a row group,
# so a level file's footer (a few KB per row group, parsed by every query) stops growing with the run:
# at 4 MiB a level file of 837k groups had 426 row groups and a 1.9 MB footer, and the soak's SQL
# aggregate over 10.7M rows took 586 ms beside three busy processes on 2 cores against 367 ms with
# 29 row groups (the fixed part, `count(*)`: 406 against 168 ms). The price: a pull of one of those
# groups, hours old in any real run, reads a row group of up to 64 MiB (75 ms against 20 ms).
LEVEL_ROW_GROUPS = 32
LEVEL_ROW_GROUP_MAX_BYTES = 64 << 20
_SUMMARY_COLUMNS = ("version", "filtered", "filter_reason", "group_size", "group_reward_mean")


# Per buffer: shard name -> (inode, mtime_ns, groups), so that compact() reads each footer once
# (files never change; on a buffer of a million groups a c-file's footer, which names its sources,
# is hundreds of KB). The inode and mtime guard against a buffer rebuilt under the same path.
_GROUP_COUNTS: dict[Path, dict[str, tuple[int, int, int]]] = {}


@dataclass
class CompactionReport:
    merged_files: int = 0
    written_files: int = 0
    deleted_files: int = 0
    groups: int = 0        # rollout groups (compact) or rows (the other sets) in the written files
    quarantined: int = 0
    # compact(defer_levels=True): the level merges it planned and left to merge_levels, each a list of
    # (source c-file, its groups), oldest first
    levels: list[list[tuple[Path, int]]] = field(default_factory=list)
    abandoned: int = 0     # merge_levels: merges dropped because a source left meanwhile (or on stop)


def compact(root: str | os.PathLike, *, target_groups: int = 4096, min_age_s: float = 60.0,
            grace_s: float = 300.0, min_files: int = 2, fanout: int | None = None,
            max_groups: int | None = None, max_bytes: int | None = LEVEL_MAX_BYTES,
            max_unmerged: int | None = None, defer_levels: bool = False) -> CompactionReport:
    """Merge sealed small rollout shards into c-files of about `target_groups` groups, and with
    `fanout`, c-files into levels of up to `max_groups` groups and `max_bytes` bytes (None: no limit);
    with `max_unmerged`, young shards too when more than half that many are unmerged; with `defer_levels`,
    the level merges are only planned (report.levels, for merge_levels); see module doc."""
    d = BufferDir(root)
    fs = d.shard_set
    report = CompactionReport()
    with d.lock:
        now = time.time()
        candidates: list[tuple[Path, int]] = []
        merged: list[tuple[Path, int, int]] = []   # sealed c-files of >= target_groups / 2, groups, bytes: levels
        cache = _GROUP_COUNTS.get(d.root, {})
        seen: dict[str, tuple[int, int, int]] = {}
        listed = _stat_live(fs)
        early = early_merges(fs, listed, now, min_age_s, max_unmerged)
        for p, st in listed:
            try:
                if now - st.st_mtime < min_age_s and p.name not in early:
                    continue
                hit = cache.get(p.name)
                if hit is not None and hit[:2] == (st.st_ino, st.st_mtime_ns):
                    groups = hit[2]
                else:
                    groups = _group_count(read_metadata(p))
                seen[p.name] = (st.st_ino, st.st_mtime_ns, groups)
            except FileNotFoundError:
                continue
            except StoreError:   # the store unreachable: not a damaged file
                raise
            except Exception as e:  # noqa: BLE001 - unreadable footer
                d.quarantine(p, f"unreadable during compaction: {type(e).__name__}: {e}")
                report.quarantined += 1
                continue
            if fanout and p.name.startswith("c-") and groups >= target_groups // 2:
                merged.append((p, groups, st.st_size))   # a base merge's c-file (at most target_groups, often a few less)
            elif groups < target_groups:
                candidates.append((p, groups))
        _GROUP_COUNTS[d.root] = seen   # bounded: only the live (sealed) names stay
        base = [b for b in _batches(candidates, target_groups) if len(b) >= min_files]
        levels = _levels(merged, max(target_groups // 2, 1), fanout, max_groups, max_bytes) if fanout else []
        level_groups = {p.name: n for p, n, _ in merged}
        if defer_levels:
            report.levels = [[(p, level_groups[p.name]) for p in batch] for batch in levels]
            levels = []
        # Two swaps: the young shards' merges go live before the (longer) level merges are written, so
        # the live file count does not wait on them.
        for batches, level in ((base, False), (levels, True)):
            generation = fs.read_manifest().generation + 1
            new, sources = [], []
            for i, batch in enumerate(batches):
                out_name = f"c-{generation:06d}-{i:04d}.parquet"
                rg = _level_row_groups(sum(level_groups[p.name] for p in batch)) if level else {}
                groups = _merge_shards(d, batch, out_name, **rg)
                if groups is None:
                    continue
                new.append(out_name)
                sources += [p.name for p in batch]
                report.merged_files += len(batch)
                report.written_files += 1
                report.groups += groups
            if new:
                fs.swap(fs.read_manifest(), new, sources, now)
        report.deleted_files = fs.delete_expired(grace_s, now)
    return report


def _level_row_groups(groups: int) -> dict:
    """_merge_shards' row-group settings for a level merge of `groups` groups."""
    return dict(rg_bytes=LEVEL_ROW_GROUP_BYTES, max_rg_bytes=LEVEL_ROW_GROUP_MAX_BYTES,
                rg_groups=-(-groups // LEVEL_ROW_GROUPS))


def merge_levels(root: str | os.PathLike, batches: list[list[tuple[Path, int]]], *,
                 stop: Callable[[], bool] | None = None) -> CompactionReport:
    """Write the level merges compact(defer_levels=True) planned (its report.levels), each a c-file that
    goes live in its own swap; the buffer's lock is held only for each file's check, rename and swap, not
    while it is written, so base merges go on meanwhile (see module doc).

    A merge whose sources are not all live by then (retention retired one, another process merged them)
    is dropped before its c-file becomes visible, as is the one in progress when `stop()` turns true:
    nothing is lost or counted twice. Names are c-<generation>-L<i>, the generation read at the start
    (base merges' names end in digits, so the two never collide); a name already taken drops the merge.
    """
    d = BufferDir(root)
    fs = d.shard_set
    report = CompactionReport()
    generation = fs.read_manifest().generation
    for i, batch in enumerate(batches):
        if stop is not None and stop():
            break
        names = [p.name for p, _ in batch]
        out_name = f"c-{generation:06d}-L{i:03d}.parquet"
        with contextlib.ExitStack() as held:
            def publish() -> None:   # called with the c-file written and synced, before its rename
                held.enter_context(d.lock)
                manifest = fs.read_manifest()
                if not set(names) <= set(manifest.compacted) or (d.shards / out_name).exists():
                    raise _Abort
            groups = _merge_shards(d, [p for p, _ in batch], out_name, publish=publish, stop=stop,
                                   **_level_row_groups(sum(n for _, n in batch)))
            if groups is None:
                report.abandoned += 1
                continue
            fs.swap(fs.read_manifest(), [out_name], names, time.time())
        report.merged_files += len(batch)
        report.written_files += 1
        report.groups += groups
    return report


def compact_ledger(root: str | os.PathLike, *, target_rows: int = LEDGER_TARGET_ROWS, min_age_s: float = 60.0,
                   grace_s: float = 300.0, min_files: int = 2, max_unmerged: int | None = None) -> CompactionReport:
    """Merge sealed ledger files (one per pull) into 'step-<first>-c<gen>-<last>.parquet', in step order.

    Never waits on the trainer and never makes it wait: the trainer writes new
    ledger files without the lock; a resume "as of step k" (buffer.Sampler)
    takes the lock to cut merged files at k.
    """
    d = BufferDir(root)
    return compact_small(d.ledger_set, target_rows=target_rows, min_age_s=min_age_s, grace_s=grace_s,
                         min_files=min_files, order=ledger_range, summary=ledger_summary, max_unmerged=max_unmerged)


def ledger_summary(t: pa.Table) -> dict:
    """A merged ledger file's records counted per (group_version, use_index), for `status`, which then
    reads no record of it: {"rows": n, "columns": packed LEDGER_SUMMARY columns} (buffer.fileset)."""
    agg = pa.table({"v": t.column("group_version"), "u": t.column("use_index")}).group_by(
        ["v", "u"], use_threads=False).aggregate([("v", "count")])
    cells = pa.table({"group_version": agg.column("v"), "use_index": agg.column("u"),
                      "records": agg.column("v_count")}).sort_by([("group_version", "ascending"),
                                                                  ("use_index", "ascending")])
    return {"rows": t.num_rows, "columns": pack_columns(cells),
            **block_summary(cells, "group_version", ["use_index"], ["records"])}


def compact_small(fs: FileSet, *, target_rows: int, min_age_s: float, grace_s: float, min_files: int = 2,
                  order: Callable[[str], object] | None = None, sort_by: str | None = None,
                  summary: Callable[[pa.Table], dict] | None = None,
                  max_unmerged: int | None = None) -> CompactionReport:
    """Merge sealed small files of a set whose files are small tables (ledger, metrics); c-files named by fs.c_name.

    order(name) -> the sort key of files (default: the name); sort_by: a column whose
    first value orders the sources inside a c-file; summary(table): a dict for the c-file's
    footer (FileSet.merge_tables); max_unmerged: see the module doc.
    """
    report = CompactionReport()
    if not isinstance(fs.folder, RemotePath) and not fs.folder.is_dir():
        return report
    with fs.lock:
        now = time.time()
        candidates: list[tuple[Path, int]] = []
        listed = _stat_live(fs)
        early = early_merges(fs, listed, now, min_age_s, max_unmerged)
        for p, st in listed:
            try:
                if now - st.st_mtime < min_age_s and p.name not in early:
                    continue
                rows = read_metadata(p).num_rows
            except FileNotFoundError:
                continue
            if rows < target_rows:
                candidates.append((p, rows))
        if order is not None:
            candidates.sort(key=lambda pr: order(pr[0].name))
        batches = [b for b in _batches(candidates, target_rows) if len(b) >= min_files]
        manifest = fs.read_manifest()
        generation = manifest.generation + 1
        new, sources = [], []
        for i, batch in enumerate(batches):
            names = [p.name for p in batch]
            out_name = fs.c_name(generation, i, names)
            report.groups += fs.merge_tables(names, out_name, sort_by=sort_by, summary=summary)
            new.append(out_name)
            sources += names
            report.merged_files += len(batch)
            report.written_files += 1
        if new:
            fs.swap(manifest, new, sources, now)
        report.deleted_files = fs.delete_expired(grace_s, now)
    return report


def _stat_live(fs: FileSet) -> list[tuple[Path, os.stat_result]]:
    """The set's live files with their stat (those gone meanwhile left out)."""
    out = []
    for p in fs.live():
        try:
            out.append((p, p.stat()))
        except FileNotFoundError:
            continue
    return out


def early_merges(fs: FileSet, listed: list[tuple[Path, os.stat_result]], now: float, min_age_s: float,
                 max_unmerged: int | None) -> set[str]:
    """Names of the files younger than `min_age_s` that a pass merges anyway: when more than
    `max_unmerged // 2` of the live files `listed` are unmerged (not c-files), all of those but the newest
    `max_unmerged // 2` are merged, whatever their age (the older ones are merged in any case).

    So every pass leaves at most max_unmerged // 2 unmerged files that it could merge, and the daemon's
    next early pass (over max_unmerged, and max_unmerged // 2 more than the last pass left) comes at
    about max_unmerged, whatever the writers' rate. Leaving the young files to their age instead, a
    regular pass left the writers' output over min_age_s unmerged, and the early pass came at that plus
    max_unmerged // 2: the live files' peaks followed the writers' rate (a 60-minute soak's rose
    +0.67 files a minute over its last half hour, as the generator sped up)."""
    unmerged = sorted((st.st_mtime, p.name) for p, st in listed if not fs.is_compacted(p.name))
    if max_unmerged is None or len(unmerged) <= max_unmerged // 2:
        return set()
    return {name for t, name in unmerged[:len(unmerged) - max_unmerged // 2] if now - t < min_age_s}


def unmerged_count(fs: FileSet, names: list[str] | None = None) -> int:
    """Live files of the set not yet merged (as their writers left them); a listing, no file read.
    `names`: the set's live names from a listing already taken (then none is taken here)."""
    return sum(not fs.is_compacted(n) for n in (fs.live_names() if names is None else names))


def _batches(candidates: list[tuple[Path, int]], target: int) -> list[list[Path]]:
    """Consecutive runs of candidates, each of at most `target` (groups or rows) unless a single file."""
    batches, cur, cur_n = [], [], 0
    for p, n in candidates:
        if cur and cur_n + n > target:
            batches.append(cur)
            cur, cur_n = [], 0
        cur.append(p)
        cur_n += n
    if cur:
        batches.append(cur)
    return batches


def _levels(files: list[tuple[Path, int, int]], base: int, fanout: int, max_groups: int | None,
            max_bytes: int | None) -> list[list[Path]]:
    """Level merges: runs of `fanout` c-files (path, groups, bytes) of one level k >= 1 (base *
    fanout^(k-1) <= groups < base * fanout^k), oldest first (c-file names sort by generation), where
    `fanout` of them make at most `max_groups` groups and `max_bytes` bytes (None: no limit)."""
    by_level: dict[int, list[tuple[Path, int, int]]] = {}
    for p, n, size in files:
        level, top = 1, base * fanout
        while n >= top:
            level, top = level + 1, top * fanout
        by_level.setdefault(level, []).append((p, n, size))
    out = []
    for level in sorted(by_level):
        run = sorted(by_level[level], key=lambda f: f[0].name)
        for i in range(0, len(run) - fanout + 1, fanout):
            chunk = run[i:i + fanout]
            if ((max_groups is None or sum(f[1] for f in chunk) <= max_groups)
                    and (max_bytes is None or sum(f[2] for f in chunk) <= max_bytes)):
                out.append([f[0] for f in chunk])
    return out


def _group_count(meta: pq.FileMetaData) -> int:
    """Groups in a shard, from the count every writer puts in the footer."""
    kv = meta.metadata or {}
    if b"asyncgrpo.groups" in kv:
        return int(kv[b"asyncgrpo.groups"])
    return meta.num_rows  # an upper bound; fine for choosing what is small


def _merge_shards(d: BufferDir, batch: list[Path], out_name: str, *, rg_bytes: int = 0, rg_groups: int = 0,
                  max_rg_bytes: int | None = None, publish: Callable[[], None] | None = None,
                  stop: Callable[[], bool] | None = None) -> int | None:
    """Write the shards in `batch` as one file (temp + rename); its group count, or None.

    `publish()` runs with the file written and synced, just before its rename (merge_levels takes the
    lock there; raising _Abort drops the file); `stop()` is asked before each source row group (True:
    the file is dropped).

    The sources' row groups (each holding whole groups) are concatenated into
    row groups of at least C_ROW_GROUP_GROUPS and `rg_groups` groups and `rg_bytes` bytes (Arrow), or
    of C_ROW_GROUP_GROUPS groups and `max_rg_bytes` bytes, whichever comes first: a c-file of many
    small flush shards would otherwise carry hundreds of row groups, and a footer of hundreds of KB
    that every SQL query and `status` parses.
    """
    groups = 0
    writer = None
    sources = []
    pending: list = []
    pending_groups = pending_bytes = 0
    firsts: list[pa.Table] = []   # each group's first row: its per-group columns, for the summary
    firsts_groups = 0
    cells: list[pa.Table] = []    # the summary of earlier firsts (SUMMARY_CHUNK_GROUPS at a time)

    def write_pending() -> None:
        nonlocal writer, pending, pending_groups, pending_bytes
        t = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
        if writer is None:
            writer = pq.ParquetWriter(f, t.schema.remove_metadata(), **parquet_write_options())
        writer.write_table(t, row_group_size=max(t.num_rows, 1))
        pending, pending_groups, pending_bytes = [], 0, 0

    try:
        with atomic_file(d.tmp, d.shards / out_name) as f:
            for p in batch:
                rows = 0
                for t in _row_groups(d, p, lambda: writer):   # one at a time: memory is a row group, not a file
                    if stop is not None and stop():
                        if writer is not None:
                            writer.close()
                        raise _Abort
                    # whole groups each: cutting between them keeps every group in one row group
                    rows += t.num_rows
                    n = pc.count_distinct(t.column("group_id")).as_py()
                    pending.append(t.replace_schema_metadata(None))
                    firsts.append(t.filter(pc.equal(t.column("sample_index"), 0)).select(list(_SUMMARY_COLUMNS)))
                    firsts_groups += n
                    if firsts_groups >= SUMMARY_CHUNK_GROUPS:
                        cells.append(_summary_cells(firsts))
                        firsts, firsts_groups = [], 0
                    pending_groups += n
                    pending_bytes += t.nbytes
                    groups += n
                    if pending_groups >= C_ROW_GROUP_GROUPS and (
                            (pending_groups >= rg_groups and pending_bytes >= rg_bytes)
                            or (max_rg_bytes is not None and pending_bytes >= max_rg_bytes)):
                        write_pending()
                sources.append([p.name, rows])
            if pending:
                write_pending()
            if writer is None:   # sources without rows: nothing to merge
                raise _Abort
            writer.add_key_value_metadata({"asyncgrpo.groups": str(groups),
                                           SOURCES_KEY.decode(): json.dumps(sources),
                                           SUMMARY_KEY.decode(): json.dumps(_summary(firsts, cells, sum(n for _, n in sources)))})
            writer.close()
            if publish is not None:
                f.flush()
                os.fsync(f.fileno())   # before the lock: atomic_file's own fsync then finds nothing to write
                publish()
    except _Abort:  # atomic_file removed the temp file; nothing became visible
        return None
    return groups


def _row_groups(d: BufferDir, p: Path, writer):
    """The row groups of shard `p`, read one at a time with page checksums; a damaged one quarantines `p`
    and aborts the merge (`writer()`: the output's writer, closed first; atomic_file then removes it)."""
    try:
        pf = parquet_file(p, page_checksum_verification=True)
        for i in range(pf.metadata.num_row_groups):
            yield pf.read_row_group(i)
    except StoreError:   # the store unreachable: not a damaged file
        raise
    except Exception as e:  # noqa: BLE001
        d.quarantine(p, f"unreadable during compaction: {type(e).__name__}: {e}")
        if writer() is not None:
            writer().close()
        raise _Abort from e


def _summary_cells(firsts: list[pa.Table]) -> pa.Table:
    """Groups' first rows summed per (version, filtered, filter reason), in SHARD_SUMMARY's columns."""
    t = pa.concat_tables(firsts)
    size = t.column("group_size").cast(pa.int64())
    return _sum_cells(pa.table([t.column("version"), pc.fill_null(t.column("filtered"), False),
                                pc.fill_null(t.column("filter_reason"), ""), pa.repeat(1, t.num_rows), size,
                                pc.multiply(t.column("group_reward_mean"), size.cast(pa.float64()))],
                               names=list(SHARD_SUMMARY)))


def _summary(firsts: list[pa.Table], cells: list[pa.Table], num_rows: int) -> dict:
    """A merged shard's groups summed per (version, filtered, filter reason), for `status` (see
    read_summary): the `cells` of earlier chunks of its groups and the `firsts` rows of the rest."""
    parts = cells + ([_summary_cells(firsts)] if firsts else [])
    out = parts[0] if len(parts) == 1 else _sum_cells(pa.concat_tables(parts))
    out = out.sort_by([("version", "ascending"), ("filtered", "ascending"), ("filter_reason", "ascending")])
    return {"rows": num_rows, "columns": pack_columns(out),
            **block_summary(out, "version", ["filtered", "filter_reason"], list(SHARD_SUMMARY[3:]))}


def _sum_cells(t: pa.Table) -> pa.Table:
    """Rows in SHARD_SUMMARY's columns (cells, or one group each) with the same (version, filtered,
    filter reason) added up."""
    keys = list(SHARD_SUMMARY[:3])
    agg = t.group_by(keys, use_threads=False).aggregate([(c, "sum") for c in SHARD_SUMMARY[3:]])
    return pa.table([agg.column(c) for c in keys] + [agg.column(f"{c}_sum") for c in SHARD_SUMMARY[3:]],
                    names=list(SHARD_SUMMARY))


class _Abort(Exception):
    pass
