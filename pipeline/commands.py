"""The pipeline's commands: run, generate, train, eval, init-model, warmstart, config, ablate.

Thin wrappers: they read the config, turn bad input into one-paragraph errors
(exit code 2) and call into workers/ and pipeline/run.py. torch is imported
inside the commands, so `--help` stays fast.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import click

from pipeline.cli import UserError, _user_errors, main

CONFIG_ARG = click.argument("config", required=False, type=click.Path(dir_okay=False))
SET_OPT = click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
                       help="Override one config field (repeatable), e.g. --set trainer.lr=1e-5.")


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for noisy in ("httpx", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _run_config(run: str, overrides: tuple[str, ...] = ()):
    """The resolved config of run directory `run` (with overrides), or a clear error."""
    from pipeline.config import load_run_config, with_overrides

    run_dir = Path(run)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run!r} does not exist; start a run with `asyncgrpo run --run {run}`")
    cfg = load_run_config(run_dir)
    return with_overrides(cfg, list(overrides)) if overrides else cfg


@main.command()
@CONFIG_ARG
@click.option("--run", "run_dir", type=click.Path(file_okay=False), default="runs/default", show_default=True,
              help="Run directory (created; holds config.toml, buffer/, weights/, metrics/, logs/).")
@SET_OPT
@click.option("--resume", is_flag=True, help="Continue the run in --run from its checkpoint and config.")
@click.option("--force", is_flag=True, help="Delete --run first if it holds an earlier run.")
@_user_errors
def run(config: str | None, run_dir: str, overrides: tuple[str, ...], resume: bool, force: bool) -> None:
    """Run the whole pipeline: 1 trainer and N generators, supervised, with a live display.

    CONFIG is a TOML file of overrides (default: the built-in defaults, which
    train the embedded tiny model on the arithmetic task on the CPU). Prints
    greedy accuracy on held-out prompts before and after, the run directory
    and SQL queries to try. A crashed generator is restarted; if the trainer
    crashes the run stops and `--resume` continues it. Ctrl-C stops
    everything cleanly.

    \b
    Examples:
      asyncgrpo run                                   # the default job (what `make run` runs)
      asyncgrpo run configs/default.toml --run runs/a --set trainer.max_staleness=4
      asyncgrpo run --resume --run runs/a
    """
    from pipeline.config import load_config, load_run_config, with_overrides
    from pipeline.run import run_pipeline

    _logging()
    path = Path(run_dir)
    if resume:
        if config is not None:
            raise UserError("--resume takes the config saved in the run directory; drop CONFIG "
                            "(use --set to change a field)")
        cfg = load_run_config(path)
        cfg = with_overrides(cfg, list(overrides)) if overrides else cfg
    else:
        cfg = load_config(config, overrides)
        if path.exists() and any(path.iterdir()):
            if not force:
                raise UserError(f"run directory {run_dir!r} already holds a run; pass --resume to "
                                "continue it, --force to start over, or choose another --run")
            shutil.rmtree(path)
    run_pipeline(path, cfg, resume=resume, echo=click.echo)


@main.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False), help="Run directory.")
@click.option("--index", type=click.IntRange(min=0), default=0, show_default=True,
              help="Generator number: its seed is run.seed + 1000 * (index + 1), its name gen<index>.")
@SET_OPT
@_user_errors
def generate(run_dir: str, index: int, overrides: tuple[str, ...]) -> None:
    """Run one generator daemon on the run in --run until SIGTERM / SIGINT.

    Samples G completions per prompt with the newest published weights,
    scores them and appends groups to <run>/buffer. Other machines can run
    generators too, pointed at the same (shared) run directory.

    \b
    Example:
      asyncgrpo generate --run runs/default --index 1
    """
    from workers.generator import Admission, run_generator
    from workers.rewards import Scorer
    from workers.tasks import load_task

    _logging()
    cfg = _run_config(run_dir, overrides)
    totals = run_generator(
        run_dir, cfg.generator, task=load_task(cfg.task), scorer=Scorer(cfg.reward),
        admission=Admission(cfg.trainer.max_staleness, cfg.trainer.groups_per_step),
        generator_id=f"gen{index}", seed=cfg.run.seed + 1000 * (index + 1),
        model_dtype=cfg.model.dtype, device=cfg.model.device)
    click.echo(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()}))


@main.command()
@click.option("--run", "--run-dir", "run_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory (--run-dir under torchrun, whose parser claims --run).")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint (exactly: the ledger is "
              "rolled back to it).")
@click.option("--offline", is_flag=True, help="Train from the buffer as it is, with no generators "
              "(no staleness limit; trainer.reuse passes).")
@SET_OPT
@_user_errors
def train(run_dir: str, resume: bool, offline: bool, overrides: tuple[str, ...]) -> None:
    """Run the trainer daemon on the run in --run.

    Pulls groups within trainer.max_staleness, takes GRPO steps, publishes
    weights to <run>/weights and metrics to <run>/metrics. Also runs under
    torchrun (rank 0 pulls, all ranks train).

    \b
    Examples:
      asyncgrpo train --run runs/default --resume
      asyncgrpo train --run runs/old --offline --set trainer.max_steps=50
      torchrun --standalone --nproc_per_node 2 -m pipeline train --run-dir runs/default
    """
    from pipeline.run import read_run_info
    from workers.trainer import run_trainer

    _logging()
    cfg = _run_config(run_dir, overrides)
    info = read_run_info(Path(run_dir))
    model = info.get("initial_model") or cfg.model.path
    if model is None:
        raise UserError(f"{run_dir!r} names no initial model (run.json missing); start it with "
                        "`asyncgrpo run`, or set model.path")
    _check_model_matches_buffer(Path(run_dir), Path(model))
    run_trainer(Path(run_dir), cfg.trainer, model_folder=Path(model), resume=resume, offline=offline)


def _check_model_matches_buffer(run_dir: Path, model: Path) -> None:
    """A buffer written with another tokenizer would train on garbage: refuse it."""

    from buffer import BufferDir, BufferSQL
    from workers.model import load_tokenizer

    if not BufferDir.is_buffer(run_dir / "buffer"):
        return
    tok = load_tokenizer(model)
    row = BufferSQL(run_dir).query("SELECT prompt, prompt_ids FROM rollouts LIMIT 1").to_pylist()
    if row and tok(row[0]["prompt"])["input_ids"] != row[0]["prompt_ids"]:
        raise UserError(f"the buffer in {run_dir} was written with another tokenizer than the model in "
                        f"{model} (prompt {row[0]['prompt']!r} has other token ids); use a new run directory")


@main.command(name="eval")
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False), help="Run directory.")
@click.option("--version", "version", type=click.IntRange(min=0), default=None,
              help="Weights version to evaluate [default: the newest published].")
@click.option("--size", type=click.IntRange(min=1), default=None, help="Held-out prompts [default: run.eval_size].")
@_user_errors
def eval_cmd(run_dir: str, version: int | None, size: int | None) -> None:
    """Greedy accuracy of a run's weights on the task's held-out prompts.

    \b
    Examples:
      asyncgrpo eval --run runs/default
      asyncgrpo eval --run runs/default --version 0 --size 500
    """
    from dataclasses import replace

    from pipeline.run import evaluate_folder
    from workers.weights import WeightStore

    cfg = _run_config(run_dir)
    if size is not None:
        cfg = replace(cfg, run=replace(cfg.run, eval_size=size))
    store = WeightStore(Path(run_dir) / "weights")
    v = store.latest() if version is None else version
    if v is None:
        raise UserError(f"{run_dir!r} has no published weights yet")
    folder = store.folder(v)
    if not folder.is_dir():
        raise UserError(f"weights version {v} of {run_dir!r} is not on disk (pruned or never published); "
                        f"newest: {store.latest()}")
    acc = evaluate_folder(cfg, folder)
    click.echo(json.dumps({"version": v, "greedy_accuracy": acc, "eval_size": cfg.run.eval_size}))


@main.command(name="init-model")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Overwrite FOLDER if it exists.")
@_user_errors
def init_model_cmd(folder: str, seed: int, force: bool) -> None:
    """Build the embedded tiny Qwen2 model (random weights, character tokenizer) as an HF folder.

    \b
    Example:
      asyncgrpo init-model runs/tiny-init
    """
    from workers.model import init_model

    if Path(folder).exists() and not force:
        raise UserError(f"{folder!r} exists; pass --force to overwrite it")
    click.echo(str(init_model(folder, seed=seed, force=force)))


@main.command()
@CONFIG_ARG
@SET_OPT
@_user_errors
def warmstart(config: str | None, overrides: tuple[str, ...]) -> None:
    """Build and warm-start the embedded model on the task (supervised), cached; prints its folder.

    Stops at the first check where greedy accuracy on a held-out dev split
    reaches warmstart.target_accuracy (30%), at most warmstart.steps steps;
    `asyncgrpo run` does this itself when model.path is unset. Prints the
    folder, what decided the stop, and dev and eval accuracy.

    \b
    Examples:
      asyncgrpo warmstart
      asyncgrpo warmstart --set warmstart.target_accuracy=0.35
      asyncgrpo warmstart --set warmstart.target_accuracy=none --set warmstart.steps=600
    """
    from pipeline.config import load_config
    from pipeline.run import evaluate_folder, prepare_model

    _logging()
    cfg = load_config(config, overrides)
    if cfg.model.path is not None:
        raise UserError("model.path is set: warm start builds only the embedded model; unset model.path")
    folder = prepare_model(cfg, click.echo)
    stop = json.loads((folder / "asyncgrpo.json").read_text())["warmstart"]
    click.echo(json.dumps({"folder": str(folder), "greedy_accuracy": evaluate_folder(cfg, folder),
                           **{k: stop[k] for k in ("steps", "decided_by", "dev_accuracy", "eval_accuracy")}}))


@main.command()
@CONFIG_ARG
@SET_OPT
@click.option("--explain", is_flag=True, help="Every field with its type, default and meaning.")
@_user_errors
def config(config: str | None, overrides: tuple[str, ...], explain: bool) -> None:
    """Check a config file and print it fully resolved (TOML), or explain every field.

    \b
    Examples:
      asyncgrpo config configs/default.toml --set trainer.lr=1e-5
      asyncgrpo config --explain
    """
    from pipeline.config import Config, load_config
    from pipeline.schema import explain as explain_fields
    from pipeline.schema import to_dict

    if explain:
        for key, tp, default, doc in explain_fields(Config):
            click.echo(f"{key} = {default!r}    ({tp})\n    {doc}\n")
        return
    import tomli_w

    click.echo(tomli_w.dumps(to_dict(load_config(config, overrides))))


@main.command()
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
@_user_errors
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
    from pipeline.ablate import (Ablation, AblateError, is_mode_value, make_cells, parse_list, parse_sweep,
                                 run_ablation, seed_value, staleness_value)

    _logging()
    try:
        cells = make_cells(parse_list("--staleness", staleness, staleness_value),
                           parse_list("--is-mode", is_modes, is_mode_value),
                           parse_list("--seeds", seeds, seed_value), [parse_sweep(s) for s in sweeps])
        ab = Ablation(config, list(overrides), cells, Path(out), eval_every, target,
                      replay=Path(replay) if replay else None)
        ab.check()
        run_ablation(ab, echo=click.echo)
    except AblateError as e:
        raise UserError(str(e)) from None
    except KeyboardInterrupt:
        click.echo(f"interrupted; run the same command again to resume (finished cells in {out} are kept)",
                   err=True)
        raise SystemExit(130) from None
