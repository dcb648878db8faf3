"""Pulling groups for the trainer, and the consumption ledger.

Only the trainer pulls, and only the trainer writes ledger/: a `Sampler` holds
`ledger.lock` for as long as it is open, so a second trainer on the same buffer
is an error, not a silent double count. Every pull writes one ledger shard
`step-<trainer_step>-<seq>.parquet` (temp + rename) before returning, so a
crash after a pull can never forget it.

Resume: `Sampler(root, as_of_step=k)` moves ledger records of steps after k
to ledger/abandoned/ (kept for audit, invisible to replay and SQL), so a
trainer restored from its checkpoint at step k is offered exactly the groups
it had not trained on by then. A merged ledger file (buffer.compact_ledger)
that spans step k is cut there, under the buffer's lock: the records up to k
become a new merged file, swapped in through the ledger's manifest, and the
whole old file goes to abandoned/.

The sampler's index drops groups that can never be pulled again (filtered,
or consumed `reuse` times; buffer.index), so its memory follows the groups
still waiting, not the length of the run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from filelock import Timeout

from buffer.fileset import SOURCES_KEY, read_sources
from buffer.index import ELIGIBLE, GroupIndex
from buffer.layout import BufferDir, BufferError, atomic_file, is_ledger_c_name, is_ledger_name, ledger_range
from buffer.store import StoreError, list_names, move, parquet_file, store_lock
from buffer.schema import LEDGER_SCHEMA, staleness

Order = Literal["oldest", "newest", "uniform"]
ORDERS: tuple[Order, ...] = ("oldest", "newest", "uniform")
CACHE_BYTES = 256 << 20  # decoded row groups a sampler keeps for later pulls


@dataclass
class Batch:
    """Groups pulled for one trainer step: rows in pull order, each group's rows together."""

    table: pa.Table            # one row per completion (B = sum of group sizes), ordered by group
    group_ids: list[str]       # (N,) in pull order
    versions: np.ndarray       # (N,) policy version of each group
    staleness: np.ndarray      # (N,) trainer_version - version
    trainer_step: int
    trainer_version: int

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)


class Sampler:
    """Staleness-limited pulls of whole groups, with the ledger replayed on open."""

    def __init__(self, root: str | os.PathLike, *, as_of_step: int | None = None, reuse: int = 1,
                 order: Order = "oldest", seed: int = 0, cache_bytes: int = CACHE_BYTES):
        if reuse < 1:
            raise BufferError(f"reuse must be >= 1 (times a group may be trained on), got {reuse}")
        if order not in ORDERS:
            raise BufferError(f"order must be one of {ORDERS}, got {order!r}")
        if cache_bytes < 0:
            raise BufferError(f"cache_bytes must be >= 0 (0: no cache), got {cache_bytes}")
        if as_of_step is not None and as_of_step < 0:
            raise BufferError(f"as_of_step must be >= 0, got {as_of_step}")
        self.dir = BufferDir(root)
        self.reuse, self.order, self.seed = reuse, order, seed
        self._lock = store_lock(self.dir.root / "ledger.lock")
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise BufferError(f"another trainer holds {self.dir.root / 'ledger.lock'}; "
                              "one trainer per buffer") from None
        try:
            self._open(as_of_step, reuse, cache_bytes)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, as_of_step: int | None, reuse: int, cache_bytes: int) -> None:
        if as_of_step is not None:
            self._abandon_after(as_of_step)
        self.index = GroupIndex(self.dir.root, quarantine=True, retire=True, reuse=reuse)
        self.cache_bytes = cache_bytes
        self._cache: dict[tuple[int, int], pa.Table] = {}   # (file_idx, row group) -> rows, LRU first
        self._cache_bytes = 0
        # Ledger names: 'step-<step>-<seq>'; a step written again (a restart without as_of_step) takes
        # sequence numbers after those on disk, live or replaced, so no name is ever reused.
        names = [n for n in list_names(self.dir.ledger) if is_ledger_name(n)]
        names += list(self.dir.ledger_set.read_manifest().replaced)   # also those deleted, still in the manifest
        self._disk_last_step = max((ledger_range(n)[1] for n in names), default=-1)
        self._seq_step, self._seq_next = -1, 0

    def _abandon_after(self, step: int) -> None:
        """Move the ledger records of steps after `step` to abandoned/ (see module doc).

        Under the buffer's lock (against a compactor merging ledger files meanwhile), in
        three writes, so a reader never sees an abandoned record and a kill -9 at any
        point leaves the cut done or to be redone: (1) one manifest write makes the cut
        files live and every file after the step (live, replaced, or named by the
        manifest only) replaced; (2) the files move to abandoned/; (3) their names leave
        the manifest, so a new step may take them again.
        """
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        fs = self.dir.ledger_set
        with self.dir.lock:
            manifest = fs.read_manifest()
            new, gone = [], []
            for name in sorted(set(list_names(self.dir.ledger)) | set(manifest.replaced)):
                if not is_ledger_name(name):
                    continue
                first, last = ledger_range(name)
                if last <= step:
                    continue
                live = name in manifest.compacted or (name not in manifest.replaced and not is_ledger_c_name(name))
                if live and first <= step:   # a merged file across the step: keep its records up to it
                    new.append(self._cut(name, step, manifest.generation + 1, len(new)))
                if live or name in manifest.replaced:
                    gone.append(name)

            def dispose(name: str) -> None:
                try:
                    move(self.dir.ledger / name, self.dir.abandoned / f"{stamp}-{name}")
                except FileNotFoundError:
                    pass

            fs.withdraw(manifest, new, gone, dispose)

    def _cut(self, name: str, step: int, generation: int, i: int) -> str:
        """A merged ledger file's records of steps <= `step`, as a new merged file (not yet live); its name."""
        pf = parquet_file(self.dir.ledger / name)
        t = pf.read()
        keep = pc.less_equal(t.column("trainer_step"), step)
        kept = t.filter(keep)
        sources = read_sources(pf.metadata) or [[name, t.num_rows]]
        kept_sources, at = [], 0
        mask = keep.to_numpy(zero_copy_only=False)
        for src, rows in sources:
            n = int(mask[at: at + rows].sum())
            if n:
                kept_sources.append([src, n])
            at += rows
        first = ledger_range(name)[0]
        last = int(pc.max(kept.column("trainer_step")).as_py()) if kept.num_rows else first
        out = f"step-{first:09d}-c{generation:06d}r{i:02d}-{last:09d}.parquet"
        kept = kept.replace_schema_metadata({SOURCES_KEY: json.dumps(kept_sources).encode()})
        with atomic_file(self.dir.tmp, self.dir.ledger / out) as f:
            pq.write_table(kept, f, compression="zstd")
        return out

    def close(self) -> None:
        self._cache.clear()
        self._cache_bytes = 0
        if self._lock.is_locked:
            self._lock.release()

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def counts(self, trainer_version: int, max_staleness: int | None, *, by_version: bool = True) -> dict:
        self.index.refresh()
        return self.index.counts(trainer_version, max_staleness, self.reuse, by_version=by_version)

    def pull(self, n: int, *, trainer_version: int, trainer_step: int,
             max_staleness: int | None) -> Batch | None:
        """Take `n` eligible groups and record them in the ledger; None if fewer than n are eligible.

        Eligible: not filtered, used fewer than `reuse` times, 0 <= staleness <= max_staleness.
        Order: groups used fewer times first (so reuse makes passes), then by `order`
        (oldest: lowest version, then earliest appended, so data is used before it expires).
        """
        if n < 1:
            raise BufferError(f"pull size must be >= 1, got {n}")
        if max_staleness is not None and max_staleness < 0:
            raise BufferError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        idx = self.index
        idx.refresh()
        while True:
            eligible = np.flatnonzero(idx.states(trainer_version, max_staleness, self.reuse) == ELIGIBLE)
            if len(eligible) < n:
                return None
            chosen = self._choose(eligible, n, trainer_step)
            group_ids = [idx.group_ids[i] for i in chosen]
            table = self._read_groups(chosen, group_ids)
            if table is not None:
                break  # else a shard was quarantined: choose again among what is left
        versions = idx.version.view[chosen].copy()
        self._record(group_ids, versions, idx.use_count.view[chosen].copy(), trainer_step, trainer_version)
        idx.use_count.view[chosen] += 1
        return Batch(table, group_ids, versions, staleness(trainer_version, versions),
                     trainer_step, trainer_version)

    def _choose(self, eligible: np.ndarray, n: int, trainer_step: int) -> np.ndarray:
        idx = self.index
        uses = idx.use_count.view[eligible]
        if self.order == "uniform":
            rng = np.random.default_rng([self.seed, trainer_step])
            key = rng.permutation(len(eligible))
            order = np.lexsort((key, uses))
        else:
            sign = 1 if self.order == "oldest" else -1
            order = np.lexsort((sign * eligible, sign * idx.created_us.view[eligible],
                                sign * idx.version.view[eligible], uses))
        return eligible[order[:n]]

    def _read_groups(self, chosen: np.ndarray, group_ids: list[str]) -> pa.Table | None:
        """Rows of the chosen groups in pull order; None if a shard proved unreadable.

        Reads only the row groups that hold a chosen group (decoded row groups
        of recent pulls come from the cache) and takes the groups' rows by
        position (the index knows each group's row group and first row), then
        checks every row's group_id against the index.
        """
        idx = self.index
        files = idx.file_idx.view[chosen]
        row_group = idx.row_group.view[chosen]
        base = np.zeros(len(chosen), dtype=np.int64)   # first row of each group in the concatenation
        parts, offset = [], 0
        for fidx in np.unique(files).tolist():
            here = np.flatnonzero(files == fidx)
            rgs = np.unique(row_group[here]).tolist()
            tables = self._row_groups(fidx, rgs)
            if tables is None:
                return None
            rg_rows = np.array([t.num_rows for t in tables], dtype=np.int64)
            rg_first = offset + np.cumsum(rg_rows) - rg_rows
            base[here] = rg_first[np.searchsorted(rgs, row_group[here])] + idx.row_start.view[chosen[here]]
            offset += int(rg_rows.sum())
            parts.extend(tables)
        table = pa.concat_tables(parts, promote_options="default")
        sizes = idx.group_size.view[chosen].astype(np.int64)
        ends = np.cumsum(sizes)
        rows = np.repeat(base - (ends - sizes), sizes) + np.arange(int(ends[-1]))
        want = np.repeat(np.arange(len(chosen)), sizes)
        ok = rows < table.num_rows
        if ok.all():
            table = table.take(pa.array(rows))
            got = pa.array(group_ids).take(pa.array(want))
            ok = pc.equal(table.column("group_id"), got).to_numpy(zero_copy_only=False)
        if not ok.all():
            bad = int(want[np.argmin(ok)])
            idx.mark_unreadable(idx.files[files[bad]], f"partial group {group_ids[bad]!r}")
            return None
        return table

    @property
    def cached_bytes(self) -> int:
        """Bytes of decoded row groups held for later pulls (at most `cache_bytes` after a pull)."""
        return self._cache_bytes

    def _row_groups(self, fidx: int, rgs: list[int]) -> list[pa.Table] | None:
        """Row groups `rgs` of shard `fidx`, decoded, from the cache or the file; None if unreadable.

        Shards never change, and oldest-first pulls come back to the same recent
        shards (a shard holds groups of several versions, pulled at different
        steps), so decoded row groups are kept up to `cache_bytes`, least
        recently used dropped first.
        """
        cache = self._cache
        path = self.index.files[fidx]
        key = path.name          # file names never repeat (file_idx may be renumbered as files are forgotten)
        missing = [r for r in rgs if (key, r) not in cache]
        if missing:
            try:
                pf = parquet_file(path, page_checksum_verification=True)
                # One read per row group: each cached part then owns its buffers, so dropping it frees
                # them. Slices of one multi-row-group read share buffers that live while any slice is
                # cached, and count only their own rows: the cache held ~2x its bound that way.
                parts = [(r, pf.read_row_group(r)) for r in missing]
            except StoreError:   # the store unreachable: not a damaged file
                raise
            except Exception as e:  # noqa: BLE001 - FileNotFound (deleted) or corrupt data pages
                self.index.mark_unreadable(path, f"unreadable during pull: {type(e).__name__}: {e}")
                return None
            for r, part in parts:
                cache[(key, r)] = part
                self._cache_bytes += part.get_total_buffer_size()
        out = []
        for r in rgs:
            part = cache.pop((key, r))
            cache[(key, r)] = part   # most recently used last
            out.append(part)
        while self._cache_bytes > self.cache_bytes and cache:
            self._cache_bytes -= cache.pop(next(iter(cache))).get_total_buffer_size()
        return out

    def _next_seq(self, step: int) -> int:
        if step != self._seq_step:
            self._seq_step, self._seq_next = step, 0
            if step <= self._disk_last_step:   # the step has files already (live, replaced or merged)
                names = set(list_names(self.dir.ledger)) | set(self.dir.ledger_set.read_manifest().replaced)
                taken = [int(n.split("-")[2].removesuffix(".parquet")) for n in names
                         if is_ledger_name(n) and not is_ledger_c_name(n) and ledger_range(n)[0] == step]
                self._seq_next = max(taken, default=-1) + 1
        seq = self._seq_next
        self._seq_next += 1
        return seq

    def _record(self, group_ids: list[str], versions: np.ndarray, uses: np.ndarray,
                trainer_step: int, trainer_version: int) -> Path:
        seq = self._next_seq(trainer_step)
        now_us = int(time.time() * 1e6)
        n = len(group_ids)
        table = pa.table({
            "group_id": pa.array(group_ids, pa.string()),
            "trainer_step": pa.array(np.full(n, trainer_step, np.int64)),
            "trainer_version": pa.array(np.full(n, trainer_version, np.int64)),
            "group_version": pa.array(versions.astype(np.int64)),
            "staleness": pa.array(staleness(trainer_version, versions).astype(np.int64)),
            "use_index": pa.array(uses.astype(np.int32)),
            "consumed_at": pa.array(np.full(n, now_us, np.int64)).cast(pa.timestamp("us", tz="UTC")),
        }, schema=LEDGER_SCHEMA)
        final = self.dir.ledger / f"step-{trainer_step:09d}-{seq:04d}.parquet"
        if hasattr(self._lock, "assert_held"):   # on an object store: only while the trainer lease is ours
            self._lock.assert_held()
        with atomic_file(self.dir.tmp, final) as f:
            pq.write_table(table, f, compression="zstd")
        self.index.mark_ledger_seen(final.name)
        return final
