"""What one ablation cell measured, and the sweep's CSV, Markdown table and plot.

Per cell (all read from its run directory):

    final_accuracy      greedy accuracy of the last weights on run.eval_size held-out prompts
    time_to_target_s    wall time from the trainer's first step to the first kept version whose
                        greedy accuracy reached the target (resolution: eval_every steps); None: never
    steps_per_s         trainer steps / wall time from the first step's start to the last row
    mean_staleness      avg(staleness) over the ledger (every consumed group)
    expired_frac        expired / all groups at the final version and limit
    filtered_frac       filtered (all rewards equal) / all groups
    trainer_idle_share  sum(time/wait_s) / sum(time/step_s) over the metrics rows
    generator_idle_share  sum(wait_s) / sum(seconds) over generator_metrics (None in replay)

Wall time is counted from the start of the trainer's first step (it then waits for
the generators' first groups, which is part of the run's cost), and kept versions
are placed on it by their weights.json `published_at`.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import buffer
from buffer.layout import atomic_file, atomic_write_bytes
from pipeline.ablate.spec import EVAL_WEIGHTS, parse_target, stopped_by
from pipeline.rundir import evaluate_folder, read_run_info

COLUMNS = [  # (csv column, markdown header, format)
    ("staleness", "staleness", "{}"),
    ("is_mode", "IS mode", "{}"),
    ("seed", "seed", "{}"),
    ("final_accuracy", "final greedy acc", "{:.1%}"),
    ("time_to_target_s", "time to target (s)", "{:.0f}"),
    ("steps_per_s", "steps/s", "{:.2f}"),
    ("mean_staleness", "mean staleness", "{:.2f}"),
    ("expired_frac", "expired", "{:.1%}"),
    ("filtered_frac", "filtered", "{:.1%}"),
    ("trainer_idle_share", "trainer idle", "{:.0%}"),
    ("generator_idle_share", "generator idle", "{:.0%}"),
]
EXTRA = ["cell", "setting", "accuracy_before", "target_accuracy", "step_to_target", "steps", "wall_s", "stopped_by",
         "replay", "eval_points"]


def _one(db, sql: str) -> dict:
    try:
        rows = db.query(sql).to_pylist()
    except buffer.SqlError:  # the view does not exist (no metrics yet, no generator)
        return {}
    return rows[0] if rows else {}


def cell_result(run: Path, cell, cfg, target: str, *, replay: bool) -> dict:
    """The cell's row and accuracy curve; evaluates the kept versions (greedy, run.eval_size prompts)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    info = read_run_info(run)
    summary = info["summary"]
    db = buffer.BufferSQL(run)
    m = _one(db, 'SELECT max(step) AS steps, sum("time/wait_s") AS wait, sum("time/step_s") AS busy, '
                 'min(time - "time/step_s") AS t0, max(time) AS t1 FROM metrics')
    steps = int(m.get("steps") or 0)
    t0 = m.get("t0")
    stale = _one(db, "SELECT avg(staleness) AS s FROM consumed").get("s")
    gen_idle = None if replay else _one(
        db, "SELECT sum(wait_s) / sum(seconds) AS idle FROM generator_metrics").get("idle")
    version = summary.get("version") or 0
    counts = buffer.GroupIndex(run / "buffer", quarantine=False).counts(version, cfg.trainer.max_staleness)
    groups = max(counts["groups"], 1)

    curve = []
    final_version = summary.get("version")
    folders = sorted((run / EVAL_WEIGHTS).glob("v" + "[0-9]" * 8)) if (run / EVAL_WEIGHTS).is_dir() else []
    for folder in folders:
        meta = json.loads((folder / "weights.json").read_text())
        v = int(meta["version"])
        if t0 is None:
            t0 = meta["published_at"]
        acc = (info["eval_before"] if v == 0 else summary["eval_after"] if v == final_version
               else evaluate_folder(cfg, folder))
        curve.append({"step": int(meta.get("step", v)), "version": v, "accuracy": acc,
                      "wall_s": 0.0 if v == 0 else max(meta["published_at"] - t0, 0.0)})
    if not curve or curve[0]["version"] != 0:
        curve.insert(0, {"step": 0, "version": 0, "accuracy": info["eval_before"], "wall_s": 0.0})

    goal = parse_target(target, info["eval_before"])
    hit = next((p for p in curve if p["accuracy"] >= goal), None)
    wall = (m["t1"] - m["t0"]) if m.get("t1") is not None else None
    row = {
        "cell": cell.name, "setting": cell.label or "", "staleness": "none" if cell.staleness is None else cell.staleness,
        "is_mode": cell.is_mode, **{k: v for k, v in cell.sweep}, "seed": cell.seed,
        "accuracy_before": info["eval_before"], "final_accuracy": summary["eval_after"],
        "target_accuracy": goal, "time_to_target_s": hit["wall_s"] if hit else None,
        "step_to_target": hit["step"] if hit else None, "steps": steps,
        "steps_per_s": steps / wall if wall else None,
        "mean_staleness": stale,
        "expired_frac": counts["expired"] / groups, "filtered_frac": counts["filtered"] / groups,
        "trainer_idle_share": m["wait"] / m["busy"] if m.get("busy") else None,
        "generator_idle_share": gen_idle, "wall_s": wall, "stopped_by": stopped_by(run, summary),
        "replay": info.get("replay_of", ""), "eval_points": len(curve),
    }
    return {"row": row, "curve": curve, "setting": cell.setting}


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return spec.format(v)


def write_outputs(out: Path, results: list[dict], cells) -> None:
    """ablation.csv (one row per cell), curves.csv, ablation.md and ablation.png."""
    sweep_keys = list(dict.fromkeys(k for c in cells for k, _ in c.sweep))
    rows = [r["row"] for r in results]
    header = ["cell", "staleness", "is_mode", *sweep_keys, "seed"] + \
        [c for c, _, _ in COLUMNS[3:]] + [c for c in EXTRA if c != "cell"]
    _write_csv(out / "ablation.csv", header, rows)
    _write_csv(out / "curves.csv", ["cell", "setting", "seed", "step", "version", "wall_s", "accuracy"],
               [{"cell": r["row"]["cell"], "setting": r["setting"], "seed": r["row"]["seed"], **p}
                for r in results for p in r["curve"]])
    atomic_write_bytes(out, out / "ablation.md", markdown(results, sweep_keys).encode())
    plot(out / "ablation.png", results)


def _write_csv(path: Path, header: list[str], rows: list[dict]) -> None:
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=header, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r.get(k) is None else r.get(k) for k in header})
    atomic_write_bytes(path.parent, path, text.getvalue().encode())


def markdown(results: list[dict], sweep_keys: list[str]) -> str:
    short = [k.rsplit(".", 1)[-1] for k in sweep_keys]
    heads = [s if short.count(s) == 1 else k for s, k in zip(short, sweep_keys)]
    labelled = [("setting", "setting", "{}")] if any(r["row"].get("setting") for r in results) else []
    cols = labelled + COLUMNS[:2] + [(k, h, "{}") for k, h in zip(sweep_keys, heads)] + COLUMNS[2:]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(_fmt(r["row"].get(k), f) for k, _, f in cols) + " |")
    mean_cols = [c for c in cols if c[0] != "seed"]
    by_setting: dict[str, list[dict]] = {}
    for r in results:
        by_setting.setdefault(r["setting"], []).append(r["row"])
    means = ["| " + " | ".join(h for _, h, _ in mean_cols) + " | seeds |", "|" + "---|" * (len(mean_cols) + 1)]
    for rows in by_setting.values():
        cells = []
        for k, _, f in mean_cols:
            vals = [x.get(k) for x in rows]
            nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if k in ("setting", "staleness", "is_mode") or k in sweep_keys:
                cells.append(str(vals[0]))
            elif k == "time_to_target_s" and len(nums) < len(vals):
                cells.append(f"{_fmt(sum(nums) / len(nums), f) if nums else '-'} ({len(nums)}/{len(vals)} hit)")
            else:
                cells.append(_fmt(sum(nums) / len(nums), f) if nums else "-")
        means.append("| " + " | ".join(cells) + f" | {len(rows)} |")
    target = results[0]["row"]["target_accuracy"] if results else None
    return ("# Ablation\n\nOne row per cell. Time to target: first evaluated version with greedy accuracy >= "
            f"{_fmt(target, '{:.1%}')}; '-' if never reached.\n\n" + "\n".join(lines)
            + "\n\n## Mean over seeds\n\n" + "\n".join(means) + "\n")


def plot(path: Path, results: list[dict]) -> None:
    """Accuracy against wall time and against step: one line per setting, mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    by_setting: dict[str, list[list[dict]]] = {}
    for r in results:
        by_setting.setdefault(r["setting"], []).append(r["curve"])
    for label, curves in by_setting.items():
        for ax, x in ((axes[0], "wall_s"), (axes[1], "step")):
            end = min(max(p[x] for p in c) for c in curves)
            grid = np.unique(np.concatenate([[p[x] for p in c if p[x] <= end] for c in curves]))
            ys = np.array([np.interp(grid, [p[x] for p in c], [p["accuracy"] for p in c]) for c in curves])
            line, = ax.plot(grid, ys.mean(axis=0), label=f"{label} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=line.get_color(), alpha=0.15)
    for ax, xlabel in zip(axes, ("wall time since the first trainer step (s)", "trainer step")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("greedy accuracy (held-out)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="best")
    fig.suptitle("accuracy: mean over seeds, band = min..max")
    fig.tight_layout()
    try:
        with atomic_file(path.parent, path) as f:
            fig.savefig(f, dpi=110, format="png")
    finally:
        plt.close(fig)
