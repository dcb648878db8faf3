"""A run directory with every file `asyncgrpo plot` and the trackers read, made in a second with no model.

Rollouts come from `pipeline.demo.synthetic_group` through the real ShardWriter and Sampler (so the
ledger holds real staleness); trainer metrics rows carry the columns the trainer writes, with values
that are exact in float32 (k / 16), so a tracker's copy can be compared exactly; generator rows are
those `workers.generator_stats` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import buffer
from pipeline.demo import synthetic_group

T0 = 1_800_000_000.0
GROUPS_PER_STEP = 4


def metrics_row(step: int) -> dict:
    """The metrics row of `step`: every value k / 16 or an integer."""
    return {"step": step, "version": step, "time": T0 + 2.0 * step, "lr": 0.0001,
            "reward/mean": step / 16, "batch/accuracy": (step % 8) / 16, "kl/ref": step / 64,
            "kl/new_behaviour": 1 / 16, "kl/old_behaviour": 2 / 16, "clip/frac": (step % 4) / 16,
            "clip/low_frac": 1 / 32, "clip/high_frac": 1 / 64, "is/truncated_frac": 3 / 16, "is/masked_frac": 0.0,
            "is/mean": 1.0 + step / 128, "clip/ratio_mean": 1.0, "staleness/mean": (step % 3) / 2,
            "staleness/max": float(step % 3), "time/wait_s": 0.25, "time/step_s": 2.0,
            "perf/tokens_per_s": 1000.0 + step, "batch/groups": GROUPS_PER_STEP}


def make_run(run: Path, steps: int = 12, *, metrics_files: int = 2, generator_rows: int = 10) -> Path:
    rng = np.random.default_rng(0)
    root = run / "buffer"
    writer = buffer.ShardWriter(root, generator_id="gen0", flush_groups=64, flush_seconds=None)
    sampler = buffer.Sampler(root)
    for version in range(steps):
        for i in range(GROUPS_PER_STEP + 2):
            writer.append(synthetic_group(rng, version, 4, version * 10 + i))
        writer.flush()
        sampler.pull(GROUPS_PER_STEP, trainer_version=version, trainer_step=version + 1, max_staleness=2)
    writer.close()
    sampler.close()
    (run / "metrics").mkdir()
    cut = np.array_split(np.arange(1, steps + 1), metrics_files)
    for part in cut:
        rows = [metrics_row(int(s)) for s in part]
        pq.write_table(pa.Table.from_pylist(rows), run / "metrics" / f"steps-{part[0]:09d}-{part[-1]:09d}.parquet")
    (run / "generator_metrics").mkdir()
    gen = [{"generator_id": "gen0", "writer_id": "w000000", "batch": b, "version": b, "started_at": T0 + b,
            "wait_s": 0.25, "reload_s": 0.0, "generate_s": 0.5, "score_s": 0.25, "seconds": 1.0, "rss_mb": 400.0,
            "prompts": 6, "groups": 6, "filtered": b % 3, "surplus_groups": 0, "tokens": 100 + b}
           for b in range(generator_rows)]
    pq.write_table(pa.Table.from_pylist(gen), run / "generator_metrics" / "w000000-000000.parquet")
    (run / "run.json").write_text(json.dumps({"eval_before": 0.25, "summary": {"eval_after": 0.5}}))
    return run


def read_wandb_history(run_file: Path) -> list[dict]:
    """The history rows ({key: value}, with "_step") of an offline W&B run's .wandb file.

    The file is a LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
    32 KiB blocks of records, each with a 7-byte header (crc32, length, type: 1 full, 2 first,
    3 middle, 4 last) and a piece of a serialised `wandb_internal_pb2.Record`.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pieces, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        piece = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pieces = piece if kind in (1, 2) else pieces + piece
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pieces)
            if rec.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
    return rows
