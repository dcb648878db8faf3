"""The daemons and the model: run, generate, train, compactor, eval, init-model, warmstart.

Thin: each command reads its config, calls into pipeline/ or workers/ and prints.
torch loads when a daemon starts (workers.trainer and buffer name their modules
lazily), so `--help` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import click

import buffer
import workers.trainer
from buffer.store import RemotePath, as_path, remove_tree
from pipeline.commands.options import CONFIG_ARG, SET_OPT, run_config, setup_logging
from pipeline.config import load_config, load_run_config, with_overrides
from pipeline.errors import UserError, user_errors
from pipeline.ray_launcher import RayLauncher
from pipeline.run import run_pipeline
from pipeline.rundir import evaluate_folder, prepare_model, read_run_info
from workers.chat import ChatFormat, check_chat_template, encode_prompts
from workers.compactor import run_compactor
from workers.generator import Admission, run_generator
from workers.model import init_model, load_tokenizer
from workers.proc import lower_priority, use_system_allocator
from workers.rewards import Scorer
from workers.tasks import load_task
from workers.remote_weights import open_weights


@click.command()
@CONFIG_ARG
@click.option("--run", "run_dir", type=click.Path(file_okay=False), default="runs/default", show_default=True,
              help="Run directory (created; holds config.toml, buffer/, weights/, metrics/, logs/), or an "
              "object-store URI: s3://, gs:// or az://bucket/prefix (credentials and endpoint from each store's "
              "standard environment variables, never from the config; logs and checkpoints then stay on this "
              "machine, see the README).")
@SET_OPT
@click.option("--resume", is_flag=True, help="Continue the run in --run from its checkpoint and config.")
@click.option("--force", is_flag=True, help="Delete --run first if it holds an earlier run.")
@click.option("--launcher", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where the daemons run: subprocesses of this command, or Ray actors with the [ray] "
              "section's resources (needs pip install -e '.[ray]'; the run directory must then be on "
              "storage every node sees, such as a shared filesystem, at the same path).")
@click.option("--address", envvar="RAY_ADDRESS", default=None, metavar="ADDR",
              help="With --launcher ray: the Ray cluster to join (auto, HOST:6379, ray://HOST:10001; default "
              "$RAY_ADDRESS). Without it a local Ray instance is started and stopped with the run.")
@user_errors
def run(config: str | None, run_dir: str, overrides: tuple[str, ...], resume: bool, force: bool,
        launcher: str, address: str | None) -> None:
    """Run the whole pipeline: 1 trainer and N generators, supervised, with a live display.

    CONFIG is a TOML file of overrides (default: the built-in defaults, which
    train the embedded tiny model on the arithmetic task on the CPU). Prints
    greedy accuracy on held-out prompts before and after, the run directory
    and SQL queries to try. A crashed generator is restarted; if the trainer
    crashes the run stops and `--resume` continues it (with --launcher ray it
    is restarted with --resume, up to ray.max_trainer_restarts times). Ctrl-C
    stops everything cleanly.

    With --launcher ray the daemons are Ray actors, on this machine or on the
    cluster at --address; they share only files, so the run directory (and
    the model folder and task files) must be on a shared filesystem that every
    node mounts at the same path. The display and summary are the same.

    \b
    Examples:
      asyncgrpo run                                   # the default job (what `make run` runs)
      asyncgrpo run configs/default.toml --run runs/a --set trainer.max_staleness=4
      asyncgrpo run --resume --run runs/a
      asyncgrpo run --run runs/chat --set task.chat_template=true --set task.system_prompt=be,brief
      asyncgrpo run --launcher ray --set run.num_generators=2 --set ray.generator_cpus=0.5
      asyncgrpo run configs/gpu_vllm.toml --run /shared/runs/b --launcher ray --address auto
      AWS_ENDPOINT_URL=http://127.0.0.1:9000 asyncgrpo run --run s3://runs/c
    """
    use_system_allocator()   # before pyarrow's import; the daemons it starts inherit it
    setup_logging()
    if launcher == "local" and address is not None and \
            click.get_current_context().get_parameter_source("address") == click.core.ParameterSource.COMMANDLINE:
        raise UserError("--address is for --launcher ray; add --launcher ray, or drop --address")
    path = as_path(run_dir)
    if isinstance(path, RemotePath):
        path.store.check()      # no bucket, bad credentials, endpoint down: one error (exit 2), nothing started
    if resume:
        if config is not None:
            raise UserError("--resume takes the config saved in the run directory; drop CONFIG "
                            "(use --set to change a field)")
        cfg = load_run_config(path)
        cfg = with_overrides(cfg, list(overrides)) if overrides else cfg
    else:
        cfg = load_config(config, overrides)
        if path.exists() and any(path.iterdir()) and not force:
            raise UserError(f"run directory {run_dir!r} already holds a run; pass --resume to "
                            "continue it, --force to start over, or choose another --run")
    where = None
    if launcher == "ray":
        where = RayLauncher(cfg, address=address)   # Ray missing: stopped here, before --force deletes anything
        path = path.absolute()                        # the daemons may start in another directory
    if not resume and path.exists() and any(path.iterdir()):
        remove_tree(path)
    run_pipeline(path, cfg, resume=resume, echo=click.echo, launcher=where)


@click.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory, or an object-store URI (s3://bucket/prefix).")
@click.option("--index", type=click.IntRange(min=0), default=0, show_default=True,
              help="Generator number: its seed is run.seed + 1000 * (index + 1), its name gen<index>.")
@SET_OPT
@user_errors
def generate(run_dir: str, index: int, overrides: tuple[str, ...]) -> None:
    """Run one generator daemon on the run in --run until SIGTERM / SIGINT.

    Samples G completions per prompt with the newest published weights,
    scores them and appends groups to <run>/buffer. Other machines can run
    generators too, pointed at the same (shared) run directory.

    \b
    Example:
      asyncgrpo generate --run runs/default --index 1
    """
    use_system_allocator()   # before pyarrow's import; the generator logs it once it runs
    setup_logging()
    cfg = run_config(run_dir, overrides)
    totals = run_generator(
        run_dir, cfg.generator, task=load_task(cfg.task), scorer=Scorer(cfg.reward),
        admission=Admission(cfg.trainer.max_staleness, cfg.trainer.groups_per_step),
        generator_id=f"gen{index}", seed=cfg.run.seed + 1000 * (index + 1),
        model_dtype=cfg.model.dtype, device=cfg.model.device)
    click.echo(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()}))


@click.command()
@click.option("--run", "--run-dir", "run_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory (--run-dir under torchrun, whose parser claims --run).")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint (exactly: the ledger is "
              "rolled back to it).")
@click.option("--offline", is_flag=True, help="Train from the buffer as it is, with no generators "
              "(no staleness limit; trainer.reuse passes).")
@SET_OPT
@user_errors
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
    use_system_allocator()   # before pyarrow's import; the trainer logs it once it runs
    setup_logging()
    cfg = run_config(run_dir, overrides)
    info = read_run_info(as_path(run_dir))
    model = info.get("initial_model") or cfg.model.path
    if model is None:
        raise UserError(f"{run_dir!r} names no initial model (run.json missing); start it with "
                        "`asyncgrpo run`, or set model.path")
    _check_model_matches_buffer(as_path(run_dir), Path(model), cfg.task.chat())
    workers.trainer.run_trainer(as_path(run_dir), cfg.trainer, model_folder=Path(model), resume=resume, offline=offline)


def _check_model_matches_buffer(run_dir: Path, model: Path, chat: ChatFormat | None) -> None:
    """A model whose tokenizer lacks the chat template asked for, or a buffer written with another
    tokenizer or chat format, would train on garbage: refuse them."""
    tok = load_tokenizer(model)
    check_chat_template(tok, chat, model)
    if not buffer.BufferDir.is_buffer(run_dir / "buffer"):
        return
    row = buffer.BufferSQL(run_dir).query("SELECT prompt, prompt_ids FROM rollouts LIMIT 1").to_pylist()
    if row and encode_prompts(tok, [row[0]["prompt"]], chat)[0] != row[0]["prompt_ids"]:
        raise UserError(f"the buffer in {run_dir} was written with another tokenizer or chat format "
                        f"(task.chat_template) than the model in {model} and this config give (prompt "
                        f"{row[0]['prompt']!r} has other token ids); use a new run directory")


@click.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory, or an object-store URI (s3://bucket/prefix).")
@SET_OPT
@user_errors
def compactor(run_dir: str, overrides: tuple[str, ...]) -> None:
    """Run the compactor daemon on the run in --run until SIGTERM / SIGINT.

    Every compactor.every_s seconds, merges the buffer's sealed small shards
    (older than compactor.min_age_s) into c-files, and the ledger's and the
    metrics' small files likewise, younger ones too down to half of
    compactor.max_unmerged a kind; at once when a kind has more than
    compactor.max_unmerged files unmerged. Level merges of c-files run on a
    thread beside the passes. So the number of live files stays bounded
    however long the run goes and however fast its generators write; safe
    beside generators, the
    trainer and SQL readers. `asyncgrpo run` starts one itself; run this one
    when the daemons of a run are spread over machines (one per run).

    \b
    Example:
      asyncgrpo compactor --run runs/default --set compactor.every_s=60
    """
    use_system_allocator()   # before pyarrow's import; run_compactor logs the allocator
    setup_logging()
    cfg = run_config(run_dir, overrides)
    if cfg.compactor.every_s is None:
        raise UserError("compactor.every_s is none (no compactor); set it, e.g. --set compactor.every_s=30")
    lower_priority(cfg.compactor.nice)
    totals = run_compactor(run_dir, cfg.compactor)
    click.echo(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()}))


@click.command(name="eval")
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory, or an object-store URI (s3://bucket/prefix).")
@click.option("--version", "version", type=click.IntRange(min=0), default=None,
              help="Weights version to evaluate [default: the newest published].")
@click.option("--size", type=click.IntRange(min=1), default=None, help="Held-out prompts [default: run.eval_size].")
@user_errors
def eval_cmd(run_dir: str, version: int | None, size: int | None) -> None:
    """Greedy accuracy of a run's weights on the task's held-out prompts.

    \b
    Examples:
      asyncgrpo eval --run runs/default
      asyncgrpo eval --run runs/default --version 0 --size 500
    """
    cfg = run_config(run_dir)
    if size is not None:
        cfg = replace(cfg, run=replace(cfg.run, eval_size=size))
    store = open_weights(as_path(run_dir))
    v = store.latest() if version is None else version
    if v is None:
        raise UserError(f"{run_dir!r} has no published weights yet")
    folder = store.folder(v)
    if not folder.is_dir():
        raise UserError(f"weights version {v} of {run_dir!r} is not on disk (pruned or never published); "
                        f"newest: {store.latest()}")
    acc = evaluate_folder(cfg, folder)
    click.echo(json.dumps({"version": v, "greedy_accuracy": acc, "eval_size": cfg.run.eval_size}))


@click.command(name="init-model")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Overwrite FOLDER if it exists.")
@user_errors
def init_model_cmd(folder: str, seed: int, force: bool) -> None:
    """Build the embedded tiny Qwen2 model (random weights, character tokenizer) as an HF folder.

    \b
    Example:
      asyncgrpo init-model runs/tiny-init
    """
    if Path(folder).exists() and not force:
        raise UserError(f"{folder!r} exists; pass --force to overwrite it")
    click.echo(str(init_model(folder, seed=seed, force=force)))


@click.command()
@CONFIG_ARG
@SET_OPT
@user_errors
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
      asyncgrpo warmstart --set task.chat_template=true      # on prompts in the chat format
    """
    setup_logging()
    cfg = load_config(config, overrides)
    if cfg.model.path is not None:
        raise UserError("model.path is set: warm start builds only the embedded model; unset model.path")
    folder = prepare_model(cfg, click.echo)
    stop = json.loads((folder / "asyncgrpo.json").read_text())["warmstart"]
    click.echo(json.dumps({"folder": str(folder), "greedy_accuracy": evaluate_folder(cfg, folder),
                           **{k: stop[k] for k in ("steps", "decided_by", "dev_accuracy", "eval_accuracy")}}))
