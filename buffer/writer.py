"""Appending groups to a buffer as write-once Parquet shards (groups and their statistics: buffer.groups).

A `ShardWriter` keeps finished groups in memory and writes one shard every
`flush_groups` groups or `flush_seconds` seconds (checked on each append and by
`flush_if_due`), and on close. A shard is written to tmp/ and renamed into
shards/, so a reader never sees a partial file and a kill -9 loses only the
groups not yet flushed.

Shards full at `flush_groups` are built and encoded by `FLUSH_THREADS`
background threads and written, fsynced and renamed by one commit thread,
strictly in sequence (`background=False` does it all inline); `flush`,
`flush_if_due` and `close` wait until every shard is visible. Measured with
bench/buffer.py on 2 cores (four runs): 40,200-46,100 trajectories/s, 1.23-1.56
times plain sequential pq.write_table calls of the same rows with fsync, and
faster than plain writes without fsync (medians 40,600-41,500) in three of the
four runs.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from buffer.groups import FINISH_REASONS, STD_MODES, Group, StdMode, all_equal_reason, ragged_reward_stats
from buffer.fileset import SUMMARY_KEY
from buffer.layout import BufferDir, BufferError, atomic_file
from buffer.schema import ROLLOUT_SCHEMA, parquet_write_options

# Columns with one value per group, repeated on each of its completions' rows.
_PER_GROUP = ["group_id", "group_size", "prompt_id", "task", "prompt", "prompt_ids", "group_reward_mean",
              "group_reward_std", "filtered", "filter_reason", "version", "created_at", "temperature", "top_p",
              "top_k"]


_REWARD_TYPES = (float, int, np.floating, np.integer)


def _check_group(g: Group) -> None:
    """Raise BufferError naming the group (and completion) if `g` cannot be stored."""
    comps = g.completions
    if comps and type(g.version) is int and g.version >= 0:
        for c in comps:   # fast path: float rewards (r - r is 0.0 only for finite r)
            r = c.reward
            if (type(r) is not float or r - r != 0.0 or len(c.token_ids) != len(c.logprobs)
                    or c.finish_reason not in FINISH_REASONS):
                break
        else:
            return
    where = f"group for prompt_id={g.prompt_id!r}"
    if not comps:
        raise BufferError(f"{where}: no completions")
    if not isinstance(g.version, (int, np.integer)) or g.version < 0:
        raise BufferError(f"{where}: version must be an integer >= 0, got {g.version!r}")
    for i, c in enumerate(comps):
        if len(c.token_ids) != len(c.logprobs):
            raise BufferError(f"{where}, completion {i}: {len(c.token_ids)} token_ids but "
                              f"{len(c.logprobs)} logprobs; they must match one to one")
        if not isinstance(c.reward, _REWARD_TYPES) or not math.isfinite(c.reward):
            raise BufferError(f"{where}, completion {i}: reward must be a finite number, got {c.reward!r}")
        if c.finish_reason not in FINISH_REASONS:
            raise BufferError(f"{where}, completion {i}: finish_reason must be one of "
                              f"{FINISH_REASONS}, got {c.finish_reason!r}")


def _list_array(chunks: list, value_type: pa.DataType, np_type) -> pa.ListArray:
    """One list column from R chunks (numpy arrays or sequences), in one pass over them.

    Numpy chunks go through Arrow's converter (a C++ loop; values cast like
    numpy's astype, out-of-range integers rejected); Python lists are read
    with one np.fromiter over all of them.
    """
    if set(map(type, chunks)) <= {np.ndarray}:
        return pa.array(chunks, type=pa.list_(value_type))
    lengths = np.fromiter(map(len, chunks), dtype=np.int32, count=len(chunks))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np_type, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _const_strings(value: str, n: int) -> pa.StringArray:
    """`n` copies of one string, built from buffers."""
    data = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(data)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data * n))


ROW_GROUP_GROUPS = 64
"""Groups per Parquet row group (whole groups: a pull reads whole row groups).
With the default flush of 64 groups a shard is one row group. Smaller ones
cost more than they save (bench/buffer.py data, 2 cores): at 8 groups appends
were 35% slower and an aggregate over 1,563 shards took 1.34 s instead of
0.71 s; at 16 groups, in a paired run, pulls were no faster (groups of lagging
versions are scattered through a shard, so a pull touches most of its row
groups anyway) and the aggregate took 862 ms instead of 508 ms."""


def encode_grouped(table: pa.Table, sizes: list[int], groups_per_row_group: int) -> pa.Buffer:
    """`table` (rows of consecutive groups of `sizes` rows) as a Parquet file in memory, with row
    groups of whole groups. Encoding runs in Arrow's memory, outside the GIL."""
    cuts = np.cumsum(sizes)[groups_per_row_group - 1::groups_per_row_group].tolist()
    if not cuts or cuts[-1] != table.num_rows:
        cuts.append(table.num_rows)
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, table.schema, **parquet_write_options()) as w:
        start = 0
        for end in cuts:
            w.write_table(table.slice(start, end - start), row_group_size=end - start)
            start = end
    return sink.getvalue()


def _write_buffer(f, data: pa.Buffer) -> None:
    f.write(memoryview(data))


FLUSH_THREADS = 2
"""Threads that build and encode full shards. Encoding and compressing run
outside the GIL, so two let the next shard be built while the last one is
compressed. A separate commit thread writes, fsyncs and renames encoded
shards, one at a time and in sequence, so the encoders never wait on the disk:
47,300 trajectories/s against 35,800 with the encoders doing their own fsync
(medians of 5 paired runs, 10,000 groups of bench/buffer.py data). Three
encoders, or more shards in flight, were no faster on 2 cores."""

MAX_IN_FLIGHT = FLUSH_THREADS + 2
"""Shards a writer may have handed off and not yet made visible (bounds memory)."""
SHARDS_REMEMBERED = 4096
"""`ShardWriter.shards_written` keeps the newest this many paths (a writer runs for days)."""


@dataclass
class _Job:
    pending: list[tuple[Group, str, float]]
    seq: int
    final: Path
    encoded: Future | None = None   # the encoded shard
    future: Future | None = None    # done when the shard is visible, or failed


class ShardWriter:
    """Appends whole groups to a buffer; one writer per process (its methods from one thread)."""

    def __init__(self, root: str | os.PathLike, *, generator_id: str = "generator",
                 flush_groups: int = 64, flush_seconds: float | None = 10.0,
                 advantage_std: StdMode = "sample", eps: float = 1e-6, fsync: bool = True,
                 row_group_groups: int = ROW_GROUP_GROUPS, background: bool = True):
        if flush_groups < 1:
            raise BufferError(f"flush_groups must be >= 1, got {flush_groups}")
        if row_group_groups < 1:
            raise BufferError(f"row_group_groups must be >= 1, got {row_group_groups}")
        if flush_seconds is not None and flush_seconds <= 0:
            raise BufferError(f"flush_seconds must be > 0 or None, got {flush_seconds}")
        if advantage_std not in STD_MODES:
            raise BufferError(f"advantage_std must be one of {STD_MODES}, got {advantage_std!r}")
        self.dir = BufferDir(root, create=True)
        self.dir.clean_tmp()
        self.generator_id = generator_id
        self.writer_id = self.dir.allocate_writer_id(generator_id)
        self.flush_groups, self.flush_seconds = flush_groups, flush_seconds
        self.advantage_std, self.eps, self.fsync = advantage_std, eps, fsync
        self.row_group_groups = row_group_groups
        self._seq = 0          # shards written
        self._next_group = 0   # groups appended
        self._pending: list[tuple[Group, str, float]] = []
        self._oldest_pending: float | None = None
        self.shards_written: deque[Path] = deque(maxlen=SHARDS_REMEMBERED)   # the newest, oldest first
        self.num_shards_written = 0
        self.background = background
        self._pool: ThreadPoolExecutor | None = None        # builds and encodes shards
        self._committer: ThreadPoolExecutor | None = None   # writes, fsyncs, renames them in order
        self._inflight: deque[_Job] = deque()   # shards being written, oldest first

    def append(self, group: Group) -> str:
        """Queue one group; returns its group_id. Flushes when a limit is reached.

        With `background` the flush at `flush_groups` groups is handed to the
        flush threads and append returns at once; an error of such a flush
        (disk full) is raised by a later append, flush or close, with the
        groups of the shards that failed back in the queue.
        """
        self._reap()
        _check_group(group)
        group_id = f"{self.writer_id}-{self._next_group:08d}"
        self._next_group += 1
        now = time.time()
        self._pending.append((group, group_id, now))
        if self._oldest_pending is None:
            self._oldest_pending = now
        if len(self._pending) >= self.flush_groups:
            if self.background:
                self._submit()
            else:
                self.flush()
        else:
            self.flush_if_due()
        return group_id

    def flush_if_due(self) -> Path | None:
        """Flush if the oldest waiting group has waited `flush_seconds`."""
        if (self._pending and self.flush_seconds is not None
                and time.time() - self._oldest_pending >= self.flush_seconds):
            return self.flush()
        return None

    @property
    def pending_groups(self) -> int:
        """Groups appended but not yet visible to readers (queued, or in a shard being written)."""
        self._reap(raise_errors=False)
        return len(self._pending) + sum(len(job.pending) for job in self._inflight)

    def flush(self) -> Path | None:
        """Write every waiting group as one shard (tmp, then rename) and wait until every shard
        of this writer is visible. Returns the last shard made visible, None if nothing waited."""
        before = self.num_shards_written
        if self._pending:
            self._submit()
        self._reap(keep=0)
        return self.shards_written[-1] if self.num_shards_written > before else None

    def wait(self) -> None:
        """Wait until every shard handed to the flush threads is visible; queued groups stay queued."""
        self._reap(keep=0)

    def reap(self) -> None:
        """Record the shards made visible so far, without waiting for the others; raises the error
        of a shard that failed (its groups go back to the queue, as with `flush`)."""
        self._reap()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            for pool in (self._pool, self._committer):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._pool = self._committer = None

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the flush pipeline -------------------------------------------------------
    def _submit(self) -> None:
        """Start writing the queued groups as the next shard (inline without `background`)."""
        job = _Job(self._pending, self._seq, self.dir.shards / f"{self.writer_id}-{self._seq:06d}.parquet")
        self._pending, self._oldest_pending = [], None
        self._seq += 1
        if not self.background:
            job.encoded, job.future = Future(), Future()
            try:
                job.encoded.set_result(self._encode(job))
                job.future.set_result(self._commit(job, None))
            except BaseException as e:  # noqa: BLE001 - handed to _reap, which restores and raises
                job.future.set_exception(e)
            self._inflight.append(job)
            self._reap(keep=0)
            return
        while sum(not j.future.done() for j in self._inflight) >= MAX_IN_FLIGHT:  # bounded memory
            wait([j.future for j in self._inflight], return_when=FIRST_COMPLETED)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FLUSH_THREADS, thread_name_prefix=f"encode-{self.writer_id}")
            self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"commit-{self.writer_id}")
        prev = self._inflight[-1].future if self._inflight else None
        job.encoded = self._pool.submit(self._encode, job)
        job.future = self._committer.submit(self._commit, job, prev)
        self._inflight.append(job)

    def _encode(self, job: "_Job") -> pa.Buffer:
        sizes = [len(g.completions) for g, _, _ in job.pending]
        return encode_grouped(self._build_table(job.pending), sizes, self.row_group_groups)

    def _commit(self, job: "_Job", prev: Future | None) -> Path:
        """Make the encoded shard (`job.encoded`) visible: temp file, fsync, rename. Shards become
        visible in sequence: a failed shard stops the ones after it, so what readers see of a
        writer is always its first k shards (`prev`, the previous shard's commit, is done by now:
        one commit thread, first in first out)."""
        if prev is not None:
            prev.result()
        with atomic_file(self.dir.tmp, job.final, fsync=self.fsync) as f:
            _write_buffer(f, job.encoded.result())
        return job.final

    def _reap(self, keep: int | None = None, *, raise_errors: bool = True) -> None:
        """Record finished shards in order; with `keep`, first wait until at most `keep` are in flight.

        If a shard failed, every shard after it failed too (see `_commit`):
        their groups go back to the front of the queue, the sequence number back
        to the failed shard's, and the first error is raised (left in flight
        without `raise_errors`).
        """
        while self._inflight:
            job = self._inflight[0]
            if not job.future.done() and (keep is None or len(self._inflight) <= keep):
                return
            try:
                job.future.result()
            except BaseException:
                if not raise_errors:
                    return
                failed = list(self._inflight)
                self._inflight.clear()
                wait([f for j in failed for f in (j.encoded, j.future)])
                self._pending = [item for j in failed for item in j.pending] + self._pending
                self._oldest_pending = self._pending[0][2]
                self._seq = failed[0].seq
                raise
            self._inflight.popleft()
            self.shards_written.append(job.final)
            self.num_shards_written += 1

    def _build_table(self, pending: list[tuple[Group, str, float]]) -> pa.Table:
        """One Arrow table of the waiting groups, built column by column.

        Per-group columns are built as a P-row table and repeated to one row per
        completion with a single `take`; token ids and log-probs are converted
        once per flush. No per-row Python appends.
        """
        groups = [g for g, _, _ in pending]
        comps = [c for g in groups for c in g.completions]
        n = len(comps)
        sizes_list = [len(g.completions) for g in groups]
        sizes = np.array(sizes_list, dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        rewards = np.array([c.reward for c in comps], dtype=np.float64)
        mean, sd, adv, equal = ragged_reward_stats(rewards, sizes, self.advantage_std, self.eps)
        reasons: list[str | None] = [None] * len(groups)
        for k in np.flatnonzero(equal).tolist():
            reasons[k] = all_equal_reason([c.correct for c in groups[k].completions])
        group_ids = [gid for _, gid, _ in pending]
        per_group = pa.Table.from_arrays([
            pa.array(group_ids, pa.string()),
            pa.array(sizes.astype(np.int32)),
            pa.array([g.prompt_id for g in groups], pa.string()),
            pa.array([g.task for g in groups], pa.string()),
            pa.array([g.prompt for g in groups], pa.string()),
            _list_array([g.prompt_ids for g in groups], pa.int32(), np.int32),
            pa.array(mean),
            pa.array(sd),
            pa.array(equal),
            pa.array(reasons, pa.string()),
            pa.array(np.array([g.version for g in groups], dtype=np.int64)),
            pa.array(np.array([int(t * 1e6) for _, _, t in pending], dtype=np.int64),
                     pa.timestamp("us", tz="UTC")),
            pa.array([g.temperature for g in groups], pa.float32()),
            pa.array([g.top_p for g in groups], pa.float32()),
            pa.array([g.top_k for g in groups], pa.int32()),
        ], names=_PER_GROUP).take(pa.array(np.repeat(np.arange(len(groups)), sizes)))
        components = [c.reward_components for c in comps]
        comp_offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.fromiter(map(len, components), dtype=np.int32, count=n), out=comp_offsets[1:])
        keys = list(itertools.chain.from_iterable(components))
        vals = np.fromiter(itertools.chain.from_iterable(d.values() for d in components), dtype=np.float64,
                           count=len(keys))
        suffixes = [f"-{i}" for i in range(max(sizes_list))]
        completion_ids = _list_array([c.token_ids for c in comps], pa.int32(), np.int32)
        per_row = {
            "traj_id": pa.array([gid + x for gid, size in zip(group_ids, sizes_list) for x in suffixes[:size]],
                                pa.string()),
            "sample_index": pa.array((np.arange(n) - np.repeat(starts, sizes)).astype(np.int32)),
            "completion": pa.array([c.text for c in comps], pa.string()),
            "completion_ids": completion_ids,
            "behavior_logprobs": _list_array([c.logprobs for c in comps], pa.float32(), np.float32),
            "num_tokens": pa.array(np.diff(completion_ids.offsets.to_numpy())),
            "finish_reason": pa.array([c.finish_reason for c in comps], pa.string()),
            "reward": pa.array(rewards),
            "reward_components": pa.MapArray.from_arrays(
                pa.array(comp_offsets), pa.array(keys, pa.string()), pa.array(vals)),
            "reward_error": pa.array([c.reward_error for c in comps], pa.string()),
            "correct": pa.array([c.correct for c in comps], pa.bool_()),
            "advantage": pa.array(adv),
            "generator_id": _const_strings(self.generator_id, n),
            "writer_id": _const_strings(self.writer_id, n),
        }
        columns = [per_row[name] if name in per_row else per_group.column(name) for name in ROLLOUT_SCHEMA.names]
        table = pa.Table.from_arrays(columns, schema=ROLLOUT_SCHEMA)
        cells: dict[tuple[int, bool, str], list] = {}   # what status needs, so it reads no row (buffer.fileset)
        for g, f, r, size, m in zip(groups, equal.tolist(), reasons, sizes_list, mean.tolist()):
            c = cells.setdefault((int(g.version), bool(f), r or ""), [0, 0, 0.0])
            c[0] += 1
            c[1] += size
            c[2] += m * size
        summary = {"rows": n, "cells": [[*k, *v] for k, v in sorted(cells.items())]}
        return table.replace_schema_metadata({"asyncgrpo.groups": str(len(pending)),
                                              SUMMARY_KEY: json.dumps(summary)})
