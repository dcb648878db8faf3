"""`asyncgrpo ablate`: run (or resume) every cell of an ablation, one at a time, then report.

    cells = seeds x staleness x IS mode x --sweep values (seeds outermost, so an
            interrupted sweep holds whole settings first); every cell's config is
            built and checked before anything runs (spec.Ablation.check)
    for each cell, one after another:
        finished (<cell>/cell.json)? skip it (after checking it ran with this config)
        run.json summary of a completed run but no cell.json? only evaluate it
        otherwise run it (cell.run_cell)
        greedy accuracy of each kept version (after the run, so evaluation never
        competes with training for the cores), the cell's row -> <cell>/cell.json
        ablation.csv / curves.csv / ablation.md / ablation.png rewritten (report)
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from pipeline.ablate.cell import cell_state, run_cell
from pipeline.ablate.report import cell_result, write_outputs
from pipeline.ablate.spec import CELL_RESULT, EVAL_WEIGHTS, Ablation, Cell
from pipeline.config import load_run_config
from pipeline.errors import AblateError
from pipeline.rundir import write_json
from pipeline.schema import to_dict


def run_ablation(ab: Ablation, echo=print) -> list[dict]:
    """Run (or resume) every cell, then write the outputs; returns the rows."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # evaluations load weights in this process
    ab.out.mkdir(parents=True, exist_ok=True)
    write_json(ab.out / "ablation.json", {
        "config": ab.config, "overrides": ab.overrides, "eval_every": ab.eval_every, "target": ab.target,
        "replay": str(ab.replay) if ab.replay else None, "cells": [c.name for c in ab.cells]})
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
                write_json(run / CELL_RESULT, result)
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
