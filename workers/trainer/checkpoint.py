"""Trainer checkpoints: everything needed to continue exactly, in one file per step.

`<run>/checkpoints/step-000000012.pt` holds the model and optimizer state, the
step and version, the KL controller, the RNG states and a copy of the config.
The learning-rate schedule is a pure function of the step (`control.lr_factor`),
so the step is its whole state. Written to checkpoints/tmp/ and renamed, so a
kill -9 leaves either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from buffer.layout import atomic_file

FORMAT = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_path(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}.pt"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return sorted(out)


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | os.PathLike, *, step: int, version: int, model, optimizer, kl_state: dict,
                    config, extra: dict | None = None, keep: int = 2) -> Path:
    """Write the checkpoint of `step` (temp + rename), then delete all but the `keep` newest."""
    root = Path(root)
    tmp_dir = root / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT, "step": step, "version": version,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(), "kl": kl_state, "rng": rng_state(),
        "config": _plain(asdict(config)), "extra": extra or {},
    }
    final = checkpoint_path(root, step)
    with atomic_file(tmp_dir, final) as f:
        torch.save(state, f)
    for _, p in list_checkpoints(root)[:-keep]:
        p.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state saved by `save_checkpoint` (tensors on the CPU)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} has format {state.get('format')!r}, expected {FORMAT}")
    return state


def remove_after(root: str | os.PathLike, step: int) -> list[Path]:
    """Delete checkpoints of steps after `step` (none exist unless a resume chose an older one)."""
    gone = [p for s, p in list_checkpoints(root) if s > step]
    for p in gone:
        p.unlink()
    return gone


def clean_tmp(root: str | os.PathLike) -> None:
    tmp = Path(root) / "tmp"
    if tmp.is_dir():
        for p in tmp.iterdir():
            p.unlink(missing_ok=True)


def _plain(obj):
    """Config as JSON-like values (tuples as lists), loadable with weights_only=True."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
