"""What `asyncgrpo run` shows while it runs and at the end, read from the run's files.

The same for every launcher (local subprocesses or Ray actors): it reads only the
run directory (metrics files, the buffer's index), never the daemons.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import buffer
from buffer.layout import run_file_set
from buffer.store import read_table

if TYPE_CHECKING:
    from pipeline.config import Config


class Progress:
    """What the live display shows, read from the run's files (metrics shards, buffer index)."""

    def __init__(self, run_dir: Path, cfg: Config):
        self.run, self.cfg = run_dir, cfg
        self.index = None
        self.seen: dict[str, dict] = {}
        self.started = time.time()

    def _metrics_rows(self) -> list[dict]:
        """The newest row of each live metrics file (files the compactor merged away are forgotten)."""
        mdir = self.run / "metrics"
        if mdir.is_dir():
            live = run_file_set(mdir, "metrics").live_names()
            for name in live:
                if name not in self.seen:
                    try:
                        table = read_table(mdir / name)
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
