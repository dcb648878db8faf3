"""Trainer checkpoints: everything needed to continue exactly, one file (or folder) per step.

`<run>/checkpoints/step-000000012.pt` holds the model and optimizer state, the
step and version, the KL controller, the RNG states and a copy of the config.
The learning-rate schedule is a pure function of the step (`control.lr_factor`),
so the step is its whole state. Written to checkpoints/tmp/ and renamed, so a
kill -9 leaves either the previous checkpoint or the new one, never half of one.

Under trainer.strategy = "fsdp" a checkpoint is a folder, `step-000000012.dcp/`:
the model and optimizer written by torch.distributed.checkpoint (each rank its
shards, rank 0 the `.metadata`), and `state.pt` (the rest, as above) by rank 0.
It is written in checkpoints/tmp/ and renamed whole. It loads on any number of
ranks and with either strategy (DCP reshards), including one process.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from buffer.atomic import fsync_dir
from buffer.layout import atomic_file
from workers.trainer.background import Background

log = logging.getLogger("asyncgrpo.trainer")

FORMAT = 1
_NAME = re.compile(r"^step-(\d+)\.(pt|dcp)$")
STATE_FILE = "state.pt"   # in a .dcp folder: everything but the model and optimizer


def checkpoint_path(root: Path, step: int, sharded: bool = False) -> Path:
    return root / f"step-{step:09d}.{'dcp' if sharded else 'pt'}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint (a step-N.pt file or a step-N.dcp folder), ascending."""
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
        "format": FORMAT, "step": step,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(), **_small_state(version, kl_state, config, extra),
    }
    final = checkpoint_path(root, step)
    with atomic_file(tmp_dir, final) as f:
        torch.save(state, f)
    prune(root, keep)
    return final


def save_sharded_checkpoint(root: str | os.PathLike, *, step: int, version: int, model, optimizer, kl_state: dict,
                            config, dist, extra: dict | None = None, keep: int = 2) -> Path:
    """Every rank: write the step-N.dcp folder of `step` (DCP shards + rank 0's state.pt), then prune.

    Rank 0 names the temp folder; after every rank's shards are written (dcp.save ends with
    a collective), rank 0 adds state.pt, fsyncs and renames the folder into place.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(root)
    final = checkpoint_path(root, step, sharded=True)
    tmp = None
    if dist.is_main:
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        tmp = root / "tmp" / f"{os.getpid()}%{uuid.uuid4().hex[:8]}%{final.name}"
    tmp = Path(dist.broadcast(str(tmp) if tmp is not None else None))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp, no_dist=not dist.enabled)
    if dist.is_main:
        state = {"format": FORMAT, "step": step, **_small_state(version, kl_state, config, extra)}
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        os.replace(tmp, final)
        fsync_dir(root)
        prune(root, keep)
    dist.barrier()
    return final


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state saved by `save_checkpoint` (tensors on the CPU).

    A .dcp folder gives its state.pt, with "sharded": the folder, and no "model" or
    "optimizer": `load_sharded` puts those into a model and optimizer built for them.
    """
    path = Path(path)
    if path.is_dir():
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        _check_shards(path)
        state["sharded"] = path
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} has format {state.get('format')!r}, expected {FORMAT}")
    return state


def load_sharded(path: str | os.PathLike, model, optimizer, dist) -> None:
    """Every rank: the model and optimizer state of a .dcp folder, resharded to this job's ranks.

    Works for an FSDP model and for a plain one (each rank then reads the full tensors).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=Path(path), no_dist=not dist.enabled)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def prune(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the `keep` newest checkpoints."""
    for _, p in list_checkpoints(root)[:-keep]:
        _remove(p)


def remove_after(root: str | os.PathLike, step: int) -> list[Path]:
    """Delete checkpoints of steps after `step` (none exist unless a resume chose an older one)."""
    gone = [p for s, p in list_checkpoints(root) if s > step]
    for p in gone:
        _remove(p)
    return gone


def clean_tmp(root: str | os.PathLike) -> None:
    tmp = Path(root) / "tmp"
    if tmp.is_dir():
        for p in tmp.iterdir():
            _remove(p)


def _check_shards(path: Path) -> None:
    """A .dcp folder's metadata reads and every byte range it names is on disk (else ValueError), so a
    damaged folder is set aside at resume like a damaged file, not found half-way through loading it."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - missing or unreadable .metadata
        raise ValueError(f"checkpoint {path}: unreadable .metadata (torch.distributed.checkpoint): {e}") from e
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in need.items():
        try:
            have = (path / name).stat().st_size
        except FileNotFoundError:
            raise ValueError(f"checkpoint {path}: shard file {name} is missing") from None
        if have < size:
            raise ValueError(f"checkpoint {path}: shard file {name} has {have} bytes, needs {size}")


def _remove(p: Path) -> None:
    """Delete a checkpoint file or folder; a folder is first renamed into tmp/ (one step), so a kill -9
    while deleting never leaves a half-deleted checkpoint under its name (clean_tmp removes the rest)."""
    if p.is_dir():
        if p.parent.name != "tmp":
            gone = p.parent / "tmp" / f"deleting-{uuid.uuid4().hex[:8]}-{p.name}"
            gone.parent.mkdir(exist_ok=True)
            try:
                os.replace(p, gone)
            except FileNotFoundError:
                return
            p = gone
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _small_state(version: int, kl_state: dict, config, extra: dict | None) -> dict:
    return {"version": version, "kl": kl_state, "rng": rng_state(), "config": _plain(asdict(config)),
            "extra": extra or {}}


def _plain(obj):
    """Config as JSON-like values (tuples as lists), loadable with weights_only=True."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


class RemoteCheckpoints:
    """The checkpoints of a run on an object store, mirrored to `<run>/checkpoints/` there, so a trainer
    can resume on another machine (its own checkpoints are written locally first, in its work folder).

    Each checkpoint is a folder on the store, `step-000000012.pt/` or `step-000000012.dcp/`, holding the
    checkpoint's file (or the .dcp folder's files) and, written last, COMPLETE.json with every file's
    size and SHA-256: a checkpoint whose upload was killed is never downloaded. Uploads run in a
    background thread, one at a time: the trainer waits for the last before writing the next checkpoint
    (whose local prune may delete the one being uploaded). A failed upload is logged and training goes
    on: the local checkpoint is whole, and the next one is uploaded as usual. The store keeps the `keep`
    newest complete checkpoints; folders an upload left without COMPLETE.json are withdrawn once a newer
    checkpoint is complete."""

    def __init__(self, run, *, keep: int = 2):
        from workers.remote_weights import CompleteFolders

        self.folders = CompleteFolders(run.store, (run / "checkpoints").key)
        self.where = f"{run}/checkpoints"
        self.keep = keep
        self._job = Background()

    def steps(self) -> list[tuple[int, str]]:
        """(step, folder name) of every complete checkpoint on the store, ascending."""
        out = [(int(m.group(1)), sub) for sub in self.folders.subfolders() if (m := _NAME.match(sub))]
        return sorted(s for s in out if self.folders.is_complete(s[1]))

    def upload(self, path: Path) -> None:
        """Start uploading the local checkpoint `path` (file or .dcp folder), then prune the store."""
        self.wait()
        self._job.start(lambda: self._run(Path(path)), f"upload-{Path(path).name}")

    def _run(self, path: Path) -> None:
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        self.folders.put(path.name, files)
        complete = self.steps()
        for _, sub in complete[:-self.keep]:
            self.folders.withdraw(sub)
        done = {sub for _, sub in complete}
        for sub in self.folders.subfolders():   # a killed or failed upload's files: never complete now
            m = _NAME.match(sub)
            if m and sub not in done and int(m.group(1)) < complete[-1][0]:
                self.folders.withdraw(sub)

    def wait(self) -> bool:
        """Until the upload in flight is done; whether it succeeded (a failure is logged: the local
        checkpoint is whole, and the next checkpoint's upload is tried as usual)."""
        error = self._job.join()
        if error is not None:
            log.warning("uploading a checkpoint to %s failed (%s: %s); training goes on, the next checkpoint "
                        "is uploaded as usual", self.where, type(error).__name__, error)
        return error is None

    def newest(self) -> int | None:
        """The step of the store's newest complete checkpoint, None without one."""
        steps = self.steps()
        return steps[-1][0] if steps else None

    def fetch_newer(self, root: Path, than: int | None = None) -> Path | None:
        """Download the store's newest checkpoint into the local folder `root` if it is newer than every
        checkpoint there (a trainer resuming on another machine), or than step `than` (the newest that
        loads here); the path, or None if nothing was needed."""
        import json

        remote = self.steps()
        local = list_checkpoints(root)
        have = than if than is not None else local[-1][0] if local else None
        if not remote or (have is not None and have >= remote[-1][0]):
            return None
        step, sub = remote[-1]
        listing = json.loads(self.folders.complete(sub) or b"{}")
        tmp = root / "tmp" / f"{os.getpid()}%{uuid.uuid4().hex[:8]}%download"
        tmp.mkdir(parents=True)
        try:
            self.folders.download(sub, listing, tmp)
            final = root / sub
            if final.exists():      # a damaged local copy of the same step, left by the resume's choice
                _remove(final)
            if sub.endswith(".dcp"):
                os.replace(tmp, final)
            else:
                os.replace(tmp / sub, final)
            fsync_dir(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def remove_after(self, step: int) -> list[str]:
        """Withdraw the store's checkpoints of steps after `step` (a resume chose an older one)."""
        gone = [sub for sub in self.folders.subfolders() if (m := _NAME.match(sub)) and int(m.group(1)) > step]
        for sub in gone:
            self.folders.withdraw(sub)
        return gone
