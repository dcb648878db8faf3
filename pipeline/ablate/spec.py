"""What an ablation is: its cells (staleness x IS mode x swept fields x seed), budget and target.

Everything here is checked before any cell runs: every cell's config is built
(errors name the key and value), the budget is finite, --target parses and
--replay names a run with a buffer. Nothing here starts a process.

IS modes (`--is-mode`), each a set of trainer.loss fields:

    none       objective "decoupled", is_mode none: the proximal clip, no lag correction
    decoupled  objective "decoupled", is_mode "truncate": AReaL's objective with truncated
               IS pi_old / mu (the trainer's default)
    bypass     objective "bypass": plain PPO against the behaviour policy mu (the ratio
               absorbs the lag; what AReaL calls naive PPO)
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

from buffer.layout import BufferDir
from pipeline.config import load_config
from pipeline.errors import AblateError

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
    accuracy_before: dict = field(default_factory=dict)   # (model, eval settings) -> greedy accuracy

    def check(self) -> None:
        """Build every cell's config (errors name the key and value), check the budget and --replay."""
        for c in self.cells:
            self.cfgs[c.name] = cfg = load_config(self.config, [*self.overrides, *c.overrides()])
            if cfg.trainer.max_steps is None and cfg.run.time_limit_s is None:
                raise AblateError("cells need the same finite budget: set trainer.max_steps or run.time_limit_s "
                                  "(both are none)")
        parse_target(self.target, 0.0)
        if self.replay is not None:
            if not BufferDir.is_buffer(self.replay / "buffer"):
                raise AblateError(f"--replay {str(self.replay)!r}: not a run directory with a buffer/ "
                                  "(pass the directory of an earlier `asyncgrpo run` or ablation cell)")

    def cell_dir(self, c: Cell) -> Path:
        return self.out / "cells" / c.name


def stopped_by(run: Path, summary: dict) -> str | None:
    """Why the cell's run ended; a SIGTERM that this driver sent at the time limit is the time limit."""
    why = summary.get("stopped_by")
    if why == "SIGTERM" and (run / BUDGET_STOP).is_file():
        return "time limit"
    return why


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
