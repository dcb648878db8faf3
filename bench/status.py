"""How long `asyncgrpo status` takes on a buffer the size of the default run's.

    python bench/status.py [--versions 914] [--groups-per-version 82] [--repeats 3] [--no-compact]
                           [--dir /tmp] [--keep] [--buffer PATH] [-- STATUS ARGS...]

Builds a buffer in a temp dir with the project's own ShardWriter, Sampler and
compact(), of the size `make run` leaves (what `asyncgrpo status` was slow on):
`--versions` policy versions, `--groups-per-version` groups of G = 8 short
arithmetic-like completions each (about 75k groups, 600k completions), shards
of 32 groups (the generator's flush_groups), one 32-group pull per version
with max staleness 2 (so about 900 ledger shards), and one compaction at 7/8
of the run, so the buffer holds c-files plus a few hundred w-shards written
after it (`--no-compact`: about 2,400 w-shards, as a run nobody compacted).
Per-prompt accuracy rises with the version, so filtered groups (all_correct,
all_wrong) come and go as in a real run.

Then it runs `asyncgrpo status BUFFER` (plus any arguments after `--`) as a
subprocess `--repeats` times, stdout discarded, and reports the median wall
time. With `--buffer PATH` it times that buffer or run directory instead of
building one (e.g. a multi-day run's).

Progress goes to stderr; the last line on stdout is one JSON object: the
median and every timing in seconds, and the buffer's size (versions, groups,
completions, live w- and c-shards, ledger shards, bytes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from buffer import Sampler, ShardWriter, compact  # noqa: E402
from buffer.layout import BufferDir, find_buffer  # noqa: E402
from pipeline.demo import synthetic_group  # noqa: E402

GROUP_SIZE = 8
FLUSH_GROUPS = 32      # the generator's default flush_groups
GROUPS_PER_STEP = 32   # the trainer's default groups_per_step
MAX_STALENESS = 2
COMPACT_AT = 7 / 8     # share of the versions written before compaction runs


def log(msg: str) -> None:
    print(f"[bench/status {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(root: Path, versions: int, groups_per_version: int, seed: int, compact_at: float | None) -> None:
    rng = np.random.default_rng(seed)
    writer = ShardWriter(root, generator_id="bench-generator", flush_groups=FLUSH_GROUPS,
                         flush_seconds=None, fsync=False)
    sampler = Sampler(root)
    t0, written, pulls = time.perf_counter(), 0, 0
    try:
        for v in range(versions):
            for _ in range(groups_per_version):
                accuracy = min(0.95, 0.3 + 0.4 * v / versions)
                writer.append(synthetic_group(rng, v, GROUP_SIZE, written, accuracy, spread=(0.2, 1.6)))
                written += 1
            writer.wait()
            if sampler.pull(GROUPS_PER_STEP, trainer_version=v, trainer_step=v + 1,
                            max_staleness=MAX_STALENESS) is not None:
                pulls += 1
            if compact_at is not None and v == int(versions * compact_at):
                writer.flush()
                writer.wait()
                r = compact(root, min_age_s=0.0, grace_s=0.0)
                log(f"  compaction at version {v}: {r.merged_files} shards -> {r.written_files} c-files")
            if (v + 1) % max(1, versions // 10) == 0:
                log(f"  version {v + 1}/{versions}: {written:,} groups, {pulls} pulls, "
                    f"{time.perf_counter() - t0:.0f} s")
    finally:
        writer.close()
        sampler.close()


def size_of(root: Path) -> dict:
    import duckdb

    d = BufferDir(root)
    shards = d.live_shards()
    files = [str(p) for p in shards]
    versions, groups, completions = duckdb.connect().execute(
        f"SELECT count(DISTINCT version), count(DISTINCT group_id), count(*) "
        f"FROM read_parquet({files})").fetchone() if files else (0, 0, 0)
    return {"versions": versions, "groups": groups, "completions": completions,
            "w_shards": sum(p.name.startswith("w") for p in shards),
            "c_shards": sum(p.name.startswith("c-") for p in shards),
            "ledger_shards": len(d.ledger_shards()),
            "bytes": sum(p.stat().st_size for p in shards + d.ledger_shards())}


def time_status(root: Path, extra: list[str], repeats: int) -> list[float]:
    cmd = [sys.executable, "-m", "pipeline", "status", str(root), *extra]
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        times.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise SystemExit(f"asyncgrpo status failed ({r.returncode}): {r.stderr[-2000:]}")
        log(f"  status run {i + 1}/{repeats}: {times[-1]:.3f} s")
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=914, help="policy versions (one pull each)")
    ap.add_argument("--groups-per-version", type=int, default=82, help="groups written per version")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of asyncgrpo status; the median is reported")
    ap.add_argument("--dir", default=None, help="where to build the buffer (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the built buffer afterwards")
    ap.add_argument("--buffer", default=None,
                    help="time this buffer or run directory instead of building one")
    ap.add_argument("--no-compact", action="store_true",
                    help="never compact (a run without `asyncgrpo compact`: thousands of small shards)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("status_args", nargs="*", help="arguments passed on to asyncgrpo status (after --)")
    args = ap.parse_args(argv)

    base = None
    if args.buffer:
        root = find_buffer(args.buffer)
    else:
        base = Path(tempfile.mkdtemp(prefix="bench-status-", dir=args.dir))
        root = base / "buffer"
        log(f"building {args.versions} versions x {args.groups_per_version} groups x {GROUP_SIZE} "
            f"completions in {root}")
        t0 = time.perf_counter()
        build(root, args.versions, args.groups_per_version, args.seed,
              None if args.no_compact else COMPACT_AT)
        log(f"built in {time.perf_counter() - t0:.0f} s")
    try:
        size = size_of(root)
        log(f"buffer: {json.dumps(size)}")
        times = time_status(root, args.status_args, args.repeats)
    finally:
        if base is not None and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        elif base is not None:
            log(f"kept {base}")
    print(json.dumps({"command": f"asyncgrpo status BUFFER {' '.join(args.status_args)}".strip(),
                      "median_s": round(statistics.median(times), 3),
                      "all_s": [round(t, 3) for t in times], "buffer": str(root), **size}))


if __name__ == "__main__":
    main()
