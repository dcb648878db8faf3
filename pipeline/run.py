"""`asyncgrpo run`: the whole pipeline as supervised subprocesses, with a live display.

    prepare the model (embedded tiny model: built and warm-started once, cached)
    greedy accuracy on held-out prompts, before
    start 1 trainer, N generators and (compactor.every_s set) a compactor
        (`asyncgrpo train` / `asyncgrpo generate` / `asyncgrpo compactor`)
    until the trainer finishes, the time limit, or Ctrl-C / SIGTERM:
        show step, version, reward, accuracy, staleness, buffer fill, filtered, expired, idle share
        restart a crashed generator or compactor with backoff; stop the run if the trainer crashes
    stop: SIGTERM to every child (generators flush, the trainer checkpoints), wait
    greedy accuracy on held-out prompts, after; the run directory; SQL to try next

Children get SIGTERM if this process dies (PR_SET_PDEATHSIG), so nothing is
left behind even after a kill -9 of the supervisor.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import buffer
from buffer.layout import run_file_set
from pipeline.children import cli_argv, spawn, tail
from pipeline.config import save_config
from pipeline.errors import RunError
from pipeline.rundir import evaluate_folder, prepare_model, read_run_info, write_run_info
from workers.weights import WeightStore

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger("asyncgrpo.run")
STOP_GRACE_S = 60.0


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    cores: list[int] | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    exits: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.proc = spawn(self.argv, self.log_path, own_group=True, cores=self.cores)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


class Supervisor:
    """Starts, watches and stops the trainer, the generators and the compactor of one run directory."""

    def __init__(self, run_dir: Path, cfg: Config, *, resume: bool):
        self.run, self.cfg = run_dir, cfg
        n_cores = os.cpu_count() or 1
        pin = cfg.run.pin_cores and n_cores >= 2
        train_args = ["train", "--run", str(run_dir)] + (["--resume"] if resume else [])
        self.trainer = Child("trainer", cli_argv(*train_args), run_dir / "logs" / "trainer.log",
                             cores=[0] if pin else None)
        self.generators = [
            Child(f"generator-{i}", cli_argv("generate", "--run", str(run_dir), "--index", str(i)),
                  run_dir / "logs" / f"generator-{i}.log",
                  cores=[1 + i % (n_cores - 1)] if pin else None)
            for i in range(cfg.run.num_generators)]
        # Restarted like a generator when it crashes; with pinning it shares the last generator core.
        self.helpers = [] if cfg.compactor.every_s is None else [
            Child("compactor", cli_argv("compactor", "--run", str(run_dir)), run_dir / "logs" / "compactor.log",
                  cores=[n_cores - 1] if pin else None)]
        self.stopping = False
        self.failure: str | None = None

    def children(self) -> list[Child]:
        return [self.trainer, *self.generators, *self.helpers]

    def start(self) -> None:
        for c in self.children():
            c.start()

    def check(self) -> bool:
        """Restart a crashed generator or compactor; False when the run is over (trainer exited or gave up)."""
        code = self.trainer.poll()
        if code is not None:
            if code != 0:
                self.failure = (f"the trainer crashed (exit code {code}); its log ends with:\n"
                                f"{tail(self.trainer.log_path)}\n"
                                f"Continue the run with: asyncgrpo run --resume --run {self.run}")
            return False
        now = time.time()
        for g in [*self.generators, *self.helpers]:
            code = g.poll()
            if code is None or g.next_start > now:
                continue
            if g.next_start == 0.0:  # just noticed the exit
                g.exits.append(code)
                limit = self.cfg.run.max_generator_restarts
                if limit is not None and g.restarts >= limit:
                    self.failure = (f"{g.name} crashed {g.restarts + 1} times (limit "
                                    f"run.max_generator_restarts = {limit}); see {g.log_path}")
                    return False
                wait = min(self.cfg.run.restart_backoff_s * 2 ** g.restarts, 30.0)
                log.warning("%s exited with code %s; restarting in %.1fs", g.name, code, wait)
                g.next_start = now + wait
                continue
            g.restarts += 1
            g.next_start = 0.0
            g.start()
        return True

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to every child (generators flush, the trainer checkpoints), then wait; kill stragglers."""
        self.stopping = True
        for c in self.children():
            c.terminate()
        deadline = time.time() + grace_s
        for c in self.children():
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", c.name, grace_s)
                c.kill()
                c.proc.wait()


class Progress:
    """What the live display shows, read from the run's files (metrics shards, buffer index)."""

    def __init__(self, run_dir: Path, cfg: Config):
        self.run, self.cfg = run_dir, cfg
        self.index = None
        self.seen: dict[str, dict] = {}
        self.started = time.time()

    def _metrics_rows(self) -> list[dict]:
        """The newest row of each live metrics file (files the compactor merged away are forgotten)."""
        import pyarrow.parquet as pq

        mdir = self.run / "metrics"
        if mdir.is_dir():
            live = run_file_set(mdir, "metrics").live_names()
            for name in live:
                if name not in self.seen:
                    try:
                        table = pq.read_table(mdir / name)
                    except Exception:  # a shard being replaced; read it next time
                        continue
                    rows = table.slice(max(table.num_rows - 1, 0)).to_pylist()
                    self.seen[name] = {"last": rows[-1] if rows else {},
                                       "wait": _column_sum(table, "time/wait_s"),
                                       "step_time": _column_sum(table, "time/step_s")}
            for name in set(self.seen) - set(live):
                del self.seen[name]
        return [r for r in self.seen.values() if r["last"]]

    def snapshot(self) -> dict:
        files = self._metrics_rows()
        last = max((f["last"] for f in files), key=lambda r: r.get("step", 0)) if files else {}
        version = int(last.get("version", 0) or 0)
        counts = {}
        if buffer.BufferDir.is_buffer(self.run / "buffer"):
            if self.index is None:
                self.index = buffer.GroupIndex(self.run / "buffer", quarantine=False, retire=True)
            self.index.refresh()
            counts = self.index.counts(version, self.cfg.trainer.max_staleness, by_version=False)
        wait = sum(f["wait"] for f in files)
        step_time = sum(f["step_time"] for f in files)
        return {
            "elapsed_s": time.time() - self.started,
            "step": int(last.get("step", 0) or 0), "version": version,
            "reward": last.get("reward/mean"), "accuracy": last.get("batch/accuracy"),
            "staleness": last.get("staleness/mean"),
            "groups": counts.get("groups", 0), "eligible": counts.get("eligible", 0),
            "filtered": counts.get("filtered", 0), "expired": counts.get("expired", 0),
            "consumed": counts.get("consumed", 0),
            "trainer_idle": wait / step_time if step_time > 0 else None,
        }


def _column_sum(table, name: str) -> float:
    """Sum of a metrics column (0 where absent or null)."""
    if name not in table.column_names:
        return 0.0
    import pyarrow.compute as pc

    return float(pc.sum(table.column(name)).as_py() or 0.0)


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def progress_line(s: dict) -> str:
    return (f"[{s['elapsed_s']:5.0f}s] step {s['step']} v{s['version']} | reward {_fmt(s['reward'])} "
            f"acc {_fmt(s['accuracy'], '.2f')} staleness {_fmt(s['staleness'], '.2f')} | buffer "
            f"{s['groups']} groups: {s['eligible']} waiting, {s['consumed']} consumed, {s['filtered']} "
            f"filtered, {s['expired']} expired | trainer idle {_fmt(s['trainer_idle'], '.0%')}")


def progress_table(s: dict, title: str):
    from rich.table import Table

    t = Table(title=title, show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold cyan")
    t.add_column()
    for k, v in (("elapsed", f"{s['elapsed_s']:.0f} s"), ("trainer step / version", f"{s['step']} / v{s['version']}"),
                 ("batch reward / accuracy", f"{_fmt(s['reward'])} / {_fmt(s['accuracy'], '.2f')}"),
                 ("mean staleness trained on", _fmt(s["staleness"], ".2f")),
                 ("buffer groups", f"{s['groups']} ({s['eligible']} waiting, {s['consumed']} consumed)"),
                 ("filtered / expired", f"{s['filtered']} / {s['expired']}"),
                 ("trainer idle share", _fmt(s["trainer_idle"], ".0%"))):
        t.add_row(k, v)
    return t


def run_pipeline(run_dir: Path, cfg: Config, *, resume: bool, echo=print) -> dict:
    """Run (or resume) the pipeline in `run_dir`; returns the summary that is also printed."""
    info = read_run_info(run_dir)
    if not resume or "initial_model" not in info:
        model = prepare_model(cfg, echo)  # a missing model folder stops here, before anything is made
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.toml")
        echo(f"greedy accuracy before training (held-out prompts) ...")
        info = {"initial_model": str(model.resolve()), "eval_before": evaluate_folder(cfg, model)}
        write_run_info(run_dir, info)
    echo(f"accuracy before: {info['eval_before']:.1%}")
    sup = Supervisor(run_dir, cfg, resume=resume)
    stop_reason = {"why": None}

    def on_signal(signum, _frame):
        stop_reason["why"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sup.start()
    echo(f"started the trainer, {len(sup.generators)} generator(s){' and a compactor' if sup.helpers else ''}; "
         f"logs in {run_dir / 'logs'}")
    progress = Progress(run_dir, cfg)
    deadline = None if cfg.run.time_limit_s is None else time.time() + cfg.run.time_limit_s
    try:
        _watch(sup, progress, deadline, stop_reason, echo)
    finally:
        echo(f"stopping ({stop_reason['why'] or 'trainer finished'}): generators flush, the trainer checkpoints ...")
        sup.stop()
        for s, h in old.items():
            signal.signal(s, h)
    if sup.failure:
        raise RunError(sup.failure)
    summary = finish(run_dir, cfg, info, progress.snapshot(), echo)
    summary["stopped_by"] = stop_reason["why"] or "trainer finished"
    summary["generator_restarts"] = sum(g.restarts for g in sup.generators)
    write_run_info(run_dir, {**info, "summary": summary})
    return summary


def _watch(sup: Supervisor, progress: Progress, deadline: float | None, stop_reason: dict, echo) -> None:
    live = None
    if sys.stdout.isatty():
        from rich.live import Live

        live = Live(progress_table(progress.snapshot(), "asyncgrpo run"), refresh_per_second=2)
        live.start()
    last_line = 0.0
    try:
        while stop_reason["why"] is None and sup.check():
            if deadline is not None and time.time() >= deadline:
                stop_reason["why"] = "time limit"
                break
            snap = progress.snapshot()
            if live is not None:
                live.update(progress_table(snap, f"asyncgrpo run  {sup.run}"))
            elif time.time() - last_line >= 10:
                echo(progress_line(snap))
                last_line = time.time()
            time.sleep(0.5)
    finally:
        if live is not None:
            live.stop()


def finish(run_dir: Path, cfg: Config, info: dict, snap: dict, echo) -> dict:
    """Evaluate the newest published weights and print the summary and queries to try."""
    store = WeightStore(run_dir / "weights")
    version = store.latest()
    after = evaluate_folder(cfg, store.folder(version)) if version is not None else info["eval_before"]
    summary = {"run_dir": str(run_dir), "eval_before": info["eval_before"], "eval_after": after,
               "version": version, **{k: snap[k] for k in ("step", "groups", "filtered", "expired", "consumed")}}
    echo(progress_line(snap))
    echo(f"\ngreedy accuracy on {cfg.run.eval_size or 'all'} held-out prompts: "
         f"before {info['eval_before']:.1%}, after {after:.1%} (weights v{version})")
    echo(f"run directory: {run_dir}\n\nTry next:")
    for q in SUGGESTED_QUERIES:
        echo(f"  asyncgrpo sql {run_dir} \"{q}\"")
    return summary


SUGGESTED_QUERIES = [
    "SELECT version, round(avg(reward), 3) AS reward, count(*) AS completions FROM rollouts GROUP BY 1 ORDER BY 1",
    "SELECT staleness, count(*) AS groups FROM consumed GROUP BY 1 ORDER BY 1",
    "SELECT filter_reason, count(*) AS groups FROM groups WHERE filtered GROUP BY 1",
]
