"""Asynchronous against synchronous GRPO on the default task: time to a target greedy accuracy.

    python bench/async_vs_sync.py [--seeds 1,2,3] [--time-limit 60] [--target +0.20] [--eval-every 5]
                                  [--out runs/bench/async_vs_sync] [--set KEY=VALUE ...]

The budget is run.time_limit_s per run, counted from the trainer's v0 (start-up excluded);
all three settings poll at 20 ms (see FAST_POLL). About 11 minutes on a 2-core machine.

Three settings, each run with every seed, one run at a time (`asyncgrpo ablate`
cells in --out, so an interrupted benchmark resumes where it stopped):

    sync         lockstep (trainer.max_staleness = 0): the generator samples with version t only,
                 then waits for t + 1; trainer pinned to core 0, generator to core 1, one thread each
    async        staleness 2 with the decoupled objective and truncated IS (the trainer's default),
                 pinned and one thread each as above
    shared_sync  lockstep with nothing pinned and two threads per process: the phases take turns on
                 both cores (the honest baseline on one small machine)

Pinning one core to each daemon emulates separate rollout and training hardware,
where asynchrony pays: the best it can do is hide the cheaper phase, so its time
per step relative to lockstep is bounded below by the overlap limit

    overlap_limit = max(t_gen, t_train) / (t_gen + t_train)

with t_gen and t_train the busy seconds per trainer step of each phase, measured
in the same sync runs (generator: generate + score + reload, from generator_metrics;
trainer: step minus waiting, from metrics). ratio = async / sync time to target;
the target is ratio <= 1.1 x overlap_limit.

Time to target: from the start of the trainer's first step to the first version
(kept every --eval-every steps) whose greedy accuracy on run.eval_size held-out
prompts reaches the target; medians over seeds (a seed that never reaches it
counts as infinitely slow; a median that is infinite is reported as null).
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {
    "sync": (0, ["run.pin_cores=true", "generator.num_threads=1", "trainer.num_threads=1"]),
    "async": (2, ["run.pin_cores=true", "generator.num_threads=1", "trainer.num_threads=1"]),
    "shared_sync": (0, ["run.pin_cores=false", "generator.num_threads=2", "trainer.num_threads=2"]),
}
ASYNC_STALENESS = MODES["async"][0]
# Lockstep hands over twice a step (groups to the trainer, weights to the generator), each after a
# poll: at the daemons' defaults (0.25 s, 0.2 s) that idles both phases for ~0.4 s of a ~1 s step,
# which would flatter asynchrony. Every mode polls at 20 ms here.
FAST_POLL = ["trainer.poll_seconds=0.02", "generator.poll_seconds=0.02"]


def log(msg: str) -> None:
    print(f"[bench/async_vs_sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def phase_seconds(run: Path) -> tuple[float, float]:
    """(generator busy s, trainer busy s) per trainer step of one run."""
    from buffer import BufferSQL

    db = BufferSQL(run)
    t = db.query('SELECT max(step) AS steps, sum("time/step_s" - "time/wait_s") AS busy FROM metrics'
                 ).to_pylist()[0]
    g = db.query("SELECT sum(seconds - wait_s) AS busy FROM generator_metrics WHERE batch > 0").to_pylist()[0]
    return g["busy"] / t["steps"], t["busy"] / t["steps"]


def median_or_none(values: list[float | None]) -> float | None:
    m = statistics.median([float("inf") if v is None else v for v in values])
    return None if m == float("inf") else m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "default.toml"))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--time-limit", type=float, default=60.0, help="run.time_limit_s of every run (the budget)")
    ap.add_argument("--target", default="+0.20", help="accuracy (0.35) or gain over the start (+0.05)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--out", default="runs/bench/async_vs_sync")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    from pipeline.ablate import Ablation, Cell, parse_list, run_ablation, seed_value

    seeds = parse_list("--seeds", args.seeds, seed_value)
    cells, mode_of = [], {}
    for seed in seeds:
        for mode, (staleness, sets) in MODES.items():
            c = Cell(staleness, "decoupled", seed, tuple(tuple(s.split("=", 1)) for s in sets), label=mode)
            cells.append(c)
            mode_of[c.name] = mode
    overrides = [f"run.time_limit_s={args.time_limit}", "trainer.max_steps=none", *FAST_POLL, *args.overrides]
    ab = Ablation(args.config, overrides, cells, Path(args.out), args.eval_every, args.target)
    ab.check()
    load_before = os.getloadavg()
    log(f"{len(cells)} runs of {args.time_limit:.0f} s each into {args.out}; load average {load_before}")
    rows = run_ablation(ab, echo=log)

    by_mode: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in rows:
        by_mode[mode_of[r["cell"]]].append(r)
    gen, train = zip(*(phase_seconds(ab.cell_dir(c)) for c in cells if mode_of[c.name] == "sync"))
    t_gen, t_train = statistics.median(gen), statistics.median(train)
    overlap = max(t_gen, t_train) / (t_gen + t_train)
    ttt = {m: median_or_none([r["time_to_target_s"] for r in rs]) for m, rs in by_mode.items()}
    ratio = ttt["async"] / ttt["sync"] if ttt["async"] is not None and ttt["sync"] else None
    result = {
        "sync_time_to_target_s": ttt["sync"], "async_time_to_target_s": ttt["async"], "ratio": ratio,
        "overlap_limit": overlap, "shared_sync_time_to_target_s": ttt["shared_sync"],
        "target_accuracy": statistics.median(r["target_accuracy"] for r in rows), "staleness": ASYNC_STALENESS,
        "target_met": ratio is not None and ratio <= 1.1 * overlap,
        "t_gen_s_per_step": t_gen, "t_train_s_per_step": t_train,
        "steps_per_s": {m: statistics.median(r["steps_per_s"] or 0.0 for r in rs) for m, rs in by_mode.items()},
        "final_accuracy": {m: statistics.median(r["final_accuracy"] for r in rs) for m, rs in by_mode.items()},
        "reached_target": {m: sum(r["time_to_target_s"] is not None for r in rs) for m, rs in by_mode.items()},
        "seeds": seeds, "time_limit_s": args.time_limit, "eval_every": args.eval_every,
        "cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
