"""What the commands share: the CONFIG argument, --set, logging, and reading a run's config."""

from __future__ import annotations

import logging

import click

from buffer.store import RemotePath, as_path
from pipeline.config import load_run_config, with_overrides
from pipeline.errors import UserError

CONFIG_ARG = click.argument("config", required=False, type=click.Path(dir_okay=False))
SET_OPT = click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
                       help="Override one config field (repeatable), e.g. --set trainer.lr=1e-5.")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for noisy in ("httpx", "transformers", "filelock", "botocore", "aiobotocore", "s3fs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_config(run: str, overrides: tuple[str, ...] = ()):
    """The resolved config of run directory `run` (with overrides), or a clear error."""
    run_dir = as_path(run)
    exists = (run_dir / "config.toml").is_file() if isinstance(run_dir, RemotePath) else run_dir.is_dir()
    if not exists:
        raise UserError(f"run directory {run!r} does not exist; start a run with `asyncgrpo run --run {run}`")
    cfg = load_run_config(run_dir)
    return with_overrides(cfg, list(overrides)) if overrides else cfg
