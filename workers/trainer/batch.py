"""Buffer rows -> tensors: the step batch, its advantages, and padded micro-batches.

A step batch is B = sum of group sizes sequences (one per buffer row, groups
contiguous, as the sampler returns them). Each sequence is prompt + completion;
a micro-batch right-pads its sequences to its own longest, so with causal
attention the padding comes after every real token and changes nothing: no
attention mask is needed and positions are 0..L-1, as in an unpadded forward.

The completion tokens of sequence b are predicted by logits at columns
P_b - 1 .. P_b + C_b - 2 (P_b prompt tokens, C_b completion tokens), gathered
into a (b, Tc) layout with Tc the longest completion in the micro-batch.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from workers.grpo import group_advantages

COLUMNS = ["group_id", "prompt_ids", "completion_ids", "behavior_logprobs", "reward", "temperature",
           "version", "correct", "finish_reason", "group_size"]


def _ragged(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets (n + 1,))."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


@dataclass
class StepBatch:
    """The whole step batch on the host: ragged token lists and per-sequence values."""

    prompt_ids: np.ndarray          # flat int64, with prompt_offsets (B + 1,)
    prompt_offsets: np.ndarray
    completion_ids: np.ndarray      # flat int64, with completion_offsets (B + 1,)
    completion_offsets: np.ndarray
    behaviour_logprobs: np.ndarray  # flat float32, aligned with completion_ids
    rewards: np.ndarray             # (B,) float64
    advantages: torch.Tensor        # (B,) float32, per whole group
    temperature: np.ndarray         # (B,) float32
    group_index: np.ndarray         # (B,) int64, 0..N-1 in pull order
    correct: np.ndarray             # (B,) float64: 1, 0 or nan (no judgement)
    truncated: np.ndarray           # (B,) bool: finish_reason == "length"

    @property
    def size(self) -> int:
        return len(self.rewards)

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.diff(self.prompt_offsets)

    @property
    def completion_lengths(self) -> np.ndarray:
        return np.diff(self.completion_offsets)

    @property
    def max_completion(self) -> int:
        return int(self.completion_lengths.max(initial=0))

    def completion_mask(self) -> torch.Tensor:
        """(B, Tmax) bool: True on the completion tokens of each sequence."""
        lens = torch.from_numpy(self.completion_lengths)
        return torch.arange(self.max_completion)[None, :] < lens[:, None]


def step_batch(table: pa.Table, *, std: str = "sample", eps: float = 1e-6) -> StepBatch:
    """The step batch of a pulled table (rows of whole groups, each group contiguous).

    Advantages are recomputed per whole group from the rewards with
    `group_advantages`, before any split into micro-batches.
    """
    if table.num_rows == 0:
        raise ValueError("empty batch: the sampler returned no rows")
    prompt_ids, prompt_offsets = _ragged(table.column("prompt_ids"))
    completion_ids, completion_offsets = _ragged(table.column("completion_ids"))
    logprobs, lp_offsets = _ragged(table.column("behavior_logprobs"))
    if not np.array_equal(lp_offsets, completion_offsets):
        raise ValueError("behavior_logprobs and completion_ids differ in length in some row")
    rewards = table.column("reward").to_numpy().astype(np.float64)
    gids = table.column("group_id").to_pylist()
    starts = np.array([True] + [a != b for a, b in zip(gids[1:], gids[:-1])])
    group_index = np.cumsum(starts) - 1                              # (B,) 0..N-1
    if len(set(gids)) != int(starts.sum()):
        raise ValueError("a group's rows are not contiguous in the pulled table")
    advantages = _advantages(rewards, group_index, std, eps)
    correct = np.array([np.nan if c is None else float(c) for c in table.column("correct").to_pylist()])
    truncated = np.asarray(pc.equal(table.column("finish_reason"), "length").to_pylist(), dtype=bool)
    return StepBatch(
        prompt_ids=prompt_ids.astype(np.int64), prompt_offsets=prompt_offsets,
        completion_ids=completion_ids.astype(np.int64), completion_offsets=completion_offsets,
        behaviour_logprobs=logprobs.astype(np.float32), rewards=rewards, advantages=advantages,
        temperature=table.column("temperature").to_numpy().astype(np.float32),
        group_index=group_index, correct=correct, truncated=truncated)


def _advantages(rewards: np.ndarray, group_index: np.ndarray, std: str, eps: float) -> torch.Tensor:
    """(B,) group-normalised advantages; groups of equal size in one call, others one by one."""
    r = torch.from_numpy(rewards)                                    # (B,) float64
    sizes = np.bincount(group_index)                                 # (N,)
    if (sizes == sizes[0]).all():
        adv = group_advantages(r.reshape(len(sizes), int(sizes[0])), std=std, eps=eps).reshape(-1)
    else:
        adv = torch.empty_like(r)
        for g in range(len(sizes)):
            rows = torch.from_numpy(np.flatnonzero(group_index == g))
            adv[rows] = group_advantages(r[rows][None, :], std=std, eps=eps)[0]
    return adv.to(torch.float32)


@dataclass
class MicroBatch:
    """b sequences of one micro-batch as padded tensors."""

    rows: torch.Tensor                # (b,) long: row of each sequence in the step batch
    input_ids: torch.Tensor           # (b, L) long: prompt + completion, right-padded with pad_id
    logit_index: torch.Tensor         # (b, Tc) long: column of the logits that scores completion token t
    completion_ids: torch.Tensor      # (b, Tc) long, pad_id where masked
    mask: torch.Tensor                # (b, Tc) bool: True on completion tokens
    behaviour_logprobs: torch.Tensor  # (b, Tc) float32, 0 where masked
    advantages: torch.Tensor          # (b,) float32
    temperature: torch.Tensor         # (b,) float32

    def to(self, device) -> "MicroBatch":
        return MicroBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def make_micro_batch(batch: StepBatch, rows: np.ndarray, pad_id: int) -> MicroBatch:
    """Padded tensors for the sequences `rows` (indices into the step batch)."""
    p_len = batch.prompt_lengths[rows]                               # (b,)
    c_len = batch.completion_lengths[rows]                           # (b,)
    b, length, tc = len(rows), int((p_len + c_len).max()), int(c_len.max(initial=0))
    input_ids = np.full((b, length), pad_id, np.int64)
    completion = np.full((b, tc), pad_id, np.int64)
    mu = np.zeros((b, tc), np.float32)
    logit_index = np.zeros((b, tc), np.int64)
    for i, r in enumerate(rows):
        ps, pe = batch.prompt_offsets[r], batch.prompt_offsets[r + 1]
        cs, ce = batch.completion_offsets[r], batch.completion_offsets[r + 1]
        p, c = pe - ps, ce - cs
        input_ids[i, :p] = batch.prompt_ids[ps:pe]
        input_ids[i, p:p + c] = batch.completion_ids[cs:ce]
        completion[i, :c] = batch.completion_ids[cs:ce]
        mu[i, :c] = batch.behaviour_logprobs[cs:ce]
        # Logit column p - 1 + t predicts completion token t; masked columns point at column 0.
        logit_index[i, :c] = np.arange(p - 1, p - 1 + c)
    if (p_len < 1).any():
        raise ValueError("a sequence has an empty prompt; the first completion token needs a preceding token")
    mask = torch.arange(tc)[None, :] < torch.from_numpy(c_len)[:, None]
    return MicroBatch(
        rows=torch.from_numpy(np.asarray(rows, np.int64)), input_ids=torch.from_numpy(input_ids),
        logit_index=torch.from_numpy(logit_index), completion_ids=torch.from_numpy(completion), mask=mask,
        behaviour_logprobs=torch.from_numpy(mu), advantages=batch.advantages[torch.from_numpy(np.asarray(rows))],
        temperature=torch.from_numpy(batch.temperature[rows]))


def table_to_bytes(table: pa.Table) -> bytes:
    """Arrow IPC stream bytes of `table` (what rank 0 broadcasts)."""
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def table_from_bytes(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
