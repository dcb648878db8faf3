"""Trackers (TensorBoard, Weights & Biases) fed from a run's files by a follower.

The trainer and the generators never talk to a tracker: a `Follower` reads the
rows that are new since its last look from the run's SQL views (buffer.sql,
quarantine off) and hands them to every tracker:

    metrics            one scalar record per trainer step, x = the step, at the row's wall time
    generator_metrics  the new batches of all generators, summed into generator/* scalars
                       (idle_share = sum(wait_s) / sum(seconds); tokens_per_s summed over
                       generators; filtered_frac = filtered / groups), at the newest trainer step
    rollouts           every `samples_every_s`, a table of a few completions of the newest
                       version: samples/completions

`asyncgrpo run` opens the trackers before anything starts (a tracker that cannot
start is a RunError, exit code 2, nothing started) and runs the follower in a
thread of the supervisor (`Observer`), so a tracker that fails mid-run is
logged, turned off, and training goes on. `asyncgrpo track RUN` runs the same
follower for daemons started by hand.

What was logged is remembered in <run>/trackers/state.json (the last trainer
step, the last batch of each generator writer, the last sampled version),
written after each poll by temp file and rename, so a restarted follower logs
no row twice. TensorBoard writes event files to <run>/trackers/tensorboard/;
W&B writes its run under <run>/trackers/wandb/, offline unless WANDB_MODE says
otherwise (`wandb sync` uploads it later). For a run on an object store these
local files go to this machine's work folder instead (workers.remote_weights.work_dir).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

import buffer
from buffer.layout import BufferDir, atomic_write_bytes
from buffer.store import RemotePath, as_path
from pipeline.children import cli_argv
from pipeline.errors import RunError
from workers.proc import lower_priority
from workers.remote_weights import work_dir

log = logging.getLogger("asyncgrpo.track")
PLOT_TIMEOUT_S = 600        # a plot that takes longer is given up (and tried again at the next interval)
# The periodic plot's niceness: its ~6 s of CPU (late in a 60-minute run on 2 cores) every plot_every_s
# then runs in the daemons' gaps instead of taking turns with a generator that the trainer waits for.
PLOT_NICE = 10
SAMPLES_PER_TABLE = 8       # completions in each samples/completions table (up to 4 per group)
SAMPLE_COLUMNS = ("version", "prompt", "completion", "reward", "correct", "finish_reason")


class Tracker(Protocol):
    """Where scalars and sample tables go; every method may raise (the follower turns the tracker off)."""

    name: str

    def log_scalars(self, step: int, scalars: dict[str, float], wall_time: float) -> None: ...
    def log_samples(self, step: int, rows: list[dict], wall_time: float) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files in <run>/trackers/tensorboard/ with TensorBoard's own writer (no torch, no TensorFlow)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, state: dict, config: dict) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir = trackers_dir(run_dir) / "tensorboard"
        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(logdir))

    def _add(self, step: int, values: list, wall_time: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.writer.add_event(Event(wall_time=wall_time, step=step, summary=Summary(value=values)))

    def log_scalars(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(step, [Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()], wall_time)

    def log_samples(self, step: int, rows: list[dict], wall_time: float) -> None:
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        lines += ["| " + " | ".join(str(r[c]).replace("|", "\\|").replace("\n", "⏎") for c in SAMPLE_COLUMNS) + " |"
                  for r in rows]
        text = TensorProto(dtype=types_pb2.DT_STRING, string_val=["\n".join(lines).encode()],
                           tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        self._add(step, [Summary.Value(tag="samples/completions", metadata=meta, tensor=text)], wall_time)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in <run>/trackers/wandb/ (mode offline unless WANDB_MODE is set), x = the trainer step.

    The run's id is kept in the follower's state, so a resumed follower continues the same W&B run.
    """

    name = "wandb"

    def __init__(self, run_dir: Path, state: dict, config: dict) -> None:
        import wandb

        root = trackers_dir(run_dir) / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        state.setdefault("wandb_id", uuid.uuid4().hex[:12])
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "asyncgrpo"), dir=str(root),
                              name=_run_name(run_dir), id=state["wandb_id"], resume="allow",
                              mode=os.environ.get("WANDB_MODE", "offline"), config=config,
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def log_scalars(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        self.run.log(scalars, step=step)

    def log_samples(self, step: int, rows: list[dict], wall_time: float) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"samples/completions": table}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
"""The trackers `run.report_to` and `asyncgrpo track --report-to` may name, by name."""
TRACKER_NAMES = tuple(TRACKERS)


def trackers_dir(run_dir) -> Path:
    """<run>/trackers/; for a run on an object store, in this machine's work folder."""
    return work_dir(as_path(run_dir)) / "trackers"


def state_path(run_dir: Path) -> Path:
    return trackers_dir(run_dir) / "state.json"


def read_state(run_dir: Path) -> dict:
    p = state_path(run_dir)
    return json.loads(p.read_text()) if p.is_file() else {"step": 0, "generators": {}, "samples_version": -1}


def open_trackers(names: tuple[str, ...] | list[str], run_dir: str | os.PathLike, config: dict | None = None
                  ) -> tuple[list[Tracker], dict]:
    """Start the named trackers for `run_dir` (and the follower state they share); RunError if one is not
    installed or fails to start, with those already started closed again."""
    run = as_path(run_dir)
    for name in names:
        if name not in TRACKERS:
            raise RunError(f"unknown tracker {name!r} (choose from {', '.join(TRACKER_NAMES)})")
        if importlib.util.find_spec(name) is None:
            raise RunError(f"tracker {name!r} is not installed; install the trackers with: pip install -e '.[track]'")
    state = read_state(run)
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(TRACKERS[name](run, state, config or {}))
        except Exception as e:  # noqa: BLE001 - any failure to start is the user's to fix, named here
            for t in opened:
                _close_quietly(t)
            raise RunError(f"tracker {name!r} failed to start: {type(e).__name__}: {e}"
                           + (" (W&B: set WANDB_MODE=offline on a machine without network)" if name == "wandb"
                              else "")) from None
    return opened, state


def _close_quietly(t: Tracker) -> None:
    try:
        t.close()
    except Exception:  # noqa: BLE001
        log.exception("tracker %s failed to close", t.name)


def _sql_str(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def _number(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


class Follower:
    """Reads a run's new rows and logs them to the trackers; see the module doc."""

    def __init__(self, run_dir: str | os.PathLike, trackers: list[Tracker], state: dict, *,
                 samples_every_s: float | None = 60.0) -> None:
        self.run = as_path(run_dir)
        self.trackers = list(trackers)
        self.state = state
        self.samples_every_s = samples_every_s
        self._last_samples = 0.0
        self.pending_gen: list[dict] = []   # generator rows waiting for the next trainer step
        self.logged_steps = 0

    def poll(self, *, final: bool = False) -> int:
        """Log what is new; returns the trainer steps logged. `final`: also log generator rows still waiting."""
        try:
            db = buffer.BufferSQL(self.run, quarantine=False)
        except buffer.BufferError:
            return 0   # no buffer yet: the generators have not started
        steps = self._metrics(db)
        self._generators(db, flush=bool(steps) or final)
        self._samples(db, final)
        for t in list(self.trackers):
            self._call(t, "flush")
        self._save_state()
        return steps

    def _rows(self, db, sql: str) -> list[dict]:
        try:
            return db.query(sql).to_pylist()
        except buffer.SqlError as e:
            if "does not exist" in str(e):
                return []   # the view comes with the run's first file of its kind
            raise

    def _metrics(self, db) -> int:
        rows = self._rows(db, f"SELECT * FROM metrics WHERE step > {int(self.state['step'])} ORDER BY step")
        for r in rows:
            step = int(r["step"])
            scalars = {k: x for k, v in r.items() if k not in ("step", "time") and (x := _number(v)) is not None}
            self._log(step, scalars, float(r.get("time") or time.time()))
            self.state["step"] = step
        self.logged_steps += len(rows)
        return len(rows)

    def _generators(self, db, flush: bool) -> None:
        seen = self.state["generators"]
        where = " OR ".join(f"(writer_id = {_sql_str(w)} AND batch > {int(b)})" for w, b in seen.items())
        where = f"writer_id NOT IN ({', '.join(map(_sql_str, seen))}) OR {where}" if seen else "true"
        rows = self._rows(db, f"SELECT * FROM generator_metrics WHERE {where} ORDER BY started_at")
        for r in rows:
            seen[r["writer_id"]] = max(int(r["batch"]), int(seen.get(r["writer_id"], -1)))
        self.pending_gen += rows
        if not flush or not self.pending_gen:
            return
        rows, self.pending_gen = self.pending_gen, []
        secs = sum(r["seconds"] for r in rows)
        groups = sum(r["groups"] for r in rows)
        per_gen: dict[str, list[float]] = {}
        for r in rows:
            tok_s = per_gen.setdefault(r["generator_id"], [0.0, 0.0])
            tok_s[0] += r["tokens"]
            tok_s[1] += r["seconds"]
        scalars = {"generator/batches": float(len(rows)), "generator/groups": float(groups),
                   "generator/filtered_frac": sum(r["filtered"] for r in rows) / groups if groups else 0.0,
                   "generator/idle_share": sum(r["wait_s"] for r in rows) / secs if secs > 0 else 0.0,
                   "generator/tokens_per_s": sum(t / s for t, s in per_gen.values() if s > 0),
                   "generator/rss_mb": max(r["rss_mb"] for r in rows)}
        self._log(int(self.state["step"]), scalars, max(r["started_at"] + r["seconds"] for r in rows))

    def _samples(self, db, final: bool) -> None:
        if self.samples_every_s is None or (time.time() - self._last_samples < self.samples_every_s and not final):
            return
        rows = self._rows(db, "SELECT version, prompt, completion, reward, correct, finish_reason FROM rollouts "
                              "WHERE version = (SELECT max(version) FROM rollouts) AND sample_index < 4 "
                              f"ORDER BY group_id, sample_index LIMIT {SAMPLES_PER_TABLE}")
        if not rows or rows[0]["version"] <= self.state["samples_version"]:
            return
        self._last_samples = time.time()
        self.state["samples_version"] = int(rows[0]["version"])
        for t in list(self.trackers):
            self._call(t, "log_samples", int(self.state["step"]), rows, time.time())

    def _log(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        for t in list(self.trackers):
            self._call(t, "log_scalars", step, scalars, wall_time)

    def _call(self, t: Tracker, method: str, *args) -> None:
        """Call a tracker; one that raises is logged and turned off (the others and training go on)."""
        try:
            getattr(t, method)(*args)
        except Exception as e:  # noqa: BLE001
            log.error("tracker %s failed (%s: %s); it is turned off, training goes on", t.name, type(e).__name__, e)
            self.trackers.remove(t)
            _close_quietly(t)

    def _save_state(self) -> None:
        p = state_path(self.run)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(p.parent, p, json.dumps(self.state).encode())

    def close(self) -> None:
        for t in self.trackers:
            _close_quietly(t)
        self.trackers = []


class Observer:
    """A thread of `asyncgrpo run`'s supervisor: the follower every `track_every_s` and the plots every
    `plot_every_s`. Nothing it does can stop the run: a failure is logged and it tries again next time."""

    def __init__(self, run_dir: Path, follower: Follower | None, *, track_every_s: float,
                 plot_every_s: float | None) -> None:
        self.run, self.follower = run_dir, follower
        self.track_every_s, self.plot_every_s = track_every_s, plot_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="asyncgrpo-observer", daemon=True)

    def start(self) -> None:
        if (self.follower is not None or self.plot_every_s is not None) and not self._thread.is_alive():
            self._thread.start()

    def _loop(self) -> None:
        last_track = last_plot = time.time()
        while not self._stop.wait(1.0):
            now = time.time()
            if self.follower is not None and now - last_track >= self.track_every_s:
                last_track = now
                self._safely("following the run for the trackers", self.follower.poll)
            if self.plot_every_s is not None and now - last_plot >= self.plot_every_s:
                last_plot = now
                self._safely("writing plot.png", write_run_plot, self.run)

    def _safely(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - never stops training
            log.warning("%s failed (%s: %s); trying again later", what, type(e).__name__, e)

    def stop(self) -> None:
        """Stop the thread, log what is left and close the trackers (the final plot is the caller's)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=120)
        follower, self.follower = self.follower, None   # a second stop does nothing
        if follower is not None:
            self._safely("following the run for the trackers", lambda: follower.poll(final=True))
            follower.close()


def _run_name(run_dir) -> str:
    run = as_path(run_dir)
    return (run if isinstance(run, RemotePath) else run.resolve()).name


def write_run_plot(run_dir: Path) -> None:
    """<run>/plot.png and plot.html, once the run has a buffer (the generators' first shard makes it),
    drawn by `asyncgrpo plot` in a child process: drawn in the supervisor, matplotlib's and plotly's
    memory and every point of the run stayed in it (its resident memory went 837 -> 936 MiB between
    minutes 30 and 60 of a 60-minute run, plotting every 180 s)."""
    if not BufferDir.is_buffer(run_dir / "buffer"):
        return
    r = subprocess.run(cli_argv("plot", str(run_dir)), capture_output=True, text=True, timeout=PLOT_TIMEOUT_S,
                       preexec_fn=functools.partial(lower_priority, PLOT_NICE))
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"asyncgrpo plot exited with {r.returncode}: {lines[-1] if lines else 'no output'}")
