"""Per-step metrics: combining micro-batch metrics, and writing rows as Parquet shards.

Shards are `<run>/metrics/steps-<first>-<last>.parquet` (zero-padded step
numbers), one row per step, written to metrics/tmp/ and renamed, so the
buffer's SQL view `metrics` never sees a partial file. The compactor merges
them into `steps-<first>-<last>-c<generation>.parquet`; the live files are
those the folder's manifest says (buffer.layout.run_file_set). Rows are
written every `metrics_flush_seconds` and at every checkpoint, so on a resume
from the checkpoint at step k the rows of steps after k are exactly those to
delete (`truncate_after`) before the steps are taken again: a step never has
two rows.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from buffer.layout import atomic_file, clean_tmp_dir, run_file_set
from buffer.store import RemotePath, list_names, read_table

# policy_loss metrics that are sums over micro-batches (global normaliser or counts);
# each is divided by the number of inner epochs, so a step reports one epoch's worth.
_SUMMED = ("loss/total", "loss/policy", "loss/kl", "loss/entropy_bonus")


def _kind(key: str) -> str:
    if key in _SUMMED or key.endswith("_count") or key in ("loss/num_tokens", "loss/num_seqs", "is/num_units"):
        return "sum"
    if key.endswith("/max") or key.endswith("_max"):
        return "max"
    if key.endswith("/min") or key.endswith("_min"):
        return "min"
    return "is_mean" if key.startswith("is/") else "token_mean"


class LossMetrics:
    """Combines `policy_loss` metrics over micro-batches, epochs and ranks into step values.

    Token means are weighted by the micro-batch's completion tokens (is/ means by
    its importance units), sums are added, maxima and minima taken, so the result
    is the full batch's value whatever the split.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.max: dict[str, float] = {}
        self.min: dict[str, float] = {}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        tokens = float(metrics["loss/num_tokens"])
        units = float(metrics.get("is/num_units", tokens))
        for k, v in metrics.items():
            v = float(v)
            kind = _kind(k)
            if kind == "sum":
                self.sums[k] = self.sums.get(k, 0.0) + v
            elif kind == "max":
                self.max[k] = max(self.max.get(k, -math.inf), v)
            elif kind == "min":
                self.min[k] = min(self.min.get(k, math.inf), v)
            else:
                w = units if kind == "is_mean" else tokens
                self.sums[k] = self.sums.get(k, 0.0) + v * w
        self.sums["__w_token_mean"] = self.sums.get("__w_token_mean", 0.0) + tokens
        self.sums["__w_is_mean"] = self.sums.get("__w_is_mean", 0.0) + units

    def result(self, dist, epochs: int) -> dict[str, float]:
        """Step values, reduced over ranks (every rank calls this; rank 0's keys rule, since
        it always has rows, and a rank without some key contributes a neutral value)."""
        keys, maxk, mink = dist.broadcast((sorted(self.sums), sorted(self.max), sorted(self.min)))
        sums = dist.all_reduce(torch.tensor([self.sums.get(k, 0.0) for k in keys], dtype=torch.float64))
        mx = dist.all_reduce(torch.tensor([self.max.get(k, -math.inf) for k in maxk], dtype=torch.float64), "max")
        mn = dist.all_reduce(torch.tensor([self.min.get(k, math.inf) for k in mink], dtype=torch.float64), "min")
        total = dict(zip(keys, sums.tolist()))
        out: dict[str, float] = {}
        for k, v in total.items():
            if k.startswith("__w_"):
                continue
            kind = _kind(k)
            if kind == "sum":
                out[k] = v / epochs
            else:
                w = total["__w_" + kind]
                out[k] = v / w if w > 0 else 0.0
        out.update(zip(maxk, mx.tolist()))
        out.update(zip(mink, mn.tolist()))
        return out


class MetricsWriter:
    """Buffers step rows and writes them as Parquet shards (temp + rename)."""

    def __init__(self, root: str | os.PathLike, flush_seconds: float) -> None:
        self.root = root if isinstance(root, RemotePath) else Path(root)
        self.tmp = self.root / "tmp"
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(exist_ok=True)
        clean_tmp_dir(self.tmp)   # a crashed writer's leftovers (not a running compactor's)
        self.files = run_file_set(self.root, "metrics")
        self.flush_seconds = flush_seconds
        self.pending: list[dict] = []
        self._oldest: float | None = None

    def truncate_after(self, step: int) -> int:
        """Delete rows of steps > `step`; returns the live rows dropped.

        Under the folder's compaction lock, in three writes (as the ledger's resume
        cut, buffer.Sampler): one manifest write makes a file across the step,
        rewritten as a merged file of its rows up to the step, live, and every file
        after the step (live, replaced, or named by the manifest only) replaced; the
        files are deleted; their names leave the manifest, so the steps taken again
        may reuse them. A reader never sees a row after the step.
        """
        fs = self.files
        dropped = 0
        with fs.lock:
            manifest = fs.read_manifest()
            live = set(fs.live_names())
            new, gone = [], []
            for name in sorted((set(list_names(self.root)) | set(manifest.replaced))):
                if not fs.is_member(name):
                    continue
                first, last = (int(x) for x in name.removesuffix(".parquet").split("-")[1:3])
                if last <= step:
                    continue
                if name in live:
                    t = read_table(self.root / name)
                    keep = t.filter(pc.less_equal(t.column("step"), step))
                    dropped += t.num_rows - keep.num_rows
                    if keep.num_rows:
                        out = f"steps-{first:09d}-{step:09d}-c{manifest.generation + 1:06d}{len(new):02d}.parquet"
                        with atomic_file(self.tmp, self.root / out) as f:
                            pq.write_table(keep, f, compression="zstd")
                        new.append(out)
                if name in live or name in manifest.replaced:
                    gone.append(name)
            fs.withdraw(manifest, new, gone, lambda name: (self.root / name).unlink(missing_ok=True))
        return dropped

    def add(self, row: dict) -> None:
        self.pending.append(row)
        if self._oldest is None:
            self._oldest = time.time()
        if time.time() - self._oldest >= self.flush_seconds:
            self.flush()

    def flush(self) -> Path | None:
        if not self.pending:
            return None
        table = pa.Table.from_pylist(self.pending)
        path = self._write(table, int(self.pending[0]["step"]), int(self.pending[-1]["step"]))
        self.pending, self._oldest = [], None
        return path

    def _write(self, table: pa.Table, first: int, last: int) -> Path:
        final = self.root / f"steps-{first:09d}-{last:09d}.parquet"
        with atomic_file(self.tmp, final) as f:
            pq.write_table(table, f, compression="zstd")
        return final
