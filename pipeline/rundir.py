"""A run directory's own files: run.json, the initial model, and evaluating a folder of weights.

    <run>/run.json      {"initial_model": folder, "eval_before": accuracy, "summary": {...}}
    <run>/config.toml   the resolved config (pipeline.config.save_config)

Every file here is written whole or not at all (temp file, fsync, rename).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from buffer.layout import atomic_write_bytes
from workers.evaluate import greedy_accuracy_folder
from workers.chat import check_chat_template
from workers.model import check_model_folder, load_tokenizer
from workers.rewards import Scorer
from workers.tasks import load_task
from workers.warmstart import cached_model

if TYPE_CHECKING:
    from pipeline.config import Config

RUN_INFO = "run.json"


def write_json(path: Path, data: dict) -> None:
    """`data` as indented JSON at `path`, atomically (a crash leaves the old file or none)."""
    atomic_write_bytes(path.parent, path, json.dumps(data, indent=1).encode())


def read_run_info(run_dir: Path) -> dict:
    p = run_dir / RUN_INFO
    return json.loads(p.read_text()) if p.is_file() else {}


def write_run_info(run_dir: Path, info: dict) -> None:
    write_json(run_dir / RUN_INFO, info)


def prepare_model(cfg: Config, echo=print) -> Path:
    """The initial policy's folder: the user's, or the embedded model (built and warm-started, cached).

    With task.chat_template = true, a user's folder whose tokenizer has no chat template (or one that
    cannot render a prompt) is a ModelError naming task.chat_template and the folder, here, before
    any daemon starts."""
    if cfg.model.path is not None:
        folder = check_model_folder(Path(cfg.model.path).expanduser())
        check_chat_template(load_tokenizer(folder), cfg.task.chat(), folder)
        return folder
    ws = cfg.warmstart
    stop = (f"until dev accuracy >= {ws.target_accuracy:.0%}, at most {ws.steps} steps"
            if ws.target_accuracy is not None else f"{ws.steps} steps")
    echo(f"preparing the embedded tiny model (warm start {stop}; cached in {cfg.model.cache_dir})")
    return cached_model(Path(cfg.model.cache_dir), cfg.task, cfg.warmstart, progress=True)


def evaluate_folder(cfg: Config, folder: Path) -> float:
    """Greedy accuracy of the weights in `folder` on the held-out prompts."""
    task = load_task(cfg.task)
    prompts = task.eval if cfg.run.eval_size is None else task.eval[: cfg.run.eval_size]
    return greedy_accuracy_folder(folder, prompts, Scorer(cfg.reward),
                                  max_new_tokens=cfg.run.eval_max_new_tokens, chat=task.chat)
