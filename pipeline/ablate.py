"""`asyncgrpo ablate`: a sweep of staleness x importance-sampling mode (x any field) x seed, one cell at a time.

    cells = seeds x staleness x IS mode x --sweep values (seeds outermost, so an
            interrupted sweep holds whole settings first); every cell's config is
            built and checked before anything runs
    for each cell, one after another:
        finished (<cell>/cell.json)? skip it
        run.json summary of a completed run but no cell.json? only evaluate it
        otherwise delete what a half-finished attempt left and run it:
            `asyncgrpo run` (generators + trainer), or with --replay `asyncgrpo train`
            over a copy of another run's buffer (no generator); run.time_limit_s is
            kept by this driver and counts from the publication of v0 (the trainer is
            ready), so process start-up, which varies with the machine's load, is not
            part of the budget
            while it runs, hard-link the weights of every eval_every-th version into
            <cell>/eval_weights/ (the trainer prunes all but trainer.keep_weights)
        greedy accuracy of each kept version (after the run, so evaluation never
        competes with training for the cores), the cell's row -> <cell>/cell.json
        ablation.csv / curves.csv / ablation.md / ablation.png rewritten

IS modes (`--is-mode`), each a set of trainer.loss fields:

    none       objective "decoupled", is_mode none: the proximal clip, no lag correction
    decoupled  objective "decoupled", is_mode "truncate": AReaL's objective with truncated
               IS pi_old / mu (the trainer's default)
    bypass     objective "bypass": plain PPO against the behaviour policy mu (the ratio
               absorbs the lag; what AReaL calls naive PPO)

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

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

IS_MODES: dict[str, tuple[str, ...]] = {
    "none": ("trainer.loss.objective=decoupled", "trainer.loss.is_mode=none"),
    "decoupled": ("trainer.loss.objective=decoupled", "trainer.loss.is_mode=truncate"),
    "bypass": ("trainer.loss.objective=bypass",),
}
CELL_RESULT = "cell.json"
EVAL_WEIGHTS = "eval_weights"
BUDGET_STOP = "ablate_time_limit.json"   # written just before the driver stops a cell at its time limit
REPLAY_MAX_WAIT_S = 3.0
OWN_KEYS = {"trainer.max_staleness": "--staleness", "run.seed": "--seeds", "trainer.seed": "--seeds",
            "trainer.loss.objective": "--is-mode", "trainer.loss.is_mode": "--is-mode"}


class AblateError(Exception):
    """Bad ablation input (a value, a path); the message names it."""


@dataclass(frozen=True)
class Cell:
    """One run of the sweep."""

    staleness: int | None
    is_mode: str
    seed: int
    sweep: tuple[tuple[str, str], ...] = ()    # (key, value as written)
    label: str | None = None
    """Names the setting instead of staleness, IS mode and sweep values (benchmarks' modes)."""

    @property
    def name(self) -> str:
        parts = [f"s{'none' if self.staleness is None else self.staleness}", self.is_mode]
        parts += [f"{k.rsplit('.', 1)[-1]}={_safe(v)}" for k, v in self.sweep]
        return "-".join(([_safe(self.label)] if self.label else parts) + [f"seed{self.seed}"])

    @property
    def setting(self) -> str:
        """The cell without its seed: what a line of the plot and a row of the mean table show."""
        return self.name.rsplit("-seed", 1)[0]

    def overrides(self) -> list[str]:
        s = "none" if self.staleness is None else str(self.staleness)
        return [f"trainer.max_staleness={s}", *IS_MODES[self.is_mode], f"run.seed={self.seed}",
                f"trainer.seed={self.seed}", *(f"{k}={v}" for k, v in self.sweep)]


def _safe(v: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", v)


def parse_list(option: str, text: str, kind) -> list:
    """'0,1,2' -> [0, 1, 2] via `kind` (which raises ValueError on a bad item); errors name the option."""
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise AblateError(f"{option} {text!r}: expected a comma-separated list, e.g. {option} 0,1,2")
    out = []
    for x in items:
        try:
            out.append(kind(x))
        except ValueError as e:
            raise AblateError(f"{option}: {x!r} is not {e}") from None
    if len(set(out)) != len(out):
        raise AblateError(f"{option} {text!r} repeats a value")
    return out


def staleness_value(x: str) -> int | None:
    if x.lower() == "none":
        return None
    if not x.isdigit():
        raise ValueError("an integer >= 0 or 'none' (no limit)")
    return int(x)


def seed_value(x: str) -> int:
    if not x.isdigit():
        raise ValueError("an integer >= 0")
    return int(x)


def is_mode_value(x: str) -> str:
    if x not in IS_MODES:
        raise ValueError(f"one of {', '.join(IS_MODES)}")
    return x


def parse_sweep(item: str) -> tuple[str, list[str]]:
    """'generator.sampling.temperature=0.3,0.7' -> (key, ['0.3', '0.7']); lists in brackets stay whole."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise AblateError(f"--sweep {item!r}: expected KEY=V1,V2,..., e.g. --sweep generator.num_generations=4,8")
    if key in OWN_KEYS:
        raise AblateError(f"--sweep {key}: this field has its own option; use {OWN_KEYS[key]}")
    values, depth, cur = [], 0, ""
    for ch in raw:
        depth += ch in "[{" and 1 or ch in "]}" and -1 or 0
        if ch == "," and depth == 0:
            values.append(cur.strip())
            cur = ""
        else:
            cur += ch
    values.append(cur.strip())
    if any(not v for v in values) or len(set(values)) != len(values):
        raise AblateError(f"--sweep {item!r}: values must be non-empty and distinct")
    return key, values


def make_cells(staleness: list, is_modes: list[str], seeds: list[int], sweeps: list[tuple[str, list[str]]]
               ) -> list[Cell]:
    keys = [k for k, _ in sweeps]
    if len(set(keys)) != len(keys):
        raise AblateError(f"--sweep names a key twice: {keys}")
    cells = []
    for seed in seeds:
        for s, mode, *values in itertools.product(staleness, is_modes, *[v for _, v in sweeps]):
            cells.append(Cell(s, mode, seed, tuple(zip(keys, values))))
    names = [c.name for c in cells]
    if len(set(names)) != len(names):
        raise AblateError("two swept keys end in the same name, so cells would share a directory; "
                          f"sweep them in separate ablations ({keys})")
    return cells


@dataclass
class Ablation:
    """Everything one `asyncgrpo ablate` needs; built and checked before any cell runs."""

    config: str | None
    overrides: list[str]
    cells: list[Cell]
    out: Path
    eval_every: int
    target: str
    replay: Path | None = None
    cfgs: dict = field(default_factory=dict)     # cell name -> resolved Config

    def check(self) -> None:
        """Build every cell's config (errors name the key and value), check the budget and --replay."""
        from pipeline.config import load_config

        for c in self.cells:
            self.cfgs[c.name] = cfg = load_config(self.config, [*self.overrides, *c.overrides()])
            if cfg.trainer.max_steps is None and cfg.run.time_limit_s is None:
                raise AblateError("cells need the same finite budget: set trainer.max_steps or run.time_limit_s "
                                  "(both are none)")
        parse_target(self.target, 0.0)
        if self.replay is not None:
            from buffer import BufferDir

            if not BufferDir.is_buffer(self.replay / "buffer"):
                raise AblateError(f"--replay {str(self.replay)!r}: not a run directory with a buffer/ "
                                  "(pass the directory of an earlier `asyncgrpo run` or ablation cell)")

    def cell_dir(self, c: Cell) -> Path:
        return self.out / "cells" / c.name


def parse_target(text: str, before: float) -> float:
    """'0.4' -> 0.4 (absolute); '+0.1' -> before + 0.1 (a gain over the cell's accuracy before)."""
    try:
        value = float(text)
    except ValueError:
        raise AblateError(f"--target {text!r}: expected an accuracy such as 0.4, or a gain such as +0.1") from None
    if text.strip().startswith("+"):
        return before + value
    if not 0 <= value <= 1:
        raise AblateError(f"--target {text!r}: an accuracy is in [0, 1] (a gain is written +0.1)")
    return value


# -- the watcher: keep the weights that the curve needs ---------------------------------------------
class Snapshots:
    """Hard-links every `every`-th published version into <run>/eval_weights/ before pruning removes it.

    A version seen only after it was pruned is replaced by the next one on disk;
    each kept folder is complete or absent (linked under a temp name, then renamed).
    """

    def __init__(self, run: Path, every: int):
        from workers.weights import WeightStore

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
        from workers.weights import version_name

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


# -- running one cell --------------------------------------------------------------------------------
def _die_with_parent() -> None:
    from pipeline.run import _die_with_parent as die

    die()


def cell_state(run: Path) -> str:
    """'done' (cell.json), 'ran' (a completed run not yet evaluated), or 'redo' (nothing, or half-finished)."""
    from pipeline.run import read_run_info

    if (run / CELL_RESULT).is_file():
        return "done"
    summary = read_run_info(run).get("summary") if run.is_dir() else None
    if summary and stopped_by(run, summary) in ("trainer finished", "time limit"):
        return "ran"
    return "redo"


def stopped_by(run: Path, summary: dict) -> str | None:
    """Why the cell's run ended; a SIGTERM that this driver sent at the time limit is the time limit."""
    why = summary.get("stopped_by")
    if why == "SIGTERM" and (run / BUDGET_STOP).is_file():
        return "time limit"
    return why


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
    from pipeline.run import cli_argv

    snaps = Snapshots(run, ab.eval_every)
    budget, deadline = cfg.run.time_limit_s, None
    started = time.time()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cli_argv(*args), stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent, env=dict(os.environ, PYTHONUNBUFFERED="1"))
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
                _write_json(run / BUDGET_STOP, {"time_limit_s": budget, "stopped_at": time.time()})
                proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
        raise
    snaps.poll()
    if proc.returncode != 0:
        from pipeline.run import tail
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
    from buffer import BufferDir
    from pipeline.config import save_config
    from pipeline.run import prepare_model, read_run_info, write_run_info

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


_BEFORE: dict[tuple, float] = {}


def _eval_before(ab: Ablation, cfg, model: Path) -> float:
    from pipeline.run import evaluate_folder

    key = (str(model), cfg.run.eval_size, cfg.run.eval_max_new_tokens, str(cfg.task))
    if key not in _BEFORE:
        _BEFORE[key] = evaluate_folder(cfg, model)
    return _BEFORE[key]


def _finish_replay(ab: Ablation, c: Cell, run: Path, stopped: str, wall_s: float) -> None:
    from pipeline.run import evaluate_folder, read_run_info, write_run_info
    from workers.weights import WeightStore

    info = read_run_info(run)
    store = WeightStore(run / "weights")
    version = store.latest()
    after = evaluate_folder(ab.cfgs[c.name], store.folder(version)) if version is not None else info["eval_before"]
    write_run_info(run, {**info, "summary": {"run_dir": str(run), "eval_before": info["eval_before"],
                                             "eval_after": after, "version": version, "step": version,
                                             "stopped_by": stopped, "wall_s": wall_s}})


# -- the sweep -----------------------------------------------------------------------------------------
def run_ablation(ab: Ablation, echo=print) -> list[dict]:
    """Run (or resume) every cell, then write the outputs; returns the rows."""
    from transformers.utils import logging as hf_logging

    from pipeline.ablate_report import cell_result, write_outputs

    hf_logging.disable_progress_bar()   # evaluations load weights in this process
    ab.out.mkdir(parents=True, exist_ok=True)
    (ab.out / "ablation.json").write_text(json.dumps({
        "config": ab.config, "overrides": ab.overrides, "eval_every": ab.eval_every, "target": ab.target,
        "replay": str(ab.replay) if ab.replay else None, "cells": [c.name for c in ab.cells]}, indent=1))
    progress = CellProgress(len(ab.cells), echo)
    rows = []
    try:
        for i, c in enumerate(ab.cells):
            run = ab.cell_dir(c)
            state = cell_state(run)
            if state != "redo":
                _check_same_config(run, ab.cfgs[c.name], c)
            if state == "done":
                progress.note(i, c, "finished earlier: skipped")
            else:
                cfg = ab.cfgs[c.name]
                if state == "redo":
                    progress.start(i, c, cfg)
                    run_cell(ab, c, lambda v: progress.tick(v))
                progress.note(i, c, "evaluating the kept versions")
                result = cell_result(run, c, ab.cfgs[c.name], ab.target, replay=ab.replay is not None)
                _write_json(run / CELL_RESULT, result)
                shutil.rmtree(run / EVAL_WEIGHTS, ignore_errors=True)
                r = result["row"]
                progress.note(i, c, f"final accuracy {r['final_accuracy']:.1%}, {r['steps']} steps "
                                    f"at {r['steps_per_s']:.2f}/s" if r["steps_per_s"] else "done")
            rows.append(json.loads((run / CELL_RESULT).read_text()))
            write_outputs(ab.out, rows, ab.cells)
    finally:
        progress.close()
    paths = [ab.out / n for n in ("ablation.csv", "ablation.md", "ablation.png", "curves.csv")]
    echo("wrote " + ", ".join(str(p) for p in paths))
    return [r["row"] for r in rows]


IGNORED_ON_RESUME = ("run.time_limit_s", "trainer.max_wait_seconds")   # kept by the driver / set for replay


def _check_same_config(run: Path, expected, c: Cell) -> None:
    """A finished cell counts only if it ran with this sweep's config; else the user must choose."""
    from pipeline.config import load_run_config
    from pipeline.schema import to_dict

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    have, want = flat(to_dict(load_run_config(run))), flat(to_dict(expected))
    diff = sorted(k for k in set(have) | set(want) if k not in IGNORED_ON_RESUME and have.get(k) != want.get(k))
    if diff:
        k = diff[0]
        raise AblateError(f"cell {c.name} in {run.parent.parent} was run with another config ({k} = "
                          f"{have.get(k)!r}, this sweep has {want.get(k)!r}); use another --out, or delete "
                          f"{run} to run it again")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class CellProgress:
    """Which cell of how many, its trainer version and elapsed time: a rich bar on a terminal, else lines."""

    def __init__(self, total: int, echo):
        self.total, self.echo = total, echo
        self.bar = None
        self.current = ""
        self.started = 0.0
        self.last_line = 0.0
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn())
            self.task = self.bar.add_task("cells", total=total)
            self.bar.start()

    def _say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            self.echo(text)

    def start(self, i: int, c: Cell, cfg) -> None:
        budget = [f"{cfg.trainer.max_steps} steps" if cfg.trainer.max_steps else "",
                  f"{cfg.run.time_limit_s:.0f} s" if cfg.run.time_limit_s else ""]
        self.current, self.started = f"[{i + 1}/{self.total}] {c.name}", time.time()
        self._say(f"{self.current}: running (budget {' or '.join(b for b in budget if b)})")
        if self.bar is not None:
            self.bar.update(self.task, description=self.current)

    def tick(self, version: int | None) -> None:
        step = "-" if version is None else version
        text = f"{self.current}: trainer v{step}, {time.time() - self.started:.0f} s"
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        elif time.time() - self.last_line >= 30:
            self.echo(text)
            self.last_line = time.time()

    def note(self, i: int, c: Cell, text: str) -> None:
        self._say(f"[{i + 1}/{self.total}] {c.name}: {text}")
        if self.bar is not None and not text.startswith("evaluating"):
            self.bar.update(self.task, completed=i + 1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
