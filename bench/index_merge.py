"""What a daemon's index pays when a level merge goes live: the c-file's footer, or every row's ids.

    python bench/index_merge.py [--groups 100000] [--repeats 3] [--buffer PATH] [--dir /tmp] [--keep]

Builds a buffer of `--groups` synthetic groups (pipeline.demo.synthetic_group, G = 8, shards of
32 groups as a generator flushes them, one 32-group pull a version with max staleness 2) merged
into c-files of 4,096 groups (the compactor's base merges); or copies `--buffer` (a buffer or run
directory, e.g. a soak's). Then, for each repeat and mode, in a fresh process on a fresh copy: it
indexes the buffer as a daemon does (`GroupIndex(retire=True)`), runs one `compact()` pass with
level merges (fanout 2, no size limit), and times the index's next refresh while sampling the
process's resident memory every 2 ms. Arrow allocates with malloc, as in the daemons.

Modes, alternating in order:
  footer  what the index does: a c-file whose sources it has read is followed from its footer;
  read    the same index with that path off, so it reads every c-file whole (before 081d41c).

Progress goes to stderr; the last line on stdout is one JSON object: each run's figures, the
medians per mode (refresh_s, rss_peak_mib: above the memory before the refresh, rss_kept_mib:
after it) and read/footer ratios, the groups the level merges rewrote and the new files' size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GROUP_SIZE = 8
FLUSH_GROUPS = 32
GROUPS_PER_STEP = 32
MAX_STALENESS = 2
MODES = ("footer", "read")


def log(msg: str) -> None:
    print(f"[bench/index_merge {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(root: Path, groups: int, seed: int) -> None:
    from buffer import Sampler, ShardWriter, compact
    from pipeline.demo import synthetic_group

    rng = np.random.default_rng(seed)
    per_version = 2 * GROUPS_PER_STEP
    with ShardWriter(root, generator_id="bench-generator", flush_groups=FLUSH_GROUPS, flush_seconds=None,
                     fsync=False) as writer, Sampler(root) as sampler:
        for written in range(groups):
            v = written // per_version
            writer.append(synthetic_group(rng, v, GROUP_SIZE, written, min(0.95, 0.3 + 0.6 * written / groups)))
            if (written + 1) % per_version == 0:
                writer.wait()
                sampler.pull(GROUPS_PER_STEP, trainer_version=v, trainer_step=v + 1, max_staleness=MAX_STALENESS)
            if (written + 1) % max(1, groups // 10) == 0:
                log(f"  {written + 1:,} groups written")
    r = compact(root, min_age_s=0.0, grace_s=0.0)
    log(f"  base merges: {r.merged_files} shards -> {r.written_files} c-files")


def child(mode: str, root: Path) -> dict:
    """One measurement in this process (see the module doc)."""
    from buffer import GroupIndex, compact
    from buffer.layout import BufferDir
    from workers.proc import rss_mb

    if mode == "read":
        GroupIndex._merge_plan = lambda self, meta, rg_rows: None
    index = GroupIndex(root, retire=True)
    before = {p.name for p in BufferDir(root).live_shards()}
    report = compact(root, target_groups=4096, fanout=2, max_bytes=None, min_age_s=0.0, grace_s=3600.0)
    new = [p for p in BufferDir(root).live_shards() if p.name not in before]
    base = rss_mb()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    index.refresh()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return {"mode": mode, "refresh_s": round(seconds, 4), "rss_peak_mib": round(peak[0] - base, 1),
            "rss_kept_mib": round(rss_mb() - base, 1), "groups_merged": report.groups,
            "level_files": report.written_files, "new_mib": round(sum(p.stat().st_size for p in new) / 2**20, 1),
            "held": len(index), "retired": index.retired}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python bench/index_merge.py --groups 100000 --repeats 3",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=100_000, help="groups in the built buffer (default 100,000)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (default 3)")
    ap.add_argument("--buffer", type=Path, default=None, help="measure a copy of this buffer or run directory")
    ap.add_argument("--dir", type=Path, default=None, help="where the temp dir goes (default: the system's)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "BUFFER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from workers.proc import use_system_allocator

    use_system_allocator()   # as the daemons (and inherited by the children), before pyarrow's import
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    if args.groups < 1 or args.repeats < 1:
        ap.error(f"--groups and --repeats must be >= 1, got {args.groups} and {args.repeats}")
    from buffer.layout import find_buffer

    tmp = Path(tempfile.mkdtemp(prefix="index-merge-", dir=args.dir))
    try:
        if args.buffer is not None:
            source = find_buffer(args.buffer)
            log(f"copying {source}")
        else:
            source = tmp / "source" / "buffer"
            log(f"building {args.groups:,} groups in {source}")
            build(source, args.groups, args.seed)
        runs = []
        for i in range(args.repeats):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                copy = tmp / "run" / "buffer"
                shutil.rmtree(copy.parent, ignore_errors=True)
                shutil.copytree(source, copy)
                out = subprocess.run([sys.executable, __file__, "--child", mode, str(copy)], capture_output=True,
                                     text=True, check=False)
                if out.returncode != 0:
                    sys.exit(f"bench/index_merge: the {mode} run failed:\n{out.stderr}")
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                log(f"  {mode}: {runs[-1]}")
        med = {m: {k: statistics.median(r[k] for r in runs if r["mode"] == m)
                   for k in ("refresh_s", "rss_peak_mib", "rss_kept_mib")} for m in MODES}
        result = {"groups_merged": runs[0]["groups_merged"], "new_mib": runs[0]["new_mib"],
                  **{f"{k}_{m}": v for m in MODES for k, v in med[m].items()},
                  "refresh_ratio": round(med["read"]["refresh_s"] / max(med["footer"]["refresh_s"], 1e-4), 1),
                  "runs": runs}
        print(json.dumps(result))
    finally:
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
