"""Appending groups: group statistics, the filter flag, and write-once Parquet shards.

A `ShardWriter` keeps finished groups in memory and writes one shard every
`flush_groups` groups or `flush_seconds` seconds (checked on each append and by
`flush_if_due`), and on close. A shard is written to tmp/ and renamed into
shards/, so a reader never sees a partial file and a kill -9 loses only the
groups not yet flushed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from buffer.layout import BufferDir, BufferError, atomic_file
from buffer.schema import ROLLOUT_SCHEMA, FilterReason, parquet_write_options

StdMode = Literal["sample", "population", "none"]
FINISH_REASONS = ("stop", "length")


@dataclass
class Completion:
    """One sampled completion and its score."""

    text: str
    token_ids: Sequence[int] | np.ndarray
    logprobs: Sequence[float] | np.ndarray
    """Behaviour log-prob of each token in `token_ids`: log_softmax(logits / T)."""
    reward: float
    finish_reason: str = "stop"
    reward_components: Mapping[str, float] = field(default_factory=dict)
    correct: bool | None = None
    reward_error: str | None = None


@dataclass
class Group:
    """The G completions of one prompt, sampled with one weight version."""

    prompt_id: str
    prompt: str
    prompt_ids: Sequence[int] | np.ndarray
    version: int
    completions: list[Completion]
    task: str = "default"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None


def group_reward_stats(rewards: Sequence[float], std: StdMode = "sample",
                       eps: float = 1e-6) -> tuple[float, float, np.ndarray]:
    """Mean, std and advantages of one group's rewards (G,).

    A_i = (r_i - mean(r)) / (std(r) + eps); std is the unbiased sample std
    ("sample", as verl and TRL), the population std, or 1 ("none", Dr. GRPO,
    where A_i = r_i - mean). An all-equal group gives std 0 and zeros.
    The stored advantage is for inspection; the trainer recomputes its own.
    """
    r = np.asarray(rewards, dtype=np.float64)
    mean = float(r.mean())
    if r.max() == r.min():
        return mean, 0.0, np.zeros(len(r), dtype=np.float32)
    sd = float(r.std(ddof=1 if std == "sample" else 0))
    denom = 1.0 if std == "none" else sd + eps
    return mean, sd, ((r - mean) / denom).astype(np.float32)


def filter_reason(rewards: Sequence[float], correct: Sequence[bool | None]) -> FilterReason | None:
    """Why a group carries no gradient (all rewards equal), or None if it does."""
    if max(rewards) != min(rewards):
        return None
    if all(c is True for c in correct):
        return "all_correct"
    if all(c is False for c in correct):
        return "all_wrong"
    return "all_equal"


def _check_group(g: Group) -> None:
    where = f"group for prompt_id={g.prompt_id!r}"
    if not g.completions:
        raise BufferError(f"{where}: no completions")
    if not isinstance(g.version, (int, np.integer)) or g.version < 0:
        raise BufferError(f"{where}: version must be an integer >= 0, got {g.version!r}")
    for i, c in enumerate(g.completions):
        if len(c.token_ids) != len(c.logprobs):
            raise BufferError(f"{where}, completion {i}: {len(c.token_ids)} token_ids but "
                              f"{len(c.logprobs)} logprobs; they must match one to one")
        if not isinstance(c.reward, (int, float, np.floating, np.integer)) or not math.isfinite(c.reward):
            raise BufferError(f"{where}, completion {i}: reward must be a finite number, got {c.reward!r}")
        if c.finish_reason not in FINISH_REASONS:
            raise BufferError(f"{where}, completion {i}: finish_reason must be one of "
                              f"{FINISH_REASONS}, got {c.finish_reason!r}")


def _list_array(chunks: list[np.ndarray], value_type: pa.DataType, np_type) -> pa.ListArray:
    lengths = np.fromiter((len(c) for c in chunks), dtype=np.int32, count=len(chunks))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(chunks).astype(np_type, copy=False) if chunks else np.zeros(0, np_type)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


class ShardWriter:
    """Appends whole groups to a buffer; one writer per process."""

    def __init__(self, root: str | os.PathLike, *, generator_id: str = "generator",
                 flush_groups: int = 64, flush_seconds: float | None = 10.0,
                 advantage_std: StdMode = "sample", eps: float = 1e-6, fsync: bool = True):
        if flush_groups < 1:
            raise BufferError(f"flush_groups must be >= 1, got {flush_groups}")
        if flush_seconds is not None and flush_seconds <= 0:
            raise BufferError(f"flush_seconds must be > 0 or None, got {flush_seconds}")
        self.dir = BufferDir(root, create=True)
        self.dir.clean_tmp()
        self.generator_id = generator_id
        self.writer_id = self.dir.allocate_writer_id(generator_id)
        self.flush_groups, self.flush_seconds = flush_groups, flush_seconds
        self.advantage_std, self.eps, self.fsync = advantage_std, eps, fsync
        self._seq = 0          # shards written
        self._next_group = 0   # groups appended
        self._pending: list[tuple[Group, str, float]] = []
        self._oldest_pending: float | None = None
        self.shards_written: list[Path] = []

    def append(self, group: Group) -> str:
        """Queue one group; returns its group_id. Flushes when a limit is reached."""
        _check_group(group)
        group_id = f"{self.writer_id}-{self._next_group:08d}"
        self._next_group += 1
        now = time.time()
        self._pending.append((group, group_id, now))
        if self._oldest_pending is None:
            self._oldest_pending = now
        if len(self._pending) >= self.flush_groups:
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
        return len(self._pending)

    def flush(self) -> Path | None:
        """Write every waiting group as one shard (tmp, then rename). None if none wait."""
        if not self._pending:
            return None
        table = self._build_table(self._pending)
        final = self.dir.shards / f"{self.writer_id}-{self._seq:06d}.parquet"
        with atomic_file(self.dir.tmp, final, fsync=self.fsync) as f:
            pq.write_table(table, f, **parquet_write_options())
        self._seq += 1
        self._pending, self._oldest_pending = [], None
        self.shards_written.append(final)
        return final

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build_table(self, pending: list[tuple[Group, str, float]]) -> pa.Table:
        cols: dict[str, list] = {name: [] for name in ROLLOUT_SCHEMA.names}
        prompt_ids, completion_ids, logprobs = [], [], []
        comp_keys, comp_vals, comp_lens = [], [], []
        for g, group_id, created in pending:
            rewards = [c.reward for c in g.completions]
            mean, sd, adv = group_reward_stats(rewards, self.advantage_std, self.eps)
            reason = filter_reason(rewards, [c.correct for c in g.completions])
            pids = np.asarray(g.prompt_ids, dtype=np.int32)
            n = len(g.completions)
            created_us = int(created * 1e6)
            for i, c in enumerate(g.completions):
                ids = np.asarray(c.token_ids, dtype=np.int32)
                cols["traj_id"].append(f"{group_id}-{i}")
                cols["sample_index"].append(i)
                cols["completion"].append(c.text)
                cols["num_tokens"].append(len(ids))
                cols["finish_reason"].append(c.finish_reason)
                cols["reward"].append(float(c.reward))
                cols["reward_error"].append(c.reward_error)
                cols["correct"].append(c.correct)
                completion_ids.append(ids)
                logprobs.append(np.asarray(c.logprobs, dtype=np.float32))
                prompt_ids.append(pids)
                comp_keys.extend(c.reward_components.keys())
                comp_vals.extend(float(v) for v in c.reward_components.values())
                comp_lens.append(len(c.reward_components))
            cols["advantage"].extend(adv.tolist())
            for name, value in (("group_id", group_id), ("group_size", n), ("prompt_id", g.prompt_id),
                                ("task", g.task), ("prompt", g.prompt), ("group_reward_mean", mean),
                                ("group_reward_std", sd), ("filtered", reason is not None),
                                ("filter_reason", reason), ("version", int(g.version)),
                                ("generator_id", self.generator_id), ("writer_id", self.writer_id),
                                ("created_at", created_us), ("temperature", g.temperature),
                                ("top_p", g.top_p), ("top_k", g.top_k)):
                cols[name].extend([value] * n)
        arrays = {}
        for f in ROLLOUT_SCHEMA:
            if f.name == "prompt_ids":
                arrays[f.name] = _list_array(prompt_ids, pa.int32(), np.int32)
            elif f.name == "completion_ids":
                arrays[f.name] = _list_array(completion_ids, pa.int32(), np.int32)
            elif f.name == "behavior_logprobs":
                arrays[f.name] = _list_array(logprobs, pa.float32(), np.float32)
            elif f.name == "reward_components":
                offsets = np.zeros(len(comp_lens) + 1, dtype=np.int32)
                np.cumsum(comp_lens, out=offsets[1:])
                arrays[f.name] = pa.MapArray.from_arrays(
                    pa.array(offsets), pa.array(comp_keys, pa.string()), pa.array(comp_vals, pa.float64()))
            else:
                arrays[f.name] = pa.array(cols[f.name], type=f.type)
        table = pa.Table.from_pydict(arrays, schema=ROLLOUT_SCHEMA)
        return table.replace_schema_metadata({"asyncgrpo.groups": str(len(pending))})
