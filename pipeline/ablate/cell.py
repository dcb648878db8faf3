"""One ablation cell: run it from scratch into its directory, keeping the weights its curve needs.

    delete what a half-finished attempt left
    `asyncgrpo run` (generators + trainer), or with --replay `asyncgrpo train` over a
    linked copy of another run's buffer (no generator); run.time_limit_s is kept here
    and counts from the publication of v0 (the trainer is ready), so process start-up,
    which varies with the machine's load, is not part of the budget
    while it runs, hard-link the weights of every eval_every-th version into
    <cell>/eval_weights/ (the trainer prunes all but trainer.keep_weights)

Replay (`--replay RUN`): the cell's buffer is a hard-linked copy of RUN's buffer
shards (an empty ledger) and only the trainer runs, starting from RUN's initial
model. The trainer's step clock is replayed against the stored versions: the
data of version v arrives when the replayed trainer reaches version v, so a
group of version v is eligible at trainer version t when 0 <= t - v <=
max_staleness, taken oldest first, exactly as online. Staleness is the version
lag of the stored data, not a lag behind this cell's own policy (that mismatch
is larger, and the importance weight pi_old / mu corrects the real one). The
cell ends at its budget or when a step finds too few eligible groups for
trainer.max_wait_seconds (3 s unless set): the window [t - s, t] ran dry.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

from buffer.layout import BufferDir
from pipeline.ablate.spec import (BUDGET_STOP, CELL_RESULT, EVAL_WEIGHTS, REPLAY_MAX_WAIT_S, Ablation, Cell,
                                  stopped_by)
from pipeline.children import cli_argv, spawn, tail
from pipeline.config import save_config
from pipeline.errors import AblateError
from pipeline.rundir import evaluate_folder, prepare_model, read_run_info, write_json, write_run_info
from workers.weights import WeightStore, version_name


class Snapshots:
    """Hard-links every `every`-th published version into <run>/eval_weights/ before pruning removes it.

    A version seen only after it was pruned is replaced by the next one on disk;
    each kept folder is complete or absent (linked under a temp name, then renamed).
    """

    def __init__(self, run: Path, every: int):
        self.store, self.every = WeightStore(run / "weights"), every
        self.dest = run / EVAL_WEIGHTS
        self.next = 0

    def kept(self) -> list[int]:
        if not self.dest.is_dir():
            return []
        return sorted(int(p.name[1:]) for p in self.dest.iterdir() if re.fullmatch(r"v\d{8}", p.name))

    def poll(self) -> None:
        for v in self.store.versions():
            if v >= self.next and self.keep(v):
                self.next = (v // self.every + 1) * self.every

    def keep(self, v: int) -> bool:
        final = self.dest / version_name(v)
        if final.exists():
            return True
        tmp = self.dest / f"tmp-{version_name(v)}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            names = []
            for p in self.store.folder(v).iterdir():
                try:
                    os.link(p, tmp / p.name)
                except OSError as e:
                    if isinstance(e, FileNotFoundError):
                        raise
                    shutil.copy2(p, tmp / p.name)   # another filesystem
                names.append(p.name)
            if "weights.json" not in names or not any(n.endswith(".safetensors") for n in names):
                raise FileNotFoundError(v)
        except FileNotFoundError:   # pruned while we linked: a newer version will do
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        os.replace(tmp, final)
        return True


def cell_state(run: Path) -> str:
    """'done' (cell.json), 'ran' (a completed run not yet evaluated), or 'redo' (nothing, or half-finished)."""
    if (run / CELL_RESULT).is_file():
        return "done"
    summary = read_run_info(run).get("summary") if run.is_dir() else None
    if summary and stopped_by(run, summary) in ("trainer finished", "time limit"):
        return "ran"
    return "redo"


def run_cell(ab: Ablation, c: Cell, on_tick) -> None:
    """Run cell `c` from scratch into its directory, keeping eval snapshots; raises on failure."""
    run = ab.cell_dir(c)
    if run.exists():
        shutil.rmtree(run)
    log = ab.out / "logs" / f"{c.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cfg = ab.cfgs[c.name]
    if ab.replay is None:
        args = ["run", *([ab.config] if ab.config else []), "--run", str(run)]
        for o in [*ab.overrides, *c.overrides(), "run.time_limit_s=none"]:   # the limit is kept here
            args += ["--set", o]
    else:
        _prepare_replay(ab, c, run)
        args = ["train", "--run", str(run)]
    snaps = Snapshots(run, ab.eval_every)
    budget, deadline = cfg.run.time_limit_s, None
    started = time.time()
    proc = spawn(cli_argv(*args), log)
    stopped = "trainer finished"
    try:
        while proc.poll() is None:
            snaps.poll()
            latest = snaps.store.latest()
            on_tick(latest)
            if budget is not None and deadline is None and latest is not None:
                deadline = _published_at(snaps.store, 0) + budget
            if deadline is not None and time.time() >= deadline and stopped != "time limit":
                stopped = "time limit"
                write_json(run / BUDGET_STOP, {"time_limit_s": budget, "stopped_at": time.time()})
                proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
        raise
    snaps.poll()
    if proc.returncode != 0:
        raise AblateError(f"cell {c.name} failed (exit code {proc.returncode}); its log {log} ends with:\n"
                          f"{tail(log)}\nRerun the same command to retry it (finished cells are kept).")
    latest = snaps.store.latest()
    if latest is not None:
        snaps.keep(latest)
    if ab.replay is not None:
        _finish_replay(ab, c, run, stopped, time.time() - started)


def _published_at(store, version: int) -> float:
    """When `version` was published (its weights.json), or now if that cannot be read."""
    try:
        return float(json.loads((store.folder(version) / "weights.json").read_text())["published_at"])
    except (OSError, ValueError, KeyError):
        return time.time()


def _prepare_replay(ab: Ablation, c: Cell, run: Path) -> None:
    """The cell's run directory: config, run.json (the source's initial model), a linked copy of the buffer."""
    cfg = ab.cfgs[c.name]
    src = BufferDir(ab.replay / "buffer")
    run.mkdir(parents=True)
    if cfg.trainer.max_wait_seconds is None:
        cfg = replace(cfg, trainer=replace(cfg.trainer, max_wait_seconds=REPLAY_MAX_WAIT_S))
        ab.cfgs[c.name] = cfg
    save_config(cfg, run / "config.toml")
    dst = BufferDir(run / "buffer", create=True)
    for p in src.live_shards():
        try:
            os.link(p, dst.shards / p.name)
        except FileNotFoundError:
            continue     # compacted away since the listing; its groups are in a c-file we link too
        except OSError:
            shutil.copy2(p, dst.shards / p.name)
    if src.manifest_path.is_file():
        shutil.copyfile(src.manifest_path, dst.manifest_path)
    model = read_run_info(ab.replay).get("initial_model") or str(prepare_model(cfg, echo=lambda *_: None))
    write_run_info(run, {"initial_model": model, "eval_before": _eval_before(ab, cfg, Path(model)),
                         "replay_of": str(ab.replay)})


def _eval_before(ab: Ablation, cfg, model: Path) -> float:
    """Greedy accuracy of the replayed run's initial model, once per sweep."""
    key = (str(model), cfg.run.eval_size, cfg.run.eval_max_new_tokens, str(cfg.task), str(cfg.reward))
    if key not in ab.accuracy_before:
        ab.accuracy_before[key] = evaluate_folder(cfg, model)
    return ab.accuracy_before[key]


def _finish_replay(ab: Ablation, c: Cell, run: Path, stopped: str, wall_s: float) -> None:
    info = read_run_info(run)
    store = WeightStore(run / "weights")
    version = store.latest()
    after = evaluate_folder(ab.cfgs[c.name], store.folder(version)) if version is not None else info["eval_before"]
    write_run_info(run, {**info, "summary": {"run_dir": str(run), "eval_before": info["eval_before"],
                                             "eval_after": after, "version": version, "step": version,
                                             "stopped_by": stopped, "wall_s": wall_s}})
