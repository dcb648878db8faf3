"""Merging sealed small shards into large ones, without disturbing concurrent readers.

DuckDB pays about 0.25 ms per file per query, so thousands of small flush
shards make every query slow. Compaction, under the buffer lock:

1. picks live shards older than `min_age_s` (sealed: their writers are long done
   with them) and smaller than `target_groups`, oldest first;
2. writes each batch of them as one c-file, keeping the sources' row groups
   (each holds whole groups), so a pull still reads only the row groups it
   needs; the c-file is invisible until step 3;
3. replaces the manifest: the c-file becomes live and its sources replaced, in
   one atomic rename;
4. deletes files replaced more than `grace_s` ago, then drops them from the
   manifest. A reader that listed a file before step 3 can still read it for
   `grace_s` seconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow.parquet as pq

from buffer.layout import BufferDir, atomic_file
from buffer.schema import parquet_write_options


@dataclass
class CompactionReport:
    merged_files: int = 0
    written_files: int = 0
    deleted_files: int = 0
    groups: int = 0
    quarantined: int = 0


def compact(root: str | os.PathLike, *, target_groups: int = 4096, min_age_s: float = 60.0,
            grace_s: float = 300.0, min_files: int = 2) -> CompactionReport:
    """Merge sealed small shards into c-files of about `target_groups` groups; see module doc."""
    d = BufferDir(root)
    report = CompactionReport()
    with d.lock:
        manifest = d.read_manifest()
        now = time.time()
        candidates: list[tuple[Path, int]] = []
        for p in d.live_shards():
            try:
                if now - p.stat().st_mtime < min_age_s:
                    continue
                meta = pq.read_metadata(p)
                groups = _group_count(meta)
            except FileNotFoundError:
                continue
            except Exception as e:  # noqa: BLE001 - unreadable footer
                d.quarantine(p, f"unreadable during compaction: {type(e).__name__}: {e}")
                report.quarantined += 1
                continue
            if groups < target_groups:
                candidates.append((p, groups))
        batches, cur, cur_groups = [], [], 0
        for p, g in candidates:
            if cur and cur_groups + g > target_groups:
                batches.append(cur)
                cur, cur_groups = [], 0
            cur.append(p)
            cur_groups += g
        if cur:
            batches.append(cur)
        batches = [b for b in batches if len(b) >= min_files]

        compacted, replaced = list(manifest.compacted), dict(manifest.replaced)
        generation = manifest.generation + 1
        for i, batch in enumerate(batches):
            out_name = f"c-{generation:06d}-{i:04d}.parquet"
            groups = _merge(d, batch, out_name)
            if groups is None:
                continue
            compacted.append(out_name)
            for p in batch:
                replaced[p.name] = now
                if p.name in compacted:
                    compacted.remove(p.name)
            report.merged_files += len(batch)
            report.written_files += 1
            report.groups += groups
        if report.written_files:
            manifest = replace(manifest, generation=generation, compacted=tuple(compacted),
                               replaced=replaced)
            d.write_manifest(manifest)

        # Deletion after the grace period, then (only then) out of the manifest.
        expired = [name for name, t in manifest.replaced.items() if now - t >= grace_s]
        for name in expired:
            try:
                os.unlink(d.shards / name)
            except FileNotFoundError:
                pass
            report.deleted_files += 1
        if expired:
            d.write_manifest(replace(manifest, replaced={k: v for k, v in manifest.replaced.items()
                                                         if k not in expired}))
    return report


def _group_count(meta: pq.FileMetaData) -> int:
    """Groups in a shard, from the count every writer puts in the footer."""
    kv = meta.metadata or {}
    if b"asyncgrpo.groups" in kv:
        return int(kv[b"asyncgrpo.groups"])
    return meta.num_rows  # an upper bound; fine for choosing what is small


def _merge(d: BufferDir, batch: list[Path], out_name: str) -> int | None:
    """Write the shards in `batch` as one file (temp + rename); its group count, or None."""
    groups = 0
    writer = None
    try:
        with atomic_file(d.tmp, d.shards / out_name) as f:
            for p in batch:
                try:
                    pf = pq.ParquetFile(p, page_checksum_verification=True)
                    parts = [pf.read_row_group(i) for i in range(pf.metadata.num_row_groups)]
                except Exception as e:  # noqa: BLE001
                    d.quarantine(p, f"unreadable during compaction: {type(e).__name__}: {e}")
                    if writer is not None:
                        writer.close()
                    raise _Abort from e
                for t in parts:  # the source's row groups as they were: they hold whole groups
                    if writer is None:
                        writer = pq.ParquetWriter(f, t.schema.remove_metadata(), **parquet_write_options())
                    writer.write_table(t, row_group_size=max(t.num_rows, 1))
                    groups += len(set(t.column("group_id").to_pylist()))
            if writer is None:   # sources without rows: nothing to merge
                raise _Abort
            writer.add_key_value_metadata({"asyncgrpo.groups": str(groups)})
            writer.close()
    except _Abort:  # atomic_file removed the temp file; nothing became visible
        return None
    return groups


class _Abort(Exception):
    pass
