"""Soak test (issue 16, "days, not minutes"): does the buffer stay fast and small as a run grows?

    python bench/soak.py [--minutes 60] [--groups 1000000] [--steps 100000] [--out docs/soak]
                         [--dir /tmp] [--keep] [--seed 0] [--profile DIR]

Part 1, synthetic (always runs): a run directory `<tmp>/soak-run/` (a
`config.toml` and `buffer/`, as `asyncgrpo run` lays it out) driven at full
speed by three subprocesses through the project's public entry points:

- WRITER (`bench/soak.py --role writer`): one `buffer.ShardWriter`
  (generator_id "soak-writer", flush_groups 32, fsync on, as the generator)
  appending groups of G = 8 short arithmetic-like completions
  (`pipeline.demo.synthetic_group`, accuracy set so that about 25% of groups
  are filtered: all rewards equal), each stamped with the newest trainer
  version. It obeys the generator's admission rule
  (`buffer.admission_limit`: at most (max_staleness + t + 1) * groups_per_step
  non-filtered groups admitted at trainer version t, max_staleness = 2), so it
  runs ahead of the trainer by a bounded amount; before waiting it flushes,
  as the generator does (the trainer may be waiting for those groups). It
  writes at least `--groups` non-filtered groups (the filtered ones come on
  top, about a third more) and goes on until the coordinator has measured
  the last tenth (so that it is measured under the same load as the first),
  then stops at a whole step's worth and idles until SIGTERM.
- TRAINER (`bench/soak.py --role trainer`): one `buffer.Sampler` pulling
  groups_per_step = groups / steps groups a step (10 by default) with
  trainer_step = steps done + 1, trainer_version = steps done, max_staleness
  2; a pull that returns None is retried after 2 ms. After each step it
  publishes the new version (steps done) in a tiny file that the writer reads
  (a symlink whose target is the number, made under a temp name and
  os.replace'd over the last one: atomic like a temp file + rename, and
  cheaper on ext4, which flushes a renamed file's data). It times every
  successful pull (perf_counter around `Sampler.pull`) and at every tenth of
  `--steps` writes that window's pull percentiles to a small JSON file. Past
  `--steps` it goes on stepping until the writer has stopped and every
  trainable group it wrote is consumed (`steps` in the JSON counts these
  steps too: a few hundred, the time the last tenth's measurements take).
- COMPACTOR: the real daemon, `python -m pipeline compactor --run <run> --set
  compactor.every_s=5 --set compactor.min_age_s=2 --set compactor.grace_s=10
  --set compactor.nice=0` (the writer and the sampler here run flat out, as no
  real run's daemons do, so a compactor that yielded the CPU to them would
  measure the split of the CPU, not the compactor; the real part runs the
  default priority),
  stopped with SIGTERM at the end (whatever it compacts, shards or ledger,
  this bench sees through the public listings below).

The coordinator (this process) pauses nothing; at each tenth of the steps it
measures, while everything runs. The latencies (aggregate, scan, count,
status, host) are taken in `--rounds` rounds (5), one started every
`--round-gap` seconds (8): one call of each a round, and the tenth's figure is
their median (`*_min`: their least; `status_s_spread` in the CSV: every call).
Calls at one moment all meet the same state of the daemons (a level merge runs
for up to ~20 s beside three busy processes on two cores), so a median of calls
at one moment swung 0.23-0.75 s from tenth to tenth; rounds spread over ~35 s
of a 120-300 s tenth sample several of the compactor's states. The buffer grows by
~1% of the run while they are taken.

  aggregate_ms   the issue's "SQL aggregate (mean reward by version)": wall time of
                 `buffer.BufferSQL(run).query("SELECT version, reward_mean AS reward FROM
                 versions")` on a fresh BufferSQL (fresh connection, views rebuilt, every footer
                 read): the versions view has a row per version, summed from the shards' footer
                 sums, so no row is read and its cost follows the live files and the versions
                 rather than the rows (until 12-07 this key was the scan below, and stats_ms
                 the same question from version_stats)
  scan_ms        the same answer from the rows, "SELECT version, avg(reward) AS reward FROM
                 rollouts GROUP BY version", the same way: a scan of every completion's version
                 and reward, which grows with the rows (reported; `scan` in the JSON)
  count_ms       `SELECT count(*) FROM rollouts` the same way: DuckDB counts rows from the footers
                 and reads no column, so this is the fixed part of scan_ms (connection, views,
                 a footer per file); scan_ms - count_ms is its scan of the rows
  pull_p50_ms, pull_p99_ms
                 percentiles of the trainer's successful pulls since the last tenth, leaving out
                 those that overlapped this bench's own measurements below (which grow with the
                 buffer and share the two cores) unless that leaves fewer than a quarter of them
                 (quiet_pulls: how many counted); pull_p50_all_ms, pull_p99_all_ms: every pull
  status_s       wall time of `pipeline.status.buffer_status(run)` in this process: what
                 `asyncgrpo status` costs without Python's start-up (status_cli_s, the CLI as a
                 subprocess, one call in the first round, is measured beside it; its start-up,
                 about 0.5-1 s here, would hide the trend)
  host_ms        a fixed piece of CPU work that reads nothing of the run (`host`): the host's
                 own speed at that moment (these machines are shared; one slowed ~15% within a
                 run), so host_ratio says how much of a latency's ratio is the host's drift
  aggregate_ms_frozen, scan_ms_frozen, status_s_frozen
                 the same calls, in the same rounds (each beside the run's, the two in turn
                 first), on the first
                 tenth's buffer: at the first tenth the run's buffer is linked, file by file, into
                 <dir>/soak-first (`freeze`: hard links under the buffer's lock; the files are
                 write-once). The JSON's `*_side_ratio` (last tenth's figure / the first tenth's
                 buffer's in the same rounds) is the growth with the buffer alone: the host's
                 speed and the daemons' load at that moment are the same for both; the issue's
                 `*_ratio` compares two moments ~25 minutes apart. `*_paired_ratio`: the median
                 of the rounds' own ratios (run / first tenth's buffer, one call after the
                 other), steadier still, since a level merge's load lasts seconds
  live_files     live rollout shards + ledger files + metrics and generator_metrics files, as
                 readers list them through each kind's manifest (`workers.compactor.live_files`)
  writer_rss_mb, sampler_rss_mb, compactor_rss_mb
                 VmRSS of each process, from /proc/<pid>/status (and in the CSV, the sampler's
                 cache and Arrow's allocated bytes: sampler_cache_mb, sampler_arrow_mb, and
                 index_relists, how many times the sampler's index listed the shards again
                 because a listing had raced the writer: buffer/index.py)

At the end the processes are stopped (SIGTERM; the writer flushes) and SQL
checks that no group was consumed twice and that nothing was lost (every
consumed group_id is in `rollouts`, `rollouts` holds exactly the groups the
writer wrote, 8 rows each, and every non-filtered group was consumed).

Part 2, real (skipped with `--minutes 0`): `asyncgrpo run configs/default.toml
--run <tmp>/soak-real --set run.time_limit_s=none` (the time limit is what
ends a default run; trainer.max_steps is unset, i.e. unlimited, by default;
`--set KEY=VALUE` adds overrides) for `--minutes` minutes from the moment its
daemons start (the warm start is cached in runs/.cache), then SIGINT, as
Ctrl-C (the run stops cleanly). Every 5 s: live files (shards, ledger,
metrics, generator_metrics: live ones), kept as each minute's peak and low
(a once-a-minute sample drifts through the compactor's ~30 s cycle, and its
saw-tooth is that drift; the trend is judged on the peaks), with the peaks of
their two parts: the writers' files not merged yet (`unmerged_files_peak`) and
the c-files (`merged_files_peak`), each with its own slope in the JSON. Every
minute: live files, status
time, the SQL aggregate's latency and the scan's (as above) and whether they raised, the newest
"memory/rss_mb" of the trainer and rss_mb of each generator from their
metrics (plus VmRSS of the compactor and the supervisor from /proc), and
afterwards, per minute, the trainer's idle share (sum("time/wait_s") /
sum("time/step_s") of the metrics rows whose "time" falls in that minute), its
steps and mean busy seconds a step (without the wait), and the generators'
groups per second and trainable (non-filtered) share: the idle share rises
either when the pipeline slows or when the policy has learned the task and
most groups are filtered, and these columns tell which (`per_minute_flow`).
Then the same invariants (no group trained twice, every consumed group in
`rollouts`) and a PNG with panels over time: live files, memory per daemon,
status / SQL latency, trainer idle share beside the trainable share.

Written to `--out` (default docs/soak/): soak-synthetic.csv (one row per
tenth), soak-real.csv (one row per minute) and soak-real.png. Progress goes to
stderr; the last line on stdout is one JSON object: each figure at the first
and last tenth (`*_first`, `*_last`), their ratios, `targets` (the issue's:
at the last tenth aggregate <= 1 s, pull p99 <= 250 ms, status <= 1 s, live
files <= 2000; each latency last/first <= 1.5; writer and sampler RSS
last/first <= 1.25) as booleans, `scan` (the scan's against the aggregate's bounds,
not a target), `side_by_side` (each `*_side_ratio` and
`*_paired_ratio_last` <= 1.5, as booleans), the invariants, and under "real" the real
part's figures (live files: the maximum, the maxima of the first and second
half of the minutes and the slope over the second half, all of each minute's peak; RSS per daemon at the
middle minute and the last, and their ratio; query errors; each per-minute
flow figure at minute 5 and at the last minute, e.g. `idle_share_minute5`,
`trainable_share_last`). Exit code: 0 when everything ran and the
invariants hold (targets are reported, not enforced), 1 on an error (a child
died, no trainer step for 5 minutes) or a broken invariant, 130 on Ctrl-C;
every child is stopped either way. The temp dir is removed unless `--keep`.
`--profile DIR` runs the writer and the trainer under cProfile
(DIR/writer.prof, DIR/trainer.prof).

Time: the trainer's pull is the critical path (the writer waits on admission
most of the time), about 17 ms a step on 2 cores with the compactor beside
it: `--groups 100000 --steps 10000` took 171-206 s, so the default scale
takes about 20-35 minutes (1,237 and 1,299 s measured; 1,553-1,741 s on
12-07, the last with the first tenth's buffer measured beside the run). The
"groups" of a tenth's row is the writer's count when the coordinator
measured (a heartbeat, up to 0.5 s old).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GROUP_SIZE = 8
FLUSH_GROUPS = 32          # the generator's flush_groups in this bench
MAX_STALENESS = 2
ACCURACY, SPREAD = 0.69, (0.2, 1.6)   # synthetic_group: about 25% of groups all-correct or all-wrong
PULL_RETRY_S = 0.002       # the trainer's sleep after a pull that found too few eligible groups
WRITER_POLL_S = 0.001      # the writer's sleep while admission holds it back
HEARTBEAT_S = 0.5          # trainer / writer progress files
STALL_S = 300.0            # no trainer step for this long: the bench stops with an error
COMPACTOR_SETTINGS = ["compactor.every_s=5", "compactor.min_age_s=2", "compactor.grace_s=10", "compactor.nice=0"]
# The "SQL aggregate (mean reward by version)", as the buffer answers it: the versions view, a row per
# version summed from the shards' footers (buffer/sql.py, buffer/stats.py), no row read.
AGGREGATE_SQL = "SELECT version, reward_mean AS reward FROM versions"
# The same answer from the rows: a scan of every completion's version and reward, which grows with the rows.
SCAN_SQL = "SELECT version, avg(reward) AS reward FROM rollouts GROUP BY version"
# The fixed part of SCAN_SQL's cost: rows counted from the footers, no column read.
COUNT_SQL = "SELECT count(*) AS n FROM rollouts"
LIVE_EVERY_S = 5.0           # real part: live files are counted this often (each minute: its peak and low)
DECILES = 10
ROUNDS = 5                   # synthetic part: measurement rounds at each tenth (measure_rounds) ...
ROUND_GAP_S = 8.0            # ... one started this often: 5 spread over ~35 s of a 120-300 s tenth


class BenchError(Exception):
    """Something in the bench went wrong (a child died, a stall); the message says what."""


def log(msg: str) -> None:
    print(f"[bench/soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- small shared helpers ----------------------------------------------------------------------
def write_json(path: Path, obj: dict) -> None:
    """Write `obj` to `path` atomically (temp file beside it + os.replace); no fsync: control state."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def rss_mib(pid: int | None) -> float | None:
    """VmRSS of process `pid` in MiB (None if it is gone)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def own_rss_mib() -> float:
    return rss_mib(os.getpid()) or 0.0


class Stop:
    """Set by SIGTERM / SIGINT in a child role: finish cleanly."""

    flag = False

    @classmethod
    def install(cls) -> None:
        def handler(signum, _frame):
            cls.flag = True
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def decile_steps(steps: int) -> list[int]:
    """The step counts at which each tenth of `steps` is reached."""
    return [max(1, round(steps * k / DECILES)) for k in range(1, DECILES + 1)]


# -- role: trainer -----------------------------------------------------------------------------
def trainer_main(args) -> None:
    import pyarrow as pa

    from buffer import Sampler

    Stop.install()
    ctl = Path(args.ctl)
    root = Path(args.run) / "buffer"
    gps = args.groups // args.steps
    version_file = ctl / "version"
    sampler = Sampler(root)      # holds ledger.lock: one trainer per buffer

    def publish(v: int) -> None:
        # A symlink whose target is the number, made under a temp name and renamed over the last
        # one: atomic like a temp file + os.replace, but with no data block for ext4 to flush on the
        # rename (a file costs ~2 ms a step under the buffer's fsyncs, ~10% of a step; this ~0.1 ms).
        tmp = ctl / f".version.{os.getpid()}.tmp"
        os.symlink(str(v), tmp)
        os.replace(tmp, version_file)

    measuring = ctl / "measuring"   # exists while the coordinator runs its SQL / status measurements
    done, pulled, none_pulls, none_s, max_stale = 0, 0, 0, 0.0, 0
    window: list[float] = []        # seconds of each successful pull this tenth
    busy: list[bool] = []           # ... and whether the coordinator was measuring when it started
    bounds = decile_steps(args.steps)
    k = 0
    t_window = time.perf_counter()
    last_beat = 0.0
    publish(0)
    writer_final = None   # the writer's last count of trainable groups, once it has stopped
    try:
        while not Stop.flag:
            if done >= args.steps:   # past the last tenth: go on (the coordinator is measuring under load)
                if writer_final is None:   # until the writer stops, then take what it wrote
                    w = read_json(ctl / "writer.json") or {}
                    writer_final = w.get("trainable") if w.get("done") else None
                if writer_final is not None and done * gps >= writer_final:
                    break
            during = measuring.exists()
            t0 = time.perf_counter()
            batch = sampler.pull(gps, trainer_version=done, trainer_step=done + 1, max_staleness=MAX_STALENESS)
            dt = time.perf_counter() - t0
            if batch is None:
                none_pulls += 1
                none_s += dt
                time.sleep(PULL_RETRY_S)
            else:
                window.append(dt)
                busy.append(during or measuring.exists())
                done += 1
                pulled += batch.num_groups
                max_stale = max(max_stale, int(batch.staleness.max()))
                publish(done)
                while k < DECILES and done >= bounds[k]:
                    ms = np.array(window) * 1e3 if window else np.zeros(1)
                    quiet = ms[~np.array(busy, dtype=bool)] if window else ms
                    quiet = quiet if len(quiet) >= max(20, len(ms) // 4) else ms   # too few: every pull
                    write_json(ctl / f"decile-{k + 1:02d}.json", {
                        "decile": k + 1, "steps": done, "pulls": len(window), "quiet_pulls": len(quiet),
                        "pull_p50_ms": float(np.percentile(quiet, 50)),
                        "pull_p99_ms": float(np.percentile(quiet, 99)),
                        "pull_p50_all_ms": float(np.percentile(ms, 50)),
                        "pull_p99_all_ms": float(np.percentile(ms, 99)),
                        "pull_max_ms": float(ms.max()), "pull_mean_ms": float(ms.mean()),
                        "none_pulls": none_pulls, "none_pull_s": none_s,
                        "window_s": time.perf_counter() - t_window, "trainer_rss_mb": own_rss_mib(),
                        "index_groups": len(sampler.index), "index_relists": sampler.index.relists,
                        "cached_mb": sampler.cached_bytes / 2**20,
                        "arrow_mb": pa.total_allocated_bytes() / 2**20, "time": time.time()})
                    window, busy, none_pulls, none_s = [], [], 0, 0.0
                    t_window = time.perf_counter()
                    k += 1
            now = time.time()
            if now - last_beat >= HEARTBEAT_S:
                write_json(ctl / "trainer.json", {"steps": done, "groups_pulled": pulled, "max_staleness": max_stale,
                                                  "pid": os.getpid(), "time": now})
                last_beat = now
        write_json(ctl / "trainer.json", {"steps": done, "groups_pulled": pulled, "max_staleness": max_stale,
                                          "pid": os.getpid(), "time": time.time(),
                                          "finished": done >= args.steps and writer_final is not None})
        while not Stop.flag:   # stay up (index in memory) until the coordinator has measured and stops us
            time.sleep(0.05)
    finally:
        sampler.close()


# -- role: writer ------------------------------------------------------------------------------
def writer_main(args) -> None:
    from buffer import ShardWriter, admission_limit
    from pipeline.demo import synthetic_group

    Stop.install()
    ctl = Path(args.ctl)
    root = Path(args.run) / "buffer"
    gps = args.groups // args.steps
    target = gps * args.steps          # non-filtered groups: exactly what the trainer will consume
    version_file = ctl / "version"
    rng = np.random.default_rng(args.seed)

    def version() -> int | None:
        try:
            return int(os.readlink(version_file))
        except (FileNotFoundError, ValueError):
            return None

    while version() is None and not Stop.flag:   # the trainer publishes v0 once its sampler is open
        time.sleep(0.01)
    writer = ShardWriter(root, generator_id="soak-writer", flush_groups=FLUSH_GROUPS)  # fsync: the default
    written = admitted = filtered = 0
    blocked_s, blocks = 0.0, 0
    last_beat = 0.0

    def beat(done: bool = False) -> None:
        write_json(ctl / "writer.json", {"groups": written, "trainable": admitted, "filtered": filtered,
                                         "blocked_s": blocked_s, "blocks": blocks, "pid": os.getpid(),
                                         "time": time.time(), "done": done})

    finish = ctl / "finish"   # the coordinator's word that the last tenth is measured
    try:
        while not Stop.flag:
            if admitted >= target and admitted % gps == 0 and finish.exists():
                break   # whole steps only: the trainer takes every trainable group written
            t = version()   # the newest trainer version, read for every group (a few microseconds)
            if admitted >= admission_limit(t, MAX_STALENESS, gps):
                t0 = time.perf_counter()
                if writer.pending_groups:
                    writer.flush()   # the trainer may be waiting for these (as the generator does)
                else:
                    time.sleep(WRITER_POLL_S)
                blocked_s += time.perf_counter() - t0
                blocks += 1
            else:
                g = synthetic_group(rng, t, GROUP_SIZE, written, ACCURACY, SPREAD)
                writer.append(g)
                r0 = g.completions[0].reward
                is_filtered = all(c.reward == r0 for c in g.completions)
                written += 1
                filtered += is_filtered
                admitted += not is_filtered
            now = time.time()
            if now - last_beat >= HEARTBEAT_S:
                beat()
                last_beat = now
        writer.flush()
        beat(done=admitted >= target and not Stop.flag)
        while not Stop.flag:   # stay up until the coordinator has measured and stops us
            time.sleep(0.05)
    finally:
        writer.close()   # flushes whatever is queued (SIGTERM mid-run)
        beat(done=admitted >= target)


# -- children ----------------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """In a child before exec: SIGTERM when the bench dies; a process group of its own (Ctrl-C
    reaches only the bench, which stops children in order)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    os.setpgid(0, 0)


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name, self.argv, self.log_path = name, argv, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         preexec_fn=_child_setup, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.stopping = False
        self.sent: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        """BenchError if the child exited while it should be running."""
        code = self.proc.poll()
        if code is not None and not self.stopping:
            raise BenchError(f"the {self.name} exited with code {code}; its log ({self.log_path}) ends with:\n"
                             f"{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def send(self, sig: int) -> None:
        """Send `sig` once (a second SIGTERM would make a daemon stop at once, without its clean-up)."""
        if sig in self.sent:
            return
        self.sent.add(sig)
        self.stopping = True
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGTERM) -> int:
        """`sig`, wait, kill if it does not stop; its exit code."""
        self.send(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"the {self.name} did not stop within {timeout:.0f} s; killing it")
            self.proc.kill()
            return self.proc.wait()


def stop_all(children: list[Child], timeout: float = 60.0) -> dict[str, int]:
    for c in children:
        c.send(signal.SIGTERM)
    return {c.name: c.stop(timeout) for c in children}


# -- measurements ------------------------------------------------------------------------------
def aggregate(run: Path) -> None:
    """Mean reward by version from the versions view, on a fresh BufferSQL (fresh connection and views,
    every footer read)."""
    from buffer import BufferSQL

    BufferSQL(run).query(AGGREGATE_SQL)


def scan(run: Path) -> None:
    """Mean reward by version from the rows of rollouts, on a fresh BufferSQL."""
    from buffer import BufferSQL

    BufferSQL(run).query(SCAN_SQL)


def count(run: Path) -> None:
    """Rows of rollouts on a fresh BufferSQL: the scan's fixed cost, without reading a column."""
    from buffer import BufferSQL

    BufferSQL(run).query(COUNT_SQL)


def status(run: Path) -> None:
    from pipeline.status import buffer_status

    buffer_status(run)


def timed_status(run: Path) -> float:
    t0 = time.perf_counter()
    status(run)
    return time.perf_counter() - t0


def status_cli(run: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pipeline", "status", str(run)], cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"asyncgrpo status exited with {r.returncode}: {last}")


def measured(fn, run: Path, errors: list[str]) -> float | None:
    """Wall seconds of one call fn(run); None and the error recorded if it raised: a failing query or
    status is a finding of the soak, not a reason to stop it."""
    try:
        t0 = time.perf_counter()
        fn(run)
        return time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        errors.append(f"{fn.__name__}: {type(e).__name__}: {str(e).strip()[-300:]}")
        log(f"  {errors[-1]}")
        return None


def host(_run: Path) -> None:
    """A fixed piece of CPU work that reads nothing of the run (a sort, a Python loop): its time says how
    fast the host ran at that moment, so a latency's ratio can be read against the host's own drift."""
    np.sort(np.random.default_rng(0).random(400_000))
    sum(i * i for i in range(200_000))


def measure_rounds(run: Path, ctl: Path, errors: list[str], rounds: int = ROUNDS,
                   gap_s: float = ROUND_GAP_S, frozen: Path | None = None) -> dict[str, list[float]]:
    """A tenth's latencies: `rounds` rounds, one started every `gap_s` seconds, each one call of the
    aggregate (the versions view), the scan, count(*), status and the host's fixed work (and the status CLI in the
    first round only: its Python start-up would dominate more). Calls at one moment all meet the same
    state of the compactor (a level merge runs for up to ~20 s), so a tenth's figure is the median of
    calls spread over ~half a minute; the trainer is told (the `measuring` file) while a round runs.
    With `frozen` (the first tenth's buffer, `freeze`), each round also times the aggregate,
    the scan and status on it, beside the same call on the run ("<name>_frozen"; the run's first in
    even rounds, the first tenth's in odd ones), and keeps each round's ratio of the two ("<name>_paired").
    Returns each measure's seconds (a failed call is recorded in `errors` and left out)."""
    fns = [aggregate, scan, count, status, host]
    side = {aggregate, scan, status} if frozen is not None else set()
    out: dict[str, list[float]] = {fn.__name__: [] for fn in [*fns, status_cli]}
    out.update({f"{fn.__name__}_{kind}": [] for fn in side for kind in ("frozen", "paired")})
    for r in range(rounds):
        t_next = time.monotonic() + gap_s
        (ctl / "measuring").touch()
        try:
            for fn in fns + ([status_cli] if r == 0 else []):
                if fn not in side:
                    t = measured(fn, run, errors)
                elif r % 2 == 0:    # which of the pair goes first alternates: neither gains from the other
                    t, t_frozen = measured(fn, run, errors), measured(fn, frozen, errors)
                else:
                    t_frozen, t = measured(fn, frozen, errors), measured(fn, run, errors)
                if t is not None:
                    out[fn.__name__].append(t)
                if fn in side and t_frozen is not None:
                    out[f"{fn.__name__}_frozen"].append(t_frozen)
                    if t is not None:   # this round's ratio: both calls met about the same load
                        out[f"{fn.__name__}_paired"].append(t / t_frozen)
        finally:
            (ctl / "measuring").unlink()
        if r < rounds - 1:
            time.sleep(max(0.0, t_next - time.monotonic()))
    return out


def freeze(run: Path, dest: Path) -> None:
    """dest/buffer: the run's buffer as it is now, made of hard links (every file the buffer writes is
    write-once and replaced by rename, manifests too, so a link keeps the file as it was, and
    compaction's later deletions unlink only the run's name), taken under the buffer's lock, so no merge
    goes live or deletes its sources meanwhile. Lock files and temp files are left out. The soak then
    measures it beside the growing buffer in the same rounds: the host's drift and the daemons' load at
    that moment are then the same for both."""
    from buffer import BufferDir

    src = BufferDir(run / "buffer")
    with src.lock:
        for folder, dirs, names in os.walk(src.root):
            rel = Path(folder).relative_to(src.root)
            dirs[:] = [d for d in dirs if d != "tmp"]
            (dest / "buffer" / rel).mkdir(parents=True, exist_ok=True)
            for name in names:
                if not name.endswith(".lock"):
                    os.link(Path(folder) / name, dest / "buffer" / rel / name)


def median(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def least(xs: list[float]) -> float | None:
    return min(xs) if xs else None


def ms(seconds: float | None) -> float | None:
    return rnd(None if seconds is None else seconds * 1e3, 1)


def live_files(run: Path) -> dict:
    """Live files of a run, as the readers list them (through each kind's manifest): shards, ledger,
    the trainer's metrics and the generators' metrics (workers.compactor.live_files)."""
    from workers.compactor import live_files as live

    n = live(run)
    out = {"live_shards": n["shards"], "ledger_files": n["ledger"], "metrics_files": n["metrics"],
           "generator_metrics_files": n["generator_metrics"]}
    out["live_files"] = sum(out.values())
    return out


def live_and_unmerged(run: Path) -> tuple[int, int]:
    """All live files of a run, and those of them not merged yet (as their writers left them), from one
    listing of each kind's manifest, so the two counts agree."""
    from buffer import unmerged_count
    from workers.compactor import run_file_sets

    live = unmerged = 0
    for fs in run_file_sets(run).values():
        names = fs.live_names()
        live += len(names)
        unmerged += unmerged_count(fs, names)
    return live, unmerged


def invariants(run: Path) -> dict:
    """No group consumed twice; every consumed group in rollouts (SQL over the run)."""
    from buffer import BufferSQL

    sql = BufferSQL(run)

    def one(q: str):
        return sql.query(q).column(0)[0].as_py()

    return {
        "trained_twice": one("SELECT count(*) FROM (SELECT group_id FROM consumed GROUP BY 1 HAVING count(*) > 1)"),
        "lost": one("SELECT count(*) FROM (SELECT DISTINCT group_id FROM consumed) c "
                    "WHERE NOT EXISTS (SELECT 1 FROM rollouts r WHERE r.group_id = c.group_id)"),
        "consumed_rows": one("SELECT count(*) FROM consumed"),
        "max_staleness_consumed": one("SELECT max(staleness) FROM consumed"),
        "rollout_groups": one("SELECT count(DISTINCT group_id) FROM rollouts"),
        "rollout_rows": one("SELECT count(*) FROM rollouts"),
        "trainable_not_consumed": one("SELECT count(*) FROM (SELECT DISTINCT group_id FROM rollouts "
                                      "WHERE NOT filtered) r WHERE NOT EXISTS "
                                      "(SELECT 1 FROM consumed c WHERE c.group_id = r.group_id)"),
    }


def ratio(last, first):
    if last is None or first is None or first == 0:
        return None
    return round(last / first, 3)


def rnd(x, nd=3):
    return None if x is None else round(float(x), nd)


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


# -- part 1: synthetic -------------------------------------------------------------------------
def write_run_config(run: Path) -> None:
    """<run>/config.toml: the resolved defaults with the soak's compactor settings, as a run saves it,
    so `asyncgrpo compactor --run <run>` finds its config."""
    from pipeline.config import load_config, save_config

    save_config(load_config(None, COMPACTOR_SETTINGS), run / "config.toml")


def synthetic(base: Path, args, state: dict) -> dict:
    import buffer.sql  # noqa: F401 - imported before anything is timed
    import pipeline.status  # noqa: F401
    from buffer import BufferDir

    run = base / "soak-run"
    ctl = base / "soak-ctl"          # the bench's own control files, outside the run
    frozen = base / "soak-first"     # the run's buffer at the first tenth (freeze), measured beside it
    ctl.mkdir(parents=True)
    BufferDir(run / "buffer", create=True)
    write_run_config(run)
    gps = args.groups // args.steps
    log(f"synthetic: {args.steps:,} steps x {gps} groups (= {gps * args.steps:,} trainable groups, about "
        f"{gps * args.steps / 0.75:,.0f} with the filtered ones) in {run}")
    role = [sys.executable, str(Path(__file__).resolve()), "--run", str(run), "--ctl", str(ctl),
            "--groups", str(args.groups), "--steps", str(args.steps), "--seed", str(args.seed),
            *(["--profile", str(Path(args.profile).absolute())] if args.profile else []), "--role"]
    children: list[Child] = state["children"]
    t_start = time.time()
    trainer = Child("trainer", role + ["trainer"], run / "logs" / "trainer.log")
    children.append(trainer)
    while not (ctl / "version").is_symlink():     # the sampler is open, v0 published
        trainer.check()
        time.sleep(0.05)
    writer = Child("writer", role + ["writer"], run / "logs" / "writer.log")
    children.append(writer)
    compactor = Child("compactor", [sys.executable, "-m", "pipeline", "compactor", "--run", str(run),
                                    *sum((["--set", s] for s in COMPACTOR_SETTINGS), [])],
                      run / "logs" / "compactor.log")
    children.append(compactor)

    rows: list[dict] = state["synthetic_rows"]
    errors: list[str] = []     # failed measurements (SQL, status), counted and reported
    last_steps, last_progress = -1, time.time()
    for k in range(1, DECILES + 1):
        path = ctl / f"decile-{k:02d}.json"
        while (d := read_json(path)) is None:
            for c in children:
                c.check()
            tr = read_json(ctl / "trainer.json") or {}
            if tr.get("steps", 0) != last_steps:
                last_steps, last_progress = tr.get("steps", 0), time.time()
            elif time.time() - last_progress > STALL_S:
                raise BenchError(f"no trainer step for {STALL_S:.0f} s at step {last_steps} (writer: "
                                 f"{read_json(ctl / 'writer.json')}); logs in {run / 'logs'}")
            time.sleep(0.2)
        w = read_json(ctl / "writer.json") or {}
        rss = {"writer_rss_mb": rss_mib(writer.pid), "sampler_rss_mb": rss_mib(trainer.pid),
               "compactor_rss_mb": rss_mib(compactor.pid)}
        files = live_files(run)
        if k == 1:
            freeze(run, frozen)
        took = measure_rounds(run, ctl, errors, args.rounds, args.round_gap, frozen)
        agg, sc, cnt, st, st_cli, cpu = (took[key] for key in ("aggregate", "scan", "count", "status",
                                                                 "status_cli", "host"))
        side = {f"{name}_frozen": (ms if unit == "ms" else rnd)(median(took[f"{fn}_frozen"]))
                for fn, name, unit in (("scan", "scan_ms", "ms"), ("aggregate", "aggregate_ms", "ms"),
                                       ("status", "status_s", "s"))}
        side.update({f"{fn}_paired_ratio": rnd(median(took[f"{fn}_paired"])) for fn in ("scan", "aggregate", "status")})
        row = {"decile": k, "steps": d["steps"], "groups": w.get("groups"), "trainable_groups": w.get("trainable"),
               "elapsed_s": round(time.time() - t_start, 1), "window_s": round(d["window_s"], 2),
               "aggregate_ms": ms(median(agg)), "aggregate_ms_min": ms(least(agg)),
               "scan_ms": ms(median(sc)), "scan_ms_min": ms(least(sc)), "count_ms": ms(median(cnt)),
               "host_ms": ms(median(cpu)), "pull_p50_ms": rnd(d["pull_p50_ms"]),
               "pull_p99_ms": rnd(d["pull_p99_ms"]), "pull_p50_all_ms": rnd(d["pull_p50_all_ms"]),
               "pull_p99_all_ms": rnd(d["pull_p99_all_ms"]), "quiet_pulls": d["quiet_pulls"],
               "pull_max_ms": rnd(d["pull_max_ms"]),
               "pull_mean_ms": rnd(d["pull_mean_ms"]), "none_pulls": d["none_pulls"],
               "none_pull_s": rnd(d["none_pull_s"], 2), "status_s": rnd(median(st)), "status_s_min": rnd(least(st)),
               "status_s_spread": " ".join(f"{t:.3f}" for t in st), "status_cli_s": rnd(median(st_cli)),
               **files, **{key: rnd(v, 1) for key, v in rss.items()},
               "writer_blocked_s": rnd(w.get("blocked_s"), 1), "index_groups": d["index_groups"],
               "index_relists": d.get("index_relists"),
               "sampler_cache_mb": rnd(d["cached_mb"], 1), "sampler_arrow_mb": rnd(d.get("arrow_mb"), 1),
               **side, "measure_errors": len(errors)}
        rows.append(row)
        log(f"  {k * 10:3d}%: step {row['steps']:,}, {row['groups'] or 0:,} groups, {row['window_s']:.1f} s "
            f"this tenth | aggregate {row['aggregate_ms']} ms (from the rows {row['scan_ms']} ms, of which count "
            f"{row['count_ms']} ms), pull p50 {row['pull_p50_ms']:.1f} / p99 "
            f"{row['pull_p99_ms']:.1f} ms, status {row['status_s']} s [{row['status_s_spread']}] (CLI "
            f"{row['status_cli_s']} s), host {row['host_ms']} ms | first tenth's buffer now: aggregate "
            f"{row['aggregate_ms_frozen']} ms, from the rows {row['scan_ms_frozen']} ms, status "
            f"{row['status_s_frozen']} s (paired ratios {row['aggregate_paired_ratio']}, "
            f"{row['scan_paired_ratio']}, {row['status_paired_ratio']}) | "
            f"files {row['live_files']} ({row['live_shards']} shards, {row['ledger_files']} ledger) | RSS MiB "
            f"writer {row['writer_rss_mb']}, sampler {row['sampler_rss_mb']}, compactor {row['compactor_rss_mb']}")
    # The writer and trainer went on past the last tenth, so that it was measured under the same load
    # as the others; now the writer stops at a whole step, the trainer takes what it wrote, and both
    # idle until stopped.
    (ctl / "finish").touch()
    deadline = time.time() + 120
    while not (read_json(ctl / "trainer.json") or {}).get("finished") and time.time() < deadline:
        writer.check()
        trainer.check()
        time.sleep(0.1)
    if not (read_json(ctl / "trainer.json") or {}).get("finished"):
        log("the trainer did not take the writer's last groups within 120 s (see all_steps_consumed)")
    codes = stop_all([writer, trainer, compactor])
    for c in (writer, trainer, compactor):
        children.remove(c)
    bad = {n: c for n, c in codes.items() if c != 0}
    if bad:
        raise BenchError(f"children exited with {bad} on SIGTERM; logs in {run / 'logs'}")
    seconds = time.time() - t_start
    w = read_json(ctl / "writer.json") or {}
    tr = read_json(ctl / "trainer.json") or {}
    comp_totals = _last_json_line(run / "logs" / "compactor.log")
    log(f"synthetic part done in {seconds:.0f} s; checking invariants")
    inv = invariants(run)
    inv["rollouts_match_writer"] = inv["rollout_groups"] == w.get("groups") and \
        inv["rollout_rows"] == GROUP_SIZE * (w.get("groups") or 0)
    inv["consumed_all_steps"] = (tr.get("steps", 0) >= args.steps and inv["consumed_rows"] == gps * tr.get("steps", 0)
                                 and gps * tr.get("steps", 0) == w.get("trainable"))
    write_csv(args.out / "soak-synthetic.csv", rows)
    out = summarize_synthetic(rows, inv, w, tr, comp_totals, seconds, args.out / "soak-synthetic.csv")
    out["measure_errors"], out["first_measure_errors"] = len(errors), errors[:3]
    return out


def _last_json_line(path: Path) -> dict:
    try:
        for line in reversed(path.read_text(errors="replace").splitlines()):
            if line.startswith("{"):
                return json.loads(line)
    except (OSError, ValueError):
        pass
    return {}


def summarize_synthetic(rows, inv, w, tr, comp, seconds, csv_path) -> dict:
    first, last = rows[0], rows[-1]
    out = {
        "scan_ms_first": first["scan_ms"], "scan_ms_last": last["scan_ms"],
        "aggregate_ms_first": first["aggregate_ms"], "aggregate_ms_last": last["aggregate_ms"],
        "count_ms_first": first.get("count_ms"), "count_ms_last": last.get("count_ms"),
        "pull_p50_ms_first": first["pull_p50_ms"], "pull_p50_ms_last": last["pull_p50_ms"],
        "pull_p99_ms_first": first["pull_p99_ms"], "pull_p99_ms_last": last["pull_p99_ms"],
        "pull_p99_all_ms_first": first["pull_p99_all_ms"], "pull_p99_all_ms_last": last["pull_p99_all_ms"],
        "status_s_first": first["status_s"], "status_s_last": last["status_s"],
        "status_s_min_first": first["status_s_min"], "status_s_min_last": last["status_s_min"],
        "scan_ms_min_first": first["scan_ms_min"], "scan_ms_min_last": last["scan_ms_min"],
        "aggregate_ms_min_first": first["aggregate_ms_min"], "aggregate_ms_min_last": last["aggregate_ms_min"],
        "host_ms_first": first["host_ms"], "host_ms_last": last["host_ms"],
        **{f"{key}_{at}": row.get(key) for key in ("scan_ms_frozen", "aggregate_ms_frozen", "status_s_frozen",
                                                   "scan_paired_ratio", "aggregate_paired_ratio",
                                                   "status_paired_ratio")
           for at, row in (("first", first), ("last", last))},
        "status_cli_s_first": first["status_cli_s"], "status_cli_s_last": last["status_cli_s"],
        "live_files_max": max(r["live_files"] for r in rows), "live_files_last": last["live_files"],
        "live_shards_last": last["live_shards"], "ledger_files_last": last["ledger_files"],
        "writer_rss_mb_first": first["writer_rss_mb"], "writer_rss_mb_last": last["writer_rss_mb"],
        "sampler_rss_mb_first": first["sampler_rss_mb"], "sampler_rss_mb_last": last["sampler_rss_mb"],
        "compactor_rss_mb_first": first["compactor_rss_mb"], "compactor_rss_mb_last": last["compactor_rss_mb"],
        "groups": w.get("groups"), "trainable_groups": w.get("trainable"), "filtered_groups": w.get("filtered"),
        "steps": tr.get("steps"), "seconds": round(seconds, 1),
        "tenth_s_first": first["window_s"], "tenth_s_last": last["window_s"],
        "writer_blocked_s": rnd(w.get("blocked_s"), 1),
        "compactor_passes": comp.get("passes"), "compactor_seconds": comp.get("seconds"),
    }
    out.update({
        "scan_ratio": ratio(out["scan_ms_last"], out["scan_ms_first"]),
        "aggregate_ratio": ratio(out["aggregate_ms_last"], out["aggregate_ms_first"]),
        "pull_p50_ratio": ratio(out["pull_p50_ms_last"], out["pull_p50_ms_first"]),
        "pull_p99_ratio": ratio(out["pull_p99_ms_last"], out["pull_p99_ms_first"]),
        "status_ratio": ratio(out["status_s_last"], out["status_s_first"]),
        "status_min_ratio": ratio(out["status_s_min_last"], out["status_s_min_first"]),
        "scan_min_ratio": ratio(out["scan_ms_min_last"], out["scan_ms_min_first"]),
        "aggregate_min_ratio": ratio(out["aggregate_ms_min_last"], out["aggregate_ms_min_first"]),
        "host_ratio": ratio(out["host_ms_last"], out["host_ms_first"]),
        # the last tenth's buffer against the first tenth's, measured in the same rounds (freeze)
        **{f"{name}_side_ratio": ratio(out[f"{key}_last"], out[f"{key}_frozen_last"])
           for name, key in (("scan", "scan_ms"), ("aggregate", "aggregate_ms"), ("status", "status_s"))},
        "writer_rss_ratio": ratio(out["writer_rss_mb_last"], out["writer_rss_mb_first"]),
        "sampler_rss_ratio": ratio(out["sampler_rss_mb_last"], out["sampler_rss_mb_first"]),
    })

    def le(x, bound):
        return x is not None and x <= bound

    out["targets"] = {
        "aggregate_le_1s": le(out["aggregate_ms_last"], 1000), "pull_p99_le_250ms": le(out["pull_p99_ms_last"], 250),
        "status_le_1s": le(out["status_s_last"], 1.0), "live_files_le_2000": le(out["live_files_last"], 2000),
        "aggregate_ratio_le_1.5": le(out["aggregate_ratio"], 1.5),
        "pull_p99_ratio_le_1.5": le(out["pull_p99_ratio"], 1.5), "status_ratio_le_1.5": le(out["status_ratio"], 1.5),
        "writer_rss_ratio_le_1.25": le(out["writer_rss_ratio"], 1.25),
        "sampler_rss_ratio_le_1.25": le(out["sampler_rss_ratio"], 1.25),
    }
    # The same question answered from the rows: its scan grows with them (not one of the targets above).
    out["scan"] = {"scan_le_1s": le(out["scan_ms_last"], 1000), "scan_ratio_le_1.5": le(out["scan_ratio"], 1.5)}
    out["side_by_side"] = {f"{name}_{kind}_le_1.5": le(out[f"{name}_{kind}"], 1.5)
                           for name in ("scan", "aggregate", "status")
                           for kind in ("side_ratio", "paired_ratio_last")}
    out["trained_twice"] = inv["trained_twice"]
    out["lost"] = inv["lost"]
    out["invariants"] = {"no_group_twice": inv["trained_twice"] == 0, "nothing_lost": inv["lost"] == 0,
                         "rollouts_match_writer": inv["rollouts_match_writer"],
                         "every_trainable_group_consumed": inv["trainable_not_consumed"] == 0,
                         "all_steps_consumed": inv["consumed_all_steps"],
                         "staleness_within_limit": (inv["max_staleness_consumed"] or 0) <= MAX_STALENESS}
    out["csv"] = str(csv_path)
    return out


# -- part 2: real ------------------------------------------------------------------------------
def _children_of(pid: int) -> dict[str, int]:
    """The daemons `asyncgrpo run` (pid) started: name -> pid, named from their command lines."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "train" in args:
            out["trainer"] = int(entry)
        elif "generate" in args:
            idx = args[args.index("--index") + 1] if "--index" in args else "0"
            out[f"generator-{idx}"] = int(entry)
        elif "compactor" in args:
            out["compactor"] = int(entry)
    return out


def _safe_query(run: Path, sql: str, errors: list) -> tuple[list | None, float]:
    from buffer import BufferSQL

    t0 = time.perf_counter()
    try:
        rows = BufferSQL(run).query(sql).to_pylist()
    except Exception as e:  # noqa: BLE001 - counted and reported, the soak goes on
        errors.append(f"{type(e).__name__}: {e}")
        return None, time.perf_counter() - t0
    return rows, time.perf_counter() - t0


def real(base: Path, args, state: dict) -> dict:
    run = base / "soak-real"
    cmd = [sys.executable, "-m", "pipeline", "run", str(REPO / "configs" / "default.toml"), "--run", str(run),
           "--set", "run.time_limit_s=none"] + [a for kv in args.set for a in ("--set", kv)]
    log(f"real: {' '.join(cmd[2:])} for {args.minutes} min from the daemons' start")
    t_launch = time.time()
    sup = Child("asyncgrpo run", cmd, base / "soak-real.log")
    state["children"].append(sup)
    while not (run / "logs" / "trainer.log").exists():   # the supervisor has started its daemons
        sup.check()
        if time.time() - t_launch > 1800:
            raise BenchError(f"asyncgrpo run did not start its daemons within 30 min; see {sup.log_path}")
        time.sleep(0.5)
    t0 = time.time()
    log(f"  daemons started {t0 - t_launch:.0f} s after launch (model, warm start, accuracy before)")
    rows: list[dict] = state["real_rows"]
    errors: list[str] = []
    status_errors = 0
    from buffer import BufferDir

    for m in range(1, args.minutes + 1):
        seen = []   # live files every LIVE_EVERY_S this minute: one sample a minute drifts through the
        next_look = time.time()   # compactor's cycle (a pass every ~30 s); the peak does not
        unmerged, merged = [], []  # of those, the writers' files not merged yet, and the c-files
        while time.time() < t0 + 60 * m:
            sup.check()
            if time.time() >= next_look:
                live, fresh = live_and_unmerged(run)
                seen.append(live)
                unmerged.append(fresh)
                merged.append(live - fresh)
                next_look += LIVE_EVERY_S
            time.sleep(min(1.0, max(0.0, t0 + 60 * m - time.time())))
        pids = _children_of(sup.pid)
        row = {"minute": m, "time": round(time.time(), 1), **live_files(run)}
        seen.append(row["live_files"])
        row["live_files_peak"], row["live_files_low"] = max(seen), min(seen)
        row["unmerged_files_peak"] = max(unmerged, default=None)
        row["merged_files_peak"] = max(merged, default=None)
        st = None
        if BufferDir.is_buffer(run / "buffer"):
            try:
                st = timed_status(run)
            except Exception as e:  # noqa: BLE001
                status_errors += 1
                errors.append(f"status: {type(e).__name__}: {e}")
            _, agg = _safe_query(run, AGGREGATE_SQL, errors)
            row["aggregate_ms"] = rnd(agg * 1e3, 1)
            _, sc = _safe_query(run, SCAN_SQL, errors)
            row["scan_ms"] = rnd(sc * 1e3, 1)
        row["status_s"] = rnd(st)
        row["query_errors"] = len(errors)
        if row["metrics_files"]:
            got, _ = _safe_query(run, 'SELECT step, "memory/rss_mb" FROM metrics ORDER BY step DESC LIMIT 1', errors)
            if got:
                row["steps"] = got[0]["step"]
                row["trainer_rss_mb"] = rnd(got[0]["memory/rss_mb"], 1)
        if row["generator_metrics_files"]:
            got, _ = _safe_query(run, "SELECT generator_id, arg_max(rss_mb, started_at) AS rss "
                                      "FROM generator_metrics GROUP BY 1 ORDER BY 1", errors)
            for r in got or []:
                row[f"{r['generator_id']}_rss_mb"] = rnd(r["rss"], 1)
        row["compactor_proc_rss_mb"] = rnd(rss_mib(pids.get("compactor")), 1)
        row["trainer_proc_rss_mb"] = rnd(rss_mib(pids.get("trainer")), 1)
        row["supervisor_proc_rss_mb"] = rnd(rss_mib(sup.pid), 1)
        row["query_errors"] = len(errors)
        rows.append(row)
        log(f"  minute {m}: step {row.get('steps')}, files {row['live_files']} ({row['live_shards']} shards, "
            f"{row['ledger_files']} ledger, {row['metrics_files']} + {row['generator_metrics_files']} metrics) | "
            f"status {row['status_s']} s, aggregate {row.get('aggregate_ms')} ms (from the rows "
            f"{row.get('scan_ms')} ms) | trainer "
            f"{row.get('trainer_rss_mb')} MiB, compactor {row['compactor_proc_rss_mb']} MiB | errors {len(errors)}")
    log("  SIGINT to asyncgrpo run (as Ctrl-C); it stops its daemons and evaluates")
    code = sup.stop(timeout=900, sig=signal.SIGINT)
    state["children"].remove(sup)
    if code != 0:
        raise BenchError(f"asyncgrpo run exited with {code} after SIGINT; its log ends with:\n{sup.tail()}")
    flow = per_minute_flow(run, t0, errors)
    for row in rows:
        row.update(flow.get(row["minute"], {}))
    inv = invariants(run)
    write_csv(args.out / "soak-real.csv", rows)
    plot = plot_real(rows, args.out / "soak-real.png")
    return summarize_real(rows, inv, errors, status_errors, plot, args.out / "soak-real.csv")


WINDOW = 5   # minutes: memory peaks at the middle and the end, the trainer's idle share at the end
FLOW_KEYS = ("idle_share", "trainer_steps", "trainer_busy_s", "gen_groups_per_s", "trainable_share")


def per_minute_flow(run: Path, t0: float, errors: list) -> dict[int, dict]:
    """Minute (1-based, from t0) -> what flowed through the run in it, from every metrics and
    generator-metrics row (all flushed once the run has stopped):

        idle_share        sum("time/wait_s") / sum("time/step_s") of the trainer's steps
        trainer_steps     steps that ended in the minute
        trainer_busy_s    mean seconds of a step without its wait (pull + train + publish)
        gen_groups_per_s  groups the generators appended per second
        trainable_share   share of those groups that are not filtered (they alone feed the trainer)

    The idle share alone cannot tell a pipeline that slows down from a policy that has learned
    the task: with most groups all-correct, the generators must sample many groups per trainable
    one. The other columns tell them apart."""
    out: dict[int, dict] = {}

    def minute(t):
        return int((t - t0) // 60) + 1

    got, _ = _safe_query(run, 'SELECT "time", "time/wait_s" AS w, "time/step_s" AS s FROM metrics', errors)
    per: dict[int, list[float]] = {}
    for r in got or []:
        acc = per.setdefault(minute(r["time"]), [0.0, 0.0, 0])
        acc[0] += r["w"] or 0.0
        acc[1] += r["s"] or 0.0
        acc[2] += 1
    for m, (w, s, n) in per.items():
        out.setdefault(m, {}).update(idle_share=rnd(w / s if s > 0 else None), trainer_steps=n,
                                     trainer_busy_s=rnd((s - w) / n if n else None))
    got, _ = _safe_query(run, "SELECT started_at + seconds AS t, groups, filtered FROM generator_metrics", errors)
    gen: dict[int, list[int]] = {}
    for r in got or []:
        acc = gen.setdefault(minute(r["t"]), [0, 0])
        acc[0] += r["groups"] or 0
        acc[1] += r["filtered"] or 0
    for m, (g, f) in gen.items():
        out.setdefault(m, {}).update(gen_groups_per_s=rnd(g / 60, 1),
                                     trainable_share=rnd((g - f) / g if g else None))
    return out


def summarize_real(rows, inv, errors, status_errors, plot, csv_path) -> dict:
    n = len(rows)
    half = n // 2
    early, late = rows[:half] or rows, rows[half:] or rows

    def col(name, rs):
        return [r[name] for r in rs if r.get(name) is not None]

    def peak(r):
        return r.get("live_files_peak", r["live_files"])

    def slope(rs, value=peak):   # each minute's peak of live files, least squares over the later half, per minute
        pts = [(r["minute"], value(r)) for r in rs if value(r) is not None]
        return rnd(np.polyfit(*zip(*pts), 1)[0], 2) if len(pts) >= 2 else None

    daemons = sorted({k[:-len("_rss_mb")] for r in rows for k in r if k.endswith("_rss_mb")})
    out = {"minutes": n, "steps": rows[-1].get("steps") if rows else None,
           "live_files_max": max((peak(r) for r in rows), default=None),
           "live_files_max_first_half": max((peak(r) for r in early), default=None),
           "live_files_max_second_half": max((peak(r) for r in late), default=None),
           "live_files_slope_second_half_per_min": slope(late),
           # the same of the peaks' two parts: the writers' files not merged yet (bounded by
           # compactor.max_unmerged a set), and the c-files (levels; they grow with the groups kept)
           "unmerged_files_slope_second_half_per_min": slope(late, lambda r: r.get("unmerged_files_peak")),
           "merged_files_slope_second_half_per_min": slope(late, lambda r: r.get("merged_files_peak")),
           "live_files_last": rows[-1]["live_files"] if rows else None}
    mid = rows[half - 1] if half >= 1 else (rows[0] if rows else {})
    end = rows[-1] if rows else {}
    for dname in daemons:
        key = f"{dname}_rss_mb"
        a, b = mid.get(key), end.get(key)
        out[f"{key}_mid"], out[f"{key}_last"], out[f"{dname}_rss_ratio"] = a, b, ratio(b, a)
        # One sample a minute can land in a merge's or a plot's transient peak, or between them: the
        # peak of the WINDOW minutes ending at the middle and at the end compares like with like.
        pa, pb = max(col(key, early[-WINDOW:]), default=None), max(col(key, late[-WINDOW:]), default=None)
        out[f"{key}_peak_mid"], out[f"{key}_peak_last"], out[f"{dname}_rss_peak_ratio"] = pa, pb, ratio(pb, pa)
    idle = col("idle_share", rows[-WINDOW:])
    out["idle_share_last_window_mean"] = rnd(sum(idle) / len(idle)) if idle else None
    out.update({
        "status_s_max": max(col("status_s", rows), default=None),
        "aggregate_ms_max": max(col("aggregate_ms", rows), default=None),
        "scan_ms_max": max(col("scan_ms", rows), default=None),
        "query_errors": len(errors), "status_errors": status_errors, "first_errors": errors[:3],
        "trained_twice": inv["trained_twice"], "lost": inv["lost"],
        "max_staleness_consumed": inv["max_staleness_consumed"],
        **{f"{k}_{at}": (rows[i].get(k) if rows and -len(rows) <= i < len(rows) else None)
           for k in FLOW_KEYS for at, i in (("minute5", 4), ("last", -1))},
        "plot": str(plot) if plot else None, "csv": str(csv_path)})
    return out


def plot_real(rows: list[dict], path: Path) -> Path | None:
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["minute"] for r in rows]

    def series(key):
        return [r.get(key) if r.get(key) is not None else float("nan") for r in rows]

    fig, ax = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    ax[0].fill_between(x, series("live_files_low"), series("live_files_peak"), alpha=0.2,
                       label=f"all live: range within the minute (every {LIVE_EVERY_S:.0f} s)")
    for key, label in (("live_files", "all live"), ("live_shards", "rollout shards"), ("ledger_files", "ledger"),
                       ("metrics_files", "metrics"), ("generator_metrics_files", "generator_metrics")):
        ax[0].plot(x, series(key), marker=".", label=label)
    ax[0].set_ylabel("files")
    ax[0].set_title("live files")
    mem_keys = sorted({k for r in rows for k in r if k.endswith("_rss_mb")})
    for key in mem_keys:
        ax[1].plot(x, series(key), marker=".", label=key.removesuffix("_rss_mb"))
    ax[1].set_ylabel("MiB")
    ax[1].set_title("resident memory per daemon (metrics rows; *_proc from /proc)")
    ax[2].plot(x, series("status_s"), marker=".", label="status (s)")
    ax[2].plot(x, [v / 1e3 for v in series("aggregate_ms")], marker=".", label="SQL aggregate, versions view (s)")
    ax[2].plot(x, [v / 1e3 for v in series("scan_ms")], marker=".", label="the same from the rows (s)")
    ax[2].set_ylabel("seconds")
    ax[2].set_title("status and SQL latency")
    ax[3].plot(x, series("idle_share"), marker=".", label="trainer idle share")
    ax[3].plot(x, series("trainable_share"), marker=".", label="trainable share of generated groups")
    ax[3].set_ylim(0, 1)
    ax[3].set_ylabel("share")
    ax[3].set_title("trainer idle share (time/wait_s / time/step_s per minute), and what feeds it")
    ax[3].set_xlabel("minutes since the daemons started")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- main --------------------------------------------------------------------------------------
def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=int, default=60, help="minutes of the real run (0: skip it)")
    ap.add_argument("--groups", type=int, default=1_000_000,
                    help="trainable (non-filtered) groups of the synthetic part; filtered ones come on top")
    ap.add_argument("--steps", type=int, default=100_000, help="trainer steps of the synthetic part")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="synthetic part: measurement rounds at each tenth (their median is the figure)")
    ap.add_argument("--round-gap", type=float, default=ROUND_GAP_S, metavar="SECONDS",
                    help="synthetic part: seconds from one measurement round's start to the next")
    ap.add_argument("--no-synthetic", action="store_true",
                    help="skip the synthetic part (run the real part alone, e.g. beside a separate synthetic run)")
    ap.add_argument("--out", default=str(REPO / "docs" / "soak"), help="where the CSVs and the plot go")
    ap.add_argument("--dir", default=None, help="where the temp dir goes (default: the system's)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (run directories, logs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the real part's `asyncgrpo run` (repeatable), "
                         "e.g. --set generator.scheduler.kind=uniform")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="run the writer and trainer under cProfile; writer.prof and trainer.prof go to DIR")
    ap.add_argument("--role", choices=["writer", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--ctl", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        role_main = writer_main if args.role == "writer" else trainer_main
        if args.profile:   # cProfile of the role, written when it stops (SIGTERM)
            import cProfile

            prof = cProfile.Profile()
            try:
                prof.runcall(role_main, args)
            finally:
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                prof.dump_stats(str(Path(args.profile) / f"{args.role}.prof"))
        else:
            role_main(args)
        return 0
    if args.no_synthetic and args.minutes == 0:
        ap.error("--no-synthetic with --minutes 0 leaves nothing to run")
    if args.steps < DECILES or args.groups < args.steps:
        ap.error(f"need --steps >= {DECILES} and --groups >= --steps (groups per step = groups // steps)")
    if args.minutes < 0:
        ap.error("--minutes must be >= 0")
    if args.rounds < 1 or args.round_gap < 0:
        ap.error(f"need --rounds >= 1 and --round-gap >= 0 (got {args.rounds} and {args.round_gap})")
    args.out = Path(args.out).absolute()

    signal.signal(signal.SIGTERM, _raise_interrupt)
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)   # --dir need not exist yet
    base = Path(tempfile.mkdtemp(prefix="soak-", dir=args.dir))
    state = {"children": [], "synthetic_rows": [], "real_rows": []}
    result: dict = {"dir": str(base)}
    code = 0
    t0 = time.time()
    try:
        if not args.no_synthetic:
            result.update(synthetic(base, args, state))
        if args.minutes > 0:
            result["real"] = real(base, args, state)
        ok = all(result.get("invariants", {}).values()) and (
            "real" not in result or (result["real"]["trained_twice"] == 0 and result["real"]["lost"] == 0))
        if not ok:
            log("INVARIANT BROKEN: see invariants / real in the JSON")
            code = 1
    except KeyboardInterrupt:
        log("interrupted; stopping every child")
        result["error"] = "interrupted"
        code = 130
    except Exception as e:  # noqa: BLE001 - reported in the JSON, non-zero exit
        log(f"ERROR: {type(e).__name__}: {e}")
        result["error"] = f"{type(e).__name__}: {e}"
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not skip the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if state["children"]:
            stop_all(state["children"], timeout=60)
        if code and state["synthetic_rows"]:
            write_csv(args.out / "soak-synthetic.csv", state["synthetic_rows"])
        if code and state["real_rows"]:
            write_csv(args.out / "soak-real.csv", state["real_rows"])
        if args.keep:
            log(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
        result["total_seconds"] = round(time.time() - t0, 1)
        print(json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
