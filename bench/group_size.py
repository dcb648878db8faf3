"""The group-size and temperature trade-offs on the default task, at a fixed budget of generated tokens.

    python bench/group_size.py [--groups 2,4,8,16] [--temperatures 0.3,0.7,1.0] [--seeds 1]
                               [--steps 60] [--eval-every 20] [--out runs/bench/group_size] [--set KEY=VALUE ...]

Every cell is one `asyncgrpo ablate` cell (staleness 2, decoupled IS, the default
config otherwise), run one after another; an interrupted benchmark resumes.

    G sweep            generator.num_generations = G and trainer.groups_per_step = 256 / G, so every
                       step trains on 256 completions whatever G is (G = 2: 128 prompts of 2)
    temperature sweep  generator.sampling.temperature = T at the default G = 8

All cells take the same number of steps (--steps), so they are offered the same
number of trained completions; what they generate to get there differs (a small
G or a low temperature wastes more groups whose rewards are all equal). Generated
tokens up to version v are counted with SQL as sum(num_tokens) over the rollouts
sampled with versions < v, filtered groups included. The fixed budget is the
smallest total any cell generated; each cell's accuracy at that budget is the
greedy accuracy (run.eval_size held-out prompts) of its last kept version
generated within it.

Per cell it reports:

    accuracy_at_budget   greedy accuracy at the common token budget
    final_accuracy       after --steps steps, and the tokens it took (generated_tokens)
    filtered_frac        groups with all rewards equal / all groups; all_correct_frac and all_wrong_frac
                         split it by reason (shares of all groups)
    advantage_noise      mean over trainable groups of reward_std / sqrt(G): the standard error of the
                         group mean that every advantage of the group subtracts
    tokens_per_trained   generated tokens per completion trained on (waste included)

Writes group_size.md, group_size.csv and group_size.png (accuracy against generated
tokens, one line per cell) in --out; progress on stderr; the last line on stdout
is one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMPLETIONS_PER_STEP = 256     # the default's 32 groups x G = 8


def log(msg: str) -> None:
    print(f"[bench/group_size {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tokens_by_version(db) -> dict[int, int]:
    """Generated tokens of each version (filtered groups included)."""
    rows = db.query("SELECT version, sum(num_tokens) AS t FROM rollouts GROUP BY 1").to_pylist()
    return {int(r["version"]): int(r["t"]) for r in rows}


def generated_before(tokens: dict[int, int], version: int) -> int:
    return sum(t for v, t in tokens.items() if v < version)


def group_figures(db, g: int) -> dict:
    r = db.query(
        "SELECT count(*) AS groups, avg(CAST(filtered AS DOUBLE)) AS filtered, "
        "avg(CAST(coalesce(filter_reason = 'all_correct', false) AS DOUBLE)) AS all_correct, "
        "avg(CAST(coalesce(filter_reason = 'all_wrong', false) AS DOUBLE)) AS all_wrong, "
        f"avg(CASE WHEN NOT filtered THEN reward_std / sqrt({g}) END) AS noise FROM groups").to_pylist()[0]
    trained = db.query("SELECT count(*) AS n FROM consumed").to_pylist()[0]["n"] * g
    return {"groups": r["groups"], "filtered_frac": r["filtered"], "all_correct_frac": r["all_correct"],
            "all_wrong_frac": r["all_wrong"], "advantage_noise": r["noise"], "trained_completions": trained}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "default.toml"))
    ap.add_argument("--groups", default="2,4,8,16", help="G values (each must divide 256)")
    ap.add_argument("--temperatures", default="0.3,0.7,1.0")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--steps", type=int, default=60, help="trainer.max_steps of every cell")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--out", default="runs/bench/group_size")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    from buffer import BufferSQL
    from pipeline.ablate import Ablation, Cell, parse_list, run_ablation, seed_value

    seeds = parse_list("--seeds", args.seeds, seed_value)
    groups = parse_list("--groups", args.groups, int)
    temps = parse_list("--temperatures", args.temperatures, float)
    for g in groups:
        if g < 2 or COMPLETIONS_PER_STEP % g:
            sys.exit(f"--groups: {g} must be >= 2 and divide {COMPLETIONS_PER_STEP}")
    settings = [(f"G{g}", g, (("generator.num_generations", str(g)),
                              ("trainer.groups_per_step", str(COMPLETIONS_PER_STEP // g)))) for g in groups]
    settings += [(f"T{t:g}", 8, (("generator.sampling.temperature", str(t)),)) for t in temps]
    cells, meta = [], {}
    for seed in seeds:
        for label, g, sweep in settings:
            c = Cell(2, "decoupled", seed, sweep, label=label)
            cells.append(c)
            meta[c.name] = (label, g)
    overrides = [f"trainer.max_steps={args.steps}", "run.time_limit_s=none", *args.overrides]
    ab = Ablation(args.config, overrides, cells, Path(args.out), args.eval_every, "+0.10")
    ab.check()
    log(f"{len(cells)} cells of {args.steps} steps into {args.out}")
    run_ablation(ab, echo=log)

    per_cell = []
    for c in cells:
        label, g = meta[c.name]
        run = ab.cell_dir(c)
        result = json.loads((run / "cell.json").read_text())
        db = BufferSQL(run)
        tokens = tokens_by_version(db)
        curve = [{**p, "generated_tokens": generated_before(tokens, p["version"])} for p in result["curve"]]
        per_cell.append({"cell": c.name, "setting": label, "seed": c.seed, "G": g, "curve": curve,
                         "final_accuracy": result["row"]["final_accuracy"],
                         "generated_tokens": sum(tokens.values()), **group_figures(db, g)})
    budget = min(r["curve"][-1]["generated_tokens"] for r in per_cell)
    for r in per_cell:
        within = [p for p in r["curve"] if p["generated_tokens"] <= budget]
        r["accuracy_at_budget"] = within[-1]["accuracy"]
        r["tokens_per_trained"] = r["generated_tokens"] / max(r["trained_completions"], 1)

    out = Path(args.out)
    write_table(out, per_cell, budget)
    plot(out / "group_size.png", per_cell, budget)
    summary = {}
    for label, _, _ in settings:
        rs = [r for r in per_cell if r["setting"] == label]
        summary[label] = {k: statistics.median(r[k] for r in rs) for k in
                          ("accuracy_at_budget", "final_accuracy", "generated_tokens", "filtered_frac",
                           "all_correct_frac", "all_wrong_frac", "advantage_noise", "tokens_per_trained")}
    log(f"wrote {out / 'group_size.md'}, {out / 'group_size.csv'}, {out / 'group_size.png'}")
    print(json.dumps({"token_budget": budget, "steps": args.steps, "seeds": seeds,
                      "accuracy_before": per_cell[0]["curve"][0]["accuracy"], "settings": summary}))


COLUMNS = ["setting", "seed", "accuracy_at_budget", "final_accuracy", "generated_tokens", "tokens_per_trained",
           "filtered_frac", "all_correct_frac", "all_wrong_frac", "advantage_noise"]


def write_table(out: Path, rows: list[dict], budget: int) -> None:
    with open(out / "group_size.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = [f"Accuracy at a budget of {budget:,} generated tokens (greedy, held-out prompts).", "",
             "| setting | seed | acc at budget | final acc | generated tokens | tokens / trained completion "
             "| filtered | all correct | all wrong | advantage noise |", "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['seed']} | {r['accuracy_at_budget']:.1%} | {r['final_accuracy']:.1%} "
                     f"| {r['generated_tokens']:,} | {r['tokens_per_trained']:.1f} | {r['filtered_frac']:.1%} "
                     f"| {r['all_correct_frac']:.1%} | {r['all_wrong_frac']:.1%} | "
                     + ("-" if r["advantage_noise"] is None or math.isnan(r["advantage_noise"])
                        else f"{r['advantage_noise']:.3f}") + " |")
    (out / "group_size.md").write_text("\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict], budget: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, prefix, title in ((axes[0], "G", "group size G"), (axes[1], "T", "temperature (G = 8)")):
        for r in rows:
            if r["setting"].startswith(prefix):
                ax.plot([p["generated_tokens"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]],
                        marker="o", label=f"{r['setting']} seed {r['seed']}")
        ax.axvline(budget, color="grey", linestyle=":", label="common budget")
        ax.set(xlabel="generated tokens", ylabel="greedy accuracy", title=title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
