"""`asyncgrpo run`: the whole pipeline as supervised daemons, with a live display.

    prepare the model (embedded tiny model: built and warm-started once, cached)
    greedy accuracy on held-out prompts, before
    start 1 trainer, N generators and (compactor.every_s set) a compactor
        (`asyncgrpo train` / `asyncgrpo generate` / `asyncgrpo compactor`)
    until the trainer finishes, the time limit, or Ctrl-C / SIGTERM:
        show step, version, reward, accuracy, staleness, buffer fill, filtered, expired, idle share
        restart a crashed generator or compactor with backoff; a crashed trainer stops the run
        (under Ray it is restarted with --resume, up to ray.max_trainer_restarts)
    stop: SIGTERM to every daemon (generators flush, the trainer checkpoints), wait
    greedy accuracy on held-out prompts, after; the run directory; SQL to try next
    beside it all, a thread (pipeline.trackers.Observer): run.report_to's trackers fed from the
        run's files every run.track_every_s (started first: one that cannot start stops the run
        before anything starts), and plot.png / plot.html every run.plot_every_s and at the end

A launcher decides where the daemons run: `LocalLauncher` (the default) starts
them as subprocesses of this process, `pipeline.ray_launcher.RayLauncher` as Ray
actors on a cluster. The supervision above, the display and the summary are
the same for both. Local children get SIGTERM if this process dies
(PR_SET_PDEATHSIG), so nothing is left behind even after a kill -9 of the
supervisor.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from pipeline.children import cli_argv, spawn, tail, trainer_argv
from pipeline.config import save_config
from pipeline.errors import RunError
from pipeline.plot import write_plots
from pipeline.progress import Progress, progress_line, progress_table
from pipeline.rundir import evaluate_folder, prepare_model, read_run_info, write_run_info
from pipeline.schema import to_dict
from pipeline.trackers import Follower, Observer, open_trackers
from workers.remote_weights import open_weights, work_dir

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger("asyncgrpo.run")
STOP_GRACE_S = 60.0
MAX_BACKOFF_S = 30.0
Role = Literal["trainer", "generator", "compactor"]


class Daemon(Protocol):
    """The supervisor's handle of one daemon, wherever it runs (a local `Child`, a Ray actor's)."""

    name: str
    argv: list[str]
    log_path: Path
    restarts: int
    next_start: float       # when a crashed daemon is due to restart (0.0: not waiting)
    exits: list[int]        # exit codes of its crashes, in order

    def start(self) -> None: ...
    def poll(self) -> int | None: ...          # the exit code once it has exited, else None
    def terminate(self) -> None: ...           # SIGTERM: generators flush, the trainer checkpoints
    def kill(self) -> None: ...
    def wait(self, timeout: float | None) -> bool: ...   # True once it has exited (or never started)


class Launcher(Protocol):
    """Where the daemons run: makes each daemon's handle and owns what it set up to run them."""

    name: str
    trainer_ranks: int                   # trainer processes (torchrun when > 1)
    max_trainer_restarts: int | None     # 0: a crashed trainer stops the run
    resume_args: str                     # what `asyncgrpo run --resume --run DIR` needs besides

    def open(self, echo) -> None: ...
    def daemon(self, role: Role, index: int, name: str, argv: list[str], log_path: Path) -> Daemon: ...
    def close(self) -> None: ...


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

    def wait(self, timeout: float | None) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


class LocalLauncher:
    """The daemons as subprocesses of this process; with run.pin_cores, the trainer on core 0 and the
    generators on the others (the compactor shares the last generator core)."""

    name = "local"
    trainer_ranks = 1
    max_trainer_restarts = 0
    resume_args = ""

    def __init__(self, cfg: Config):
        self.n_cores = os.cpu_count() or 1
        self.pin = cfg.run.pin_cores and self.n_cores >= 2

    def open(self, echo) -> None:
        pass

    def daemon(self, role: Role, index: int, name: str, argv: list[str], log_path: Path) -> Child:
        cores = None
        if self.pin:
            cores = {"trainer": [0], "generator": [1 + index % (self.n_cores - 1)],
                     "compactor": [self.n_cores - 1]}[role]
        return Child(name, argv, log_path, cores=cores)

    def close(self) -> None:
        pass


class Supervisor:
    """Starts, watches and stops the trainer, the generators and the compactor of one run directory."""

    def __init__(self, run_dir: Path, cfg: Config, *, resume: bool, launcher: Launcher | None = None):
        self.run, self.cfg = run_dir, cfg
        self.launcher = launcher or LocalLauncher(cfg)
        logs, make = work_dir(run_dir) / "logs", self.launcher.daemon   # on this machine
        self.trainer = make("trainer", 0, "trainer",
                            trainer_argv(str(run_dir), resume=resume, ranks=self.launcher.trainer_ranks),
                            logs / "trainer.log")
        self.generators = [
            make("generator", i, f"generator-{i}", cli_argv("generate", "--run", str(run_dir), "--index", str(i)),
                 logs / f"generator-{i}.log")
            for i in range(cfg.run.num_generators)]
        # Restarted like a generator when it crashes.
        self.helpers = [] if cfg.compactor.every_s is None else [
            make("compactor", 0, "compactor", cli_argv("compactor", "--run", str(run_dir)), logs / "compactor.log")]
        self.stopping = False
        self.failure: str | None = None

    def children(self) -> list[Daemon]:
        return [self.trainer, *self.generators, *self.helpers]

    def start(self) -> None:
        for c in self.children():
            c.start()

    def check(self) -> bool:
        """Restart a crashed daemon when due; False when the run is over (trainer finished, or gave up)."""
        code = self.trainer.poll()
        if code == 0:
            return False
        if code is not None and self.launcher.max_trainer_restarts == 0:
            self.failure = (f"the trainer crashed (exit code {code}); its log ends with:\n"
                            f"{tail(self.trainer.log_path)}\n"
                            f"Continue the run with: asyncgrpo run --resume --run {self.run}{self.launcher.resume_args}")
            return False
        now = time.time()
        limits = [(self.trainer, self.launcher.max_trainer_restarts, f"{self.launcher.name}.max_trainer_restarts")]
        limits += [(d, self.cfg.run.max_generator_restarts, "run.max_generator_restarts")
                   for d in [*self.generators, *self.helpers]]
        return all(self._restart_when_due(d, limit, key, now) for d, limit, key in limits)

    def _restart_when_due(self, d: Daemon, limit: int | None, key: str, now: float) -> bool:
        """Notice a crash and schedule its restart (doubling backoff), or restart it when due; False: gave up."""
        code = d.poll()
        if code is None or d.next_start > now:
            return True
        if d.next_start == 0.0:  # just noticed the exit
            d.exits.append(code)
            if limit is not None and d.restarts >= limit:
                self.failure = f"{d.name} crashed {d.restarts + 1} times (limit {key} = {limit}); see {d.log_path}"
                if d is self.trainer:
                    self.failure += (f"; its log ends with:\n{tail(d.log_path)}\nContinue the run with: "
                                     f"asyncgrpo run --resume --run {self.run}{self.launcher.resume_args}")
                return False
            wait = min(self.cfg.run.restart_backoff_s * 2 ** d.restarts, MAX_BACKOFF_S)
            log.warning("%s exited with code %s; restarting in %.1fs", d.name, code, wait)
            d.next_start = now + wait
            return True
        d.restarts += 1
        d.next_start = 0.0
        if d is self.trainer:   # from its newest checkpoint: exactly, nothing trained twice or skipped
            d.argv = trainer_argv(str(self.run), resume=True, ranks=self.launcher.trainer_ranks)
        d.start()
        return True

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to every daemon (generators flush, the trainer checkpoints), then wait; kill stragglers."""
        self.stopping = True
        for c in self.children():
            c.terminate()
        deadline = time.time() + grace_s
        for c in self.children():
            if not c.wait(max(deadline - time.time(), 0.1)):
                log.warning("%s did not stop within %.0fs; killing it", c.name, grace_s)
                c.kill()
                c.wait(None)


def run_pipeline(run_dir: Path, cfg: Config, *, resume: bool, echo=print, launcher: Launcher | None = None) -> dict:
    """Run (or resume) the pipeline in `run_dir` (daemons where `launcher` puts them; default: here);
    returns the summary that is also printed."""
    launcher = launcher or LocalLauncher(cfg)
    try:
        launcher.open(echo)   # a cluster that cannot run the daemons fails here, before the model is prepared
        return _run(run_dir, cfg, resume, echo, launcher)
    finally:
        launcher.close()


def _run(run_dir: Path, cfg: Config, resume: bool, echo, launcher: Launcher) -> dict:
    observer = Observer(run_dir, open_follower(run_dir, cfg), track_every_s=cfg.run.track_every_s,
                        plot_every_s=cfg.run.plot_every_s)   # a tracker that cannot start stops the run here
    try:
        return _supervise(run_dir, cfg, resume, echo, launcher, observer)
    finally:
        observer.stop()


def open_follower(run_dir: Path, cfg: Config) -> Follower | None:
    """The trackers of run.report_to, started, and their follower (None: no trackers). RunError when one
    cannot start; a run directory (or trackers folder) made for them is then removed again."""
    if not cfg.run.report_to:
        return None
    local = work_dir(run_dir)        # the run directory, or this machine's folder for a run on a store
    made = local if not local.exists() else local / "trackers" if not (local / "trackers").exists() else None
    local.mkdir(parents=True, exist_ok=True)
    try:
        trackers, state = open_trackers(cfg.run.report_to, run_dir, to_dict(cfg))
    except RunError:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    return Follower(run_dir, trackers, state)


def _plot(run_dir: Path, echo) -> None:
    """<run>/plot.png and plot.html at the end of the run; a failure is logged, the run's result stands."""
    try:
        write_plots(run_dir)
        echo(f"plots: {work_dir(run_dir) / 'plot.png'} and {work_dir(run_dir) / 'plot.html'}")
    except Exception as e:  # noqa: BLE001
        log.warning("writing the plots failed (%s: %s); draw them with: asyncgrpo plot %s", type(e).__name__, e,
                    run_dir)


def _supervise(run_dir: Path, cfg: Config, resume: bool, echo, launcher: Launcher, observer: Observer) -> dict:
    info = read_run_info(run_dir)
    if not resume or "initial_model" not in info:
        model = prepare_model(cfg, echo)  # a missing model folder stops here, before anything is made
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.toml")
        echo(f"greedy accuracy before training (held-out prompts) ...")
        info = {"initial_model": str(model.resolve()), "eval_before": evaluate_folder(cfg, model)}
        write_run_info(run_dir, info)
    echo(f"accuracy before: {info['eval_before']:.1%}")
    sup = Supervisor(run_dir, cfg, resume=resume, launcher=launcher)
    stop_reason = {"why": None}

    def on_signal(signum, _frame):
        stop_reason["why"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sup.start()
    observer.start()
    if observer.follower is not None:
        echo(f"trackers {', '.join(cfg.run.report_to)}: {work_dir(run_dir) / 'trackers'} "
             f"(every {cfg.run.track_every_s:g} s)")
    echo(f"started the trainer, {len(sup.generators)} generator(s){' and a compactor' if sup.helpers else ''}; "
         f"logs in {work_dir(run_dir) / 'logs'}")
    progress = Progress(run_dir, cfg)
    deadline = None if cfg.run.time_limit_s is None else time.time() + cfg.run.time_limit_s
    try:
        _watch(sup, progress, deadline, stop_reason, echo)
    finally:
        echo(f"stopping ({stop_reason['why'] or 'trainer finished'}): generators flush, the trainer checkpoints ...")
        sup.stop()
        for s, h in old.items():
            signal.signal(s, h)
        observer.stop()   # the trackers get the daemons' last rows
    if sup.failure:
        _plot(run_dir, echo)
        raise RunError(sup.failure)
    summary = finish(run_dir, cfg, info, progress.snapshot(), echo)
    summary["stopped_by"] = stop_reason["why"] or "trainer finished"
    summary["launcher"] = launcher.name
    summary["generator_restarts"] = sum(g.restarts for g in sup.generators)
    summary["trainer_restarts"] = sup.trainer.restarts
    write_run_info(run_dir, {**info, "summary": summary})
    if cfg.run.plot_every_s is not None:
        _plot(run_dir, echo)
    return summary


def _watch(sup: Supervisor, progress: Progress, deadline: float | None, stop_reason: dict, echo) -> None:
    live = None
    if sys.stdout.isatty():
        from rich.live import Live

        live = Live(progress_table(progress.snapshot(), "asyncgrpo run"), refresh_per_second=2)
        live.start()
    # A snapshot refreshes the supervisor's own index of the buffer (reading every shard written
    # since): taken every 0.5 s whether shown or not, it cost the supervisor ~4% of a core that the
    # daemons beside it need, so it is taken only when shown: every 2 s on a terminal, else with
    # each progress line (every 10 s).
    every = 2.0 if live is not None else 10.0
    last_shown = time.time() if live is not None else 0.0
    try:
        while stop_reason["why"] is None and sup.check():
            if deadline is not None and time.time() >= deadline:
                stop_reason["why"] = "time limit"
                break
            if time.time() - last_shown >= every:
                last_shown = time.time()
                snap = progress.snapshot()
                if live is not None:
                    live.update(progress_table(snap, f"asyncgrpo run  {sup.run}"))
                else:
                    echo(progress_line(snap))
            time.sleep(0.5)
    finally:
        if live is not None:
            live.stop()


def finish(run_dir: Path, cfg: Config, info: dict, snap: dict, echo) -> dict:
    """Evaluate the newest published weights and print the summary and queries to try."""
    store = open_weights(run_dir)
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
