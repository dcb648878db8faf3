"""What a full-scan SQL aggregate costs at a tenth of the rows, same files and layout.

    python bench/aggregate_floor.py BUFFER [--fraction 0.1] [--repeats 9] [--load 0] [--dir /tmp] [--keep]

The soak's target (issue 16) asks the aggregate "mean reward by version" to
take, at the last tenth of the run, at most 1.5x what it took at the first
tenth, with ten times the rows. This bench asks how much of that a full scan
of `rollouts` can meet at all: it takes a buffer (e.g. the final buffer a
`bench/soak.py --keep` run leaves) and writes a thin copy of it, with the same
files, the same row-group size and the project's Parquet settings
(`buffer.schema.parquet_write_options`), but `--fraction` of the rows (of
each file with k row groups, the first max(1, round(k * fraction)); of a file
of one row group, its first rows). Then it times, on a fresh DuckDB
connection each call, over each copy alternately (full, thin, full, ...;
medians of `--repeats`):

  count_ms       SELECT count(*) FROM rollouts: rows from the footers, no column read, so the
                 fixed part (connection, view, a footer per file)
  read_ms        SELECT sum(version), sum(reward): reads the aggregate's two columns, no grouping
  aggregate_ms   SELECT version, avg(reward) FROM rollouts GROUP BY version: the soak's aggregate

with the views the buffer's SQL builds (`buffer.sql._scan_sql` over the live
shards). `--load N` runs N busy processes beside it (the soak's daemons keep
both cores busy), started before the first call and stopped at the end.

Progress goes to stderr; the last line on stdout is one JSON object: rows and
files of each copy, each figure's median per copy, and full / thin ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from buffer.layout import BufferDir, find_buffer  # noqa: E402
from buffer.schema import ROLLOUT_SCHEMA, parquet_write_options  # noqa: E402
from buffer.sql import _scan_sql, offline_connection  # noqa: E402

QUERIES = {
    "count_ms": "SELECT count(*) FROM rollouts",
    "read_ms": "SELECT sum(version), sum(reward) FROM rollouts",
    "aggregate_ms": "SELECT version, avg(reward) AS reward FROM rollouts GROUP BY version",
}


def log(msg: str) -> None:
    print(f"[bench/aggregate_floor {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def thin_copy(files: list[Path], out: Path, fraction: float) -> int:
    """Write `fraction` of each file's rows to `out`, in the file's own row-group size; the rows written."""
    out.mkdir(parents=True)
    rows = 0
    for i, src in enumerate(files):
        f = pq.ParquetFile(src)
        k = f.num_row_groups
        if k > 1:
            t = f.read_row_groups(list(range(max(1, round(k * fraction)))))
            group_rows = f.metadata.row_group(0).num_rows
        else:
            t = f.read()
            t = t.slice(0, max(1, math.ceil(t.num_rows * fraction)))
            group_rows = t.num_rows
        with pq.ParquetWriter(out / f"{i:06d}.parquet", t.schema.remove_metadata(),
                              **parquet_write_options()) as w:
            w.write_table(t, row_group_size=max(group_rows, 1))
        rows += t.num_rows
    return rows


def timed(files: list[Path], sql: str) -> float:
    t0 = time.perf_counter()
    con = offline_connection()
    try:
        con.execute(f"CREATE VIEW rollouts AS {_scan_sql(files, ROLLOUT_SCHEMA, False)}")
        con.sql(sql).fetchall()
    finally:
        con.close()
    return (time.perf_counter() - t0) * 1e3


def rows_of(files: list[Path]) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("buffer", help="a buffer or run directory (e.g. a kept soak's soak-run)")
    ap.add_argument("--fraction", type=float, default=0.1, help="share of the rows in the thin copy")
    ap.add_argument("--repeats", type=int, default=9, help="calls per query and copy (median)")
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the measurements")
    ap.add_argument("--dir", default=None, help="where the thin copy goes (default: the system's temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the thin copy")
    args = ap.parse_args(argv)
    if not 0 < args.fraction < 1:
        ap.error(f"--fraction must be in (0, 1), got {args.fraction}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    try:
        full = BufferDir(find_buffer(args.buffer)).live_shards()
    except Exception as e:  # noqa: BLE001 (the buffer's own error names the path)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not full:
        print(f"error: {args.buffer}: the buffer has no live shards", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="aggfloor-", dir=args.dir))
    busy: list[subprocess.Popen] = []
    try:
        log(f"thin copy of {len(full)} files at {args.fraction} of the rows -> {tmp}")
        thin_rows = thin_copy(full, tmp / "thin", args.fraction)
        thin = sorted((tmp / "thin").glob("*.parquet"))
        full_rows = rows_of(full)
        log(f"full {full_rows:,} rows, thin {thin_rows:,} rows; {args.load} busy processes")
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
        times: dict[str, dict[str, list[float]]] = {c: {q: [] for q in QUERIES} for c in ("full", "thin")}
        for r in range(args.repeats):
            for q, sql in QUERIES.items():
                for copy, files in (("full", full), ("thin", thin)) if r % 2 == 0 else \
                        (("thin", thin), ("full", full)):
                    times[copy][q].append(timed(files, sql))
            log(f"repeat {r + 1}/{args.repeats}: aggregate full {times['full']['aggregate_ms'][-1]:.0f} ms, "
                f"thin {times['thin']['aggregate_ms'][-1]:.0f} ms")
    finally:
        for p in busy:
            p.kill()
            p.wait()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    med = {c: {q: round(statistics.median(v), 1) for q, v in qs.items()} for c, qs in times.items()}
    out = {"files": len(full), "full_rows": full_rows, "thin_rows": thin_rows, "load": args.load,
           "repeats": args.repeats}
    for c in ("full", "thin"):
        for q, v in med[c].items():
            out[f"{q[:-3]}_{c}_ms"] = v
    for q in QUERIES:
        out[f"{q[:-3]}_ratio"] = round(med["full"][q] / med["thin"][q], 3)
    scan_full = med["full"]["aggregate_ms"] - med["full"]["count_ms"]
    out["aggregate_scan_full_ms"] = round(scan_full, 1)
    # The ratio a full scan would reach with this scan and the thin copy's fixed part made
    # as large as needed: ratio <= 1.5 needs fixed >= (scan_full - 1.5 * scan_thin) / 0.5.
    scan_thin = med["thin"]["aggregate_ms"] - med["thin"]["count_ms"]
    out["aggregate_scan_thin_ms"] = round(scan_thin, 1)
    out["fixed_ms_for_1.5x"] = round(max(0.0, (scan_full - 1.5 * scan_thin) / 0.5), 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
