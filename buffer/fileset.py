"""A folder of write-once Parquet files that compaction merges, and which of them are live.

Every kind of file a run grows by (rollout shards, ledger records, the
trainer's metrics, the generators' metrics) is a `FileSet`: writers add
files (temp + rename), compaction merges sealed ones into c-files, and every
reader lists the live files through the set's manifest:

    manifest   {"generation": g, "compacted": [live c-files], "replaced": {name: time replaced}}
    live       a plain file unless the manifest lists it as replaced;
               a c-file only once the manifest lists it as compacted

A merge (under the set's lock) writes the c-file first (invisible: not yet in
the manifest), then swaps it in for its sources in one atomic manifest write,
and deletes the sources only `grace_s` later, dropping them from the manifest
after the deletion. A reader reads the manifest before listing the folder, so
it never counts a row twice (a c-file and its sources are never live
together) and never misses one (a source stays on disk until long after the
c-file became live); a kill -9 at any point leaves the set as it was or as
it is after the merge, with at most a temp file to clean.

Each c-file names its sources in its footer (`asyncgrpo.sources`: a JSON list
of [name, rows] in row order), so an incremental reader that already counted
some sources skips exactly their rows (buffer.index).
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from typing import TYPE_CHECKING

from filelock import FileLock

from buffer.atomic import BufferError, atomic_file
from buffer.store import RemotePath, list_entries, list_names, read_table

if TYPE_CHECKING:   # pyarrow is imported where used: `asyncgrpo --help` reaches this module
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

SOURCES_KEY = b"asyncgrpo.sources"
SUMMARY_KEY = b"asyncgrpo.summary"   # a merged rollout shard's groups per (version, filter reason): status reads no rows
PARQUET = ".parquet"


@dataclass(frozen=True)
class Manifest:
    generation: int
    compacted: tuple[str, ...]           # live c-files
    replaced: dict[str, float]           # file name -> time it was replaced (to delete after grace)

    @staticmethod
    def empty() -> "Manifest":
        return Manifest(0, (), {})


def read_sources(meta: pq.FileMetaData) -> list[tuple[str, int]] | None:
    """[(source name, rows)] of a c-file, in row order; None for a file without them (a plain file)."""
    raw = (meta.metadata or {}).get(SOURCES_KEY)
    if raw is None:
        return None
    return [(str(name), int(rows)) for name, rows in json.loads(raw)]


SHARD_SUMMARY = ("version", "filtered", "filter_reason", "groups", "completions", "reward_sum")
LEDGER_SUMMARY = ("group_version", "use_index", "records")
# A merged file's summary also sums its cells per block of SUMMARY_BLOCK versions (block = version //
# SUMMARY_BLOCK), beside the per-version cells, with the file's first and last version: `status` reads
# the blocks of a file whose versions are all old enough to share one state, so its cost does not grow
# with the versions a long run piles up (buffer.stats.Blocks). The block cells' columns:
SHARD_BLOCKS = ("block", "filtered", "filter_reason", "groups", "completions", "reward_sum", "first", "last")
LEDGER_BLOCKS = ("block", "use_index", "records", "first", "last")
SUMMARY_BLOCK = 1000


def block_summary(cells: "pa.Table", version: str, keys: list[str], sums: list[str]) -> dict:
    """The block part of a merged file's summary (see read_summary) from its per-version `cells`: the `sums`
    columns summed per (block of the `version` column, *keys), with the block's first and last version
    present, ordered by block and keys; and the file's first and last version."""
    import pyarrow as pa
    import pyarrow.compute as pc

    v = cells.column(version)
    t = pa.table([pa.array(v.to_numpy() // SUMMARY_BLOCK), *(cells.column(k) for k in keys),
                  *(cells.column(c) for c in sums), v, v], names=["block", *keys, *sums, "first", "last"])
    agg = t.group_by(["block", *keys], use_threads=False).aggregate(
        [(c, "sum") for c in sums] + [("first", "min"), ("last", "max")])
    out = pa.table([agg.column(c) for c in ["block", *keys]] + [agg.column(f"{c}_sum") for c in sums]
                   + [agg.column("first_min"), agg.column("last_max")], names=t.column_names)
    out = out.sort_by([(c, "ascending") for c in ["block", *keys]])
    return {"block": SUMMARY_BLOCK, "blocks": pack_columns(out),
            "first": pc.min(v).as_py(), "last": pc.max(v).as_py()}


def pack_columns(table: "pa.Table") -> str:
    """A small table as text for a footer: an Arrow IPC stream, zstd-compressed, base64.

    A merged file's summary has one row per version (100,000 versions after 100,000 steps): as JSON
    lists it took 1.5 s to parse 250,000 of them, as this 0.03 s.
    """
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode("ascii")


def summary_columns(summary: dict, names: tuple[str, ...]) -> dict[str, "np.ndarray"]:
    """A summary's cells as arrays of shape (C,), one per name (SHARD_SUMMARY or LEDGER_SUMMARY), from
    either form read_summary returns."""
    import numpy as np

    if "columns" in summary:
        t = summary_table(summary, names)
        return {n: t.column(n).to_numpy(zero_copy_only=False) for n in names}
    cells = summary["cells"]
    return {n: np.array([c[i] for c in cells], dtype=object if n == "filter_reason" else None)
            for i, n in enumerate(names)}


def summary_table(summary: dict, names: tuple[str, ...], key: str = "columns") -> "pa.Table":
    """A summary's cells as an Arrow table of the columns `names` (no conversion of its strings to Python
    objects: a merged file's summary holds a row per version and state); key "blocks": its block cells."""
    import pyarrow as pa

    if key in summary:
        return pa.ipc.open_stream(base64.b64decode(summary[key])).read_all().select(list(names))
    cells = summary["cells"]
    return pa.table({n: [c[i] for c in cells] for i, n in enumerate(names)})


def read_summary(meta: pq.FileMetaData) -> dict | None:
    """The summary a footer holds, None for a file without one: {"rows": n, and "cells": [[...], ...] (a
    writer's shard: few) or "columns": pack_columns(...) (a merged file)}, the cells being a rollout
    shard's groups per (version, filter flag and reason), SHARD_SUMMARY (filter_reason '' when none), or
    a merged ledger file's records per (group version, use index), LEDGER_SUMMARY; read them with
    summary_columns. A merged file's summary also has "block" (SUMMARY_BLOCK), "blocks" (the cells summed
    per block of versions, SHARD_BLOCKS or LEDGER_BLOCKS, packed) and "first" and "last" (its lowest and
    highest version); one written before them has none of these."""
    raw = (meta.metadata or {}).get(SUMMARY_KEY)
    return None if raw is None else json.loads(raw)


class FileSet:
    """One folder of write-once Parquet files with its manifest; see the module doc.

    folder         where the files are
    manifest_path  the manifest (JSON), replaced atomically under `lock`
    tmp            folder for temp files (same filesystem as `folder`)
    is_member      which names in the folder belong to the set (e.g. 'step-*.parquet')
    is_compacted   which of them are c-files (live only once the manifest lists them)
    c_name         (generation, batch number, source names) -> the name of a c-file
                   merged from them, one that `is_member` and `is_compacted` accept
    """

    def __init__(self, folder: Path, manifest_path: Path, lock: FileLock, tmp: Path, *,
                 is_member: Callable[[str], bool], is_compacted: Callable[[str], bool],
                 c_name: Callable[[int, int, list[str]], str] | None = None):
        self.folder, self.manifest_path, self.lock, self.tmp = folder, manifest_path, lock, tmp
        self.is_member, self.is_compacted = is_member, is_compacted
        self.c_name = c_name or (lambda generation, i, _names: f"c-{generation:06d}-{i:04d}.parquet")
        self._seen = threading.local()   # on an object store: the ETag of this thread's last manifest read

    # -- the manifest --------------------------------------------------------------
    def read_manifest(self) -> Manifest:
        try:
            if isinstance(self.manifest_path, RemotePath):
                got = self.manifest_path.store.read_versioned(self.manifest_path.key)
                self._seen.etag = None if got is None else got[1]   # for write_manifest's If-Match
                if got is None:
                    return Manifest.empty()
                raw = json.loads(got[0])
            else:
                raw = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return Manifest.empty()
        except (OSError, ValueError) as e:
            raise BufferError(f"unreadable manifest {self.manifest_path}: {e}") from e
        try:
            return Manifest(int(raw["generation"]), tuple(raw["compacted"]),
                            {k: float(v) for k, v in raw["replaced"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BufferError(f"unreadable manifest {self.manifest_path}: {type(e).__name__}: {e}") from e

    def write_manifest(self, m: Manifest) -> None:
        """Replace the manifest atomically; the caller holds the lock (and read it under the lock).

        On an object store the write is conditional on the manifest being the one this thread read last
        (If-Match on its ETag): a lock holder whose lease lapsed (a long pause) cannot overwrite what the
        next holder wrote; its merge is abandoned instead (its c-file never goes live, and is deleted as
        an orphan later), so nothing is lost or counted twice."""
        raw = {"generation": m.generation, "compacted": list(m.compacted), "replaced": m.replaced}
        data = json.dumps(raw, indent=1).encode()
        if isinstance(self.manifest_path, RemotePath):
            etag = self.manifest_path.store.replace_if(self.manifest_path.key, data, getattr(self._seen, "etag", None))
            if etag is None:
                raise BufferError(f"{self.manifest_path} was changed by another process while this one held "
                                  "the lock (its lease lapsed); this change is abandoned, nothing is lost")
            self._seen.etag = etag
            return
        with atomic_file(self.tmp, self.manifest_path) as f:
            f.write(data)

    # -- listing ---------------------------------------------------------------------
    def _live(self) -> dict[str, object]:
        """The live files' names (sorted) -> their listing entries (see buffer.store.list_entries)."""
        manifest = self.read_manifest()
        compacted = set(manifest.compacted)
        try:
            entries = list_entries(self.folder)
        except FileNotFoundError:
            return {}
        return {n: entries[n] for n in sorted(entries) if self.is_member(n) and n not in manifest.replaced
                and (n in compacted or not self.is_compacted(n))}

    def live_names(self) -> list[str]:
        """Names of the live files, sorted (first the manifest, then the listing: see module doc)."""
        return list(self._live())

    def live(self) -> list[Path]:
        if isinstance(self.folder, RemotePath):
            return [RemotePath(self.folder.store, f"{self.folder.key}/{n}", e) for n, e in self._live().items()]
        return [self.folder / n for n in self._live()]

    # -- compaction ------------------------------------------------------------------
    def swap(self, manifest: Manifest, new: Iterable[str], sources: Iterable[str], now: float) -> Manifest:
        """The manifest with c-files `new` live and `sources` replaced at `now`, written; caller holds the lock."""
        compacted = [n for n in manifest.compacted if n not in set(sources)]
        compacted += list(new)
        replaced = dict(manifest.replaced)
        replaced.update({n: now for n in sources})
        m = replace(manifest, generation=manifest.generation + 1, compacted=tuple(compacted), replaced=replaced)
        self.write_manifest(m)
        return m

    def withdraw(self, manifest: Manifest, new: list[str], gone: list[str], dispose: Callable[[str], None]) -> None:
        """Undo files (a resume "as of step k"): c-files `new` become live and files `gone` invisible, in one
        manifest write; then `dispose(name)` moves or deletes each gone file; then their names leave the
        manifest, so a new file may take them. A reader never sees a gone file after the first write, and a
        kill -9 in between leaves them replaced (the next withdraw or the grace deletion finishes). Caller
        holds the lock; `manifest` is what it read under it."""
        if not (new or gone):
            return
        now, gone_set = time.time(), set(gone)
        hidden = Manifest(manifest.generation + 1,
                          tuple(n for n in manifest.compacted if n not in gone_set) + tuple(new),
                          {**manifest.replaced, **{n: manifest.replaced.get(n, now) for n in gone}})
        self.write_manifest(hidden)
        for name in gone:
            dispose(name)
        self.write_manifest(replace(hidden, replaced={k: v for k, v in hidden.replaced.items() if k not in gone_set}))

    def delete_expired(self, grace_s: float, now: float | None = None) -> int:
        """Delete files replaced more than `grace_s` ago, then drop them from the manifest; caller holds the lock.

        Also deletes orphan c-files: written by a merge killed before its manifest
        write, never live (every merge runs under the lock, so none is in flight).
        """
        now = time.time() if now is None else now
        manifest = self.read_manifest()
        listed = set(manifest.compacted) | set(manifest.replaced)
        try:
            names = list_names(self.folder)
        except FileNotFoundError:
            names = []
        for n in names:
            if self.is_member(n) and self.is_compacted(n) and n not in listed:
                (self.folder / n).unlink(missing_ok=True)
        expired = [n for n, t in manifest.replaced.items() if now - t >= grace_s]
        for n in expired:
            (self.folder / n).unlink(missing_ok=True)
        if expired:
            self.write_manifest(replace(manifest, replaced={k: v for k, v in manifest.replaced.items()
                                                            if k not in set(expired)}))
        return len(expired)

    def merge_tables(self, names: list[str], out_name: str, *, sort_by: str | None = None,
                     summary: Callable[[pa.Table], dict] | None = None) -> int:
        """Write the small files `names` as one c-file `out_name` (invisible until `swap`); its rows.

        Every source is read whole (ledger and metrics files are small); columns
        a source lacks read as null (metrics rows gain keys over a run). The
        footer names the sources and their rows in order. With `sort_by`, the
        sources are taken in the order of that column's first value. With `summary`,
        the footer also holds summary(merged table) under SUMMARY_KEY (see read_summary).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [(n, read_table(self.folder / n)) for n in names]
        if sort_by is not None:
            tables.sort(key=lambda nt: (nt[1].column(sort_by)[0].as_py() if nt[1].num_rows else -1, nt[0]))
        merged = pa.concat_tables([t.replace_schema_metadata(None) for _, t in tables],
                                  promote_options="permissive")
        sources = [[n, t.num_rows] for n, t in tables]
        meta = {SOURCES_KEY: json.dumps(sources).encode()}
        if summary is not None:
            meta[SUMMARY_KEY] = json.dumps(summary(merged)).encode()
        merged = merged.replace_schema_metadata(meta)
        with atomic_file(self.tmp, self.folder / out_name) as f:
            pq.write_table(merged, f, compression="zstd")
        return merged.num_rows
