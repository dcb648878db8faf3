"""Configs and experiments: config (check, resolve, --explain) and ablate (staleness sweeps)."""

from __future__ import annotations

from pathlib import Path

import click
import tomli_w

from pipeline.ablate import (Ablation, is_mode_value, make_cells, parse_list, parse_sweep, run_ablation, seed_value,
                             staleness_value)
from pipeline.commands.options import CONFIG_ARG, SET_OPT, setup_logging
from pipeline.config import Config, load_config
from pipeline.errors import user_errors
from pipeline.schema import explain_toml, to_dict
from workers.rewards import Scorer


@click.command()
@CONFIG_ARG
@SET_OPT
@click.option("--explain", is_flag=True, help="Every field with its type, default and meaning.")
@user_errors
def config(config: str | None, overrides: tuple[str, ...], explain: bool) -> None:
    """Check a config file and print it fully resolved (TOML), or explain every field.

    \b
    Examples:
      asyncgrpo config configs/default.toml --set trainer.lr=1e-5
      asyncgrpo config --explain
    """
    if explain:
        click.echo(explain_toml(Config))
        return
    cfg = load_config(config, overrides)
    Scorer(cfg.reward)  # imports the reward functions: a bad import path is an error here, not in a generator
    click.echo(tomli_w.dumps(to_dict(cfg)))


@click.command()
@CONFIG_ARG
@click.option("--staleness", default="0,1,2,4,8", show_default=True, metavar="S1,S2,...",
              help="trainer.max_staleness values; 0 is lockstep (synchronous GRPO), 'none' no limit.")
@click.option("--is-mode", "is_modes", default="none,decoupled", show_default=True, metavar="M1,M2,...",
              help="Lag correction: 'none' = decoupled objective with trainer.loss.is_mode none (no "
                   "importance weight); 'decoupled' = the default, decoupled objective with truncated IS "
                   "pi_old/mu (trainer.loss.is_mode truncate); 'bypass' = plain PPO against the behaviour "
                   "policy (trainer.loss.objective bypass).")
@click.option("--seeds", default="1,2,3", show_default=True, metavar="N1,N2,...",
              help="Seeds (run.seed and trainer.seed); every setting runs with each, on the same prompts.")
@SET_OPT
@click.option("--sweep", "sweeps", multiple=True, metavar="KEY=V1,V2",
              help="Also sweep any config field (repeatable), e.g. --sweep generator.sampling.temperature=0.3,1.0.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory: cells/<cell>/ run directories, logs/, ablation.csv, ablation.md, "
                   "ablation.png, curves.csv. Rerunning with the same --out resumes.")
@click.option("--replay", type=click.Path(file_okay=False), default=None,
              help="Re-train on the rollouts stored in this run directory's buffer (no generator): the "
                   "step clock is replayed against the stored versions, so a group of version v is eligible "
                   "at trainer version t when 0 <= t - v <= staleness.")
@click.option("--eval-every", type=click.IntRange(min=1), default=25, show_default=True,
              help="Keep the weights of every this many steps and evaluate them after the cell (greedy, "
                   "run.eval_size prompts): the accuracy curves. Each costs about one evaluation.")
@click.option("--target", default="+0.10", show_default=True,
              help="Target accuracy for 'time to target': absolute (0.4) or a gain over the accuracy "
                   "before (+0.1).")
@user_errors
def ablate(config: str | None, staleness: str, is_modes: str, seeds: str, overrides: tuple[str, ...],
           sweeps: tuple[str, ...], out: str, replay: str | None, eval_every: int, target: str) -> None:
    """Sweep staleness x IS mode (x any field) x seeds, one `asyncgrpo run` per cell, then compare.

    Every cell gets the same config, prompts, seeds and budget (trainer.max_steps
    and/or run.time_limit_s, which here counts from the trainer's v0, so start-up
    is not part of it; one must be set) and runs alone, one after another, in
    OUT/cells/<cell>. A cell that finished is skipped when the command is run
    again; a half-finished one is done again. Writes ablation.csv and
    ablation.md (staleness, IS mode, seed, final greedy accuracy, time to target,
    steps/s, mean staleness, expired and filtered fractions, trainer and
    generator idle shares; then means over seeds), curves.csv and ablation.png
    (accuracy against wall time and against step, mean over seeds with a
    min..max band).

    With --replay RUN no rollouts are generated: each cell's trainer starts
    from RUN's initial model and trains on a linked copy of RUN's buffer. The
    data of version v arrives when the replayed trainer reaches version v
    (eligible at trainer version t when 0 <= t - v <= staleness, oldest
    first), and a cell ends at its budget or when no step can be filled for
    trainer.max_wait_seconds (3 s unless set).

    \b
    Examples:
      asyncgrpo ablate configs/default.toml --out runs/ablation
      asyncgrpo ablate --staleness 0,2 --is-mode decoupled --seeds 1 --set trainer.max_steps=100 --out runs/a
      asyncgrpo ablate --staleness 0,4 --seeds 1 --sweep generator.num_generations=4,8 --out runs/g
      asyncgrpo ablate --staleness 0,2,8 --seeds 1 --replay runs/default --out runs/replay
    """
    setup_logging()
    try:
        cells = make_cells(parse_list("--staleness", staleness, staleness_value),
                           parse_list("--is-mode", is_modes, is_mode_value),
                           parse_list("--seeds", seeds, seed_value), [parse_sweep(s) for s in sweeps])
        ab = Ablation(config, list(overrides), cells, Path(out), eval_every, target,
                      replay=Path(replay) if replay else None)
        ab.check()
        run_ablation(ab, echo=click.echo)
    except KeyboardInterrupt:
        click.echo(f"interrupted; run the same command again to resume (finished cells in {out} are kept)",
                   err=True)
        raise SystemExit(130) from None
