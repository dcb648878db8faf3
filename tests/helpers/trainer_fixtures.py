"""Shared pieces of the trainer tests: the tiny model, sampled buffers, running the trainer CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from buffer import ShardWriter
from helpers.trainer_rollouts import make_prompts, sample_groups

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory) -> Path:
    """The embedded tiny model, built once per test session (init_model keeps an existing folder)."""
    from workers.model import init_model

    torch.set_num_threads(1)
    return init_model(tmp_path_factory.getbasetemp() / "trainer-tiny-model", seed=0)


@lru_cache(maxsize=None)
def sampled(model_folder: str, num_prompts: int, group_size: int = 8, *, seed: int = 1, temperature: float = 1.0,
            max_new_tokens: int = 3) -> tuple:
    """Groups sampled from the tiny model at v0 (cached per process; treat as read-only)."""
    from workers.model import load_model, load_tokenizer

    model, tok = load_model(model_folder), load_tokenizer(model_folder)
    return tuple(sample_groups(model, tok, make_prompts(num_prompts, seed=seed), group_size, seed=seed,
                               temperature=temperature, max_new_tokens=max_new_tokens))


def write_buffer(run: Path, groups, versions: list[int] | None = None) -> Path:
    """The groups appended to <run>/buffer (one shard), with `versions` stamped on them if given."""
    with ShardWriter(run / "buffer", flush_groups=10_000, flush_seconds=None) as w:
        for i, g in enumerate(groups):
            w.append(g if versions is None else dataclasses.replace(g, version=versions[i]))
    return run / "buffer"


def trainer_args(run: Path, model: Path, config: dict, *flags: str) -> list[str]:
    """The trainer CLI's arguments (without the command: see trainer_cmd, and trainer_pause.py)."""
    return ["--run-dir", str(run), "--model-folder", str(model), "--config", json.dumps(config), *flags]


def trainer_cmd(run: Path, model: Path, config: dict, *flags: str) -> list[str]:
    return [sys.executable, "-m", "workers.trainer.main", *trainer_args(run, model, config, *flags)]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def run_trainer_cli(run: Path, model: Path, config: dict, *flags: str, timeout: float = 120):
    return subprocess.run(trainer_cmd(run, model, config, *flags), cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def newest_checkpoint(run: Path) -> dict:
    from workers.trainer.checkpoint import list_checkpoints, load_checkpoint

    return load_checkpoint(list_checkpoints(run / "checkpoints")[-1][1])
