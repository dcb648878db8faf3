"""Opening a trainer session: model, optimizer, and the run directory rolled back to the checkpoint.

Fresh run (no checkpoint): the policy is `model_folder`, step = version = 0,
and v0 is published from it unless it is already there. Resume: the newest
checkpoint's model, optimizer, KL controller and RNG states, and the run's
files rolled back to its step k:

    ledger      Sampler(as_of_step=k) moves records of steps > k to ledger/abandoned/
    weights     versions > k move to weights/abandoned/; LATEST names version k
    metrics     rows of steps > k are deleted
    checkpoints none after k exist (k is the newest)

so the steps after k are taken again, on the groups they would have taken.

Under trainer.strategy = "fsdp" (more than one rank) the policy and the reference
are sharded right after loading (fsdp.py) and the optimizer is built over the
shards. Either checkpoint kind loads under either strategy: a .dcp folder is
resharded by torch.distributed.checkpoint to however many ranks this job has; a
.pt file is loaded before sharding, its AdamW state moved over by parameter name.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workers.proc import arrow_allocator
from workers.remote_weights import work_dir
from workers.stop import StopFlag
from workers.trainer.checkpoint import (RemoteCheckpoints, clean_tmp, list_checkpoints, load_checkpoint,
                                        load_sharded, remove_after, set_rng_state)
from workers.trainer.config import TrainerConfig
from workers.trainer.control import KLController
from workers.trainer.distributed import Dist
from workers.trainer.fsdp import full_state_dict, shard_model
from workers.trainer.metrics import MetricsWriter

log = logging.getLogger("asyncgrpo.trainer")


class TrainerError(Exception):
    """A run directory the trainer cannot work with; the message says what to do."""


@dataclass
class Session:
    """Everything the loop works with."""

    run: Path
    cfg: TrainerConfig
    dist: Dist
    device: torch.device
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    tokenizer: object
    optimizer: torch.optim.Optimizer
    kl: KLController
    step: int
    version: int
    offline: bool
    offline_offset: int
    """Offline, groups come from other policies whose versions mean nothing to this one: the
    sampler is asked as if at version + offset (offset = the newest group version), so no
    group is 'future'; the ledger's trainer_version column carries that shifted number."""
    stop: StopFlag
    pad_id: int
    sampler: object = None              # rank 0 only, from here on
    weights: object = None
    publisher: object = None
    metrics: MetricsWriter | None = None
    last_checkpoint: int = 0
    ckpt_mirror: RemoteCheckpoints | None = None   # rank 0 of a run on an object store

    @property
    def ckpt_dir(self) -> Path:
        """Checkpoints: in the run directory; for a run on an object store, in this machine's work folder."""
        return work_dir(self.run) / "checkpoints"

    @property
    def pull_version(self) -> int:
        return self.version + self.offline_offset


def _device(cfg: TrainerConfig, dist: Dist) -> torch.device:
    if cfg.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TrainerError(f"trainer.device is {cfg.device!r} but torch sees no CUDA device; set it to 'cpu'")
        return torch.device(f"cuda:{dist.local_rank}" if dist.enabled else cfg.device)
    return torch.device("cpu")


def _prepare(model: torch.nn.Module, cfg: TrainerConfig) -> None:
    """Training mode with dropout off (as TRL and verl do for RL), no KV cache, optional checkpointing."""
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def open_session(run: Path, cfg: TrainerConfig, model_folder: Path, resume: bool, offline: bool, dist: Dist,
                 stop: StopFlag) -> Session:
    from transformers.utils import logging as hf_logging

    from workers.model import load_model, load_tokenizer

    hf_logging.disable_progress_bar()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    device = _device(cfg, dist)
    run.mkdir(parents=True, exist_ok=True)
    ckpt_dir = work_dir(run) / "checkpoints"
    mirror = _checkpoints_from_store(run, ckpt_dir, cfg, resume, dist)
    checkpoints = list_checkpoints(ckpt_dir)
    if checkpoints and not resume:
        raise TrainerError(f"run {str(run)!r} has checkpoints (newest: step {checkpoints[-1][0]}); pass "
                           "--resume to continue it, or start a new run directory")
    state = None
    if resume and checkpoints:
        # Rank 0 alone chooses (and sets damaged ones aside), so every rank loads the same checkpoint.
        chosen: str | dict = {}
        if dist.is_main:
            try:
                try:
                    state = _newest_readable_checkpoint(ckpt_dir, checkpoints)
                except TrainerError:
                    if mirror is None or mirror.newest() is None:
                        raise
                    state = None     # none loads here: the store's newest, below
                state = _prefer_the_store(mirror, ckpt_dir, state)
                chosen = str(state["path"])
            except TrainerError as e:
                chosen = {"error": str(e)}
        chosen = dist.broadcast(chosen)
        if isinstance(chosen, dict):
            raise TrainerError(chosen["error"])
        if state is None:
            state = load_checkpoint(chosen)
    if resume and state is None:
        log.info("no checkpoint in %s: starting from %s", ckpt_dir, model_folder)

    model = load_model(model_folder, dtype="float32", device=str(device))
    single_file = state is not None and "sharded" not in state
    if single_file:
        model.load_state_dict(state["model"])
    _prepare(model, cfg)
    ref_model = None
    if cfg.loss.beta > 0:
        ref_model = load_model(model_folder, dtype="float32", device=str(device)).eval()
        ref_model.requires_grad_(False)
    tokenizer = load_tokenizer(model_folder)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimizer = _adamw(model, cfg)
    if single_file:
        optimizer.load_state_dict(state["optimizer"])
    if dist.sharded:
        optimizer = _shard(model, ref_model, optimizer, cfg, dist, device)
    if state is not None and not single_file:
        load_sharded(state["sharded"], model, optimizer, dist)
    kl = KLController.from_config(cfg)
    if state is not None:
        kl.load_state_dict(state["kl"])
        set_rng_state(state["rng"])
    else:
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
    step = int(state["step"]) if state is not None else 0
    version = int(state["version"]) if state is not None else 0
    s = Session(run=run, cfg=cfg, dist=dist, device=device, model=model, ref_model=ref_model, tokenizer=tokenizer,
                optimizer=optimizer, kl=kl, step=step, version=version, offline=offline, offline_offset=0,
                stop=stop, pad_id=pad_id, last_checkpoint=step, ckpt_mirror=mirror)
    # Under FSDP gathering the weights is a collective, so every rank takes part even though
    # rank 0 publishes them only when the resumed version's folder is missing.
    initial = full_state_dict(model) if dist.sharded else None
    if dist.is_main:
        try:
            _open_files(s, model_folder, state, initial)
        except BaseException:
            if s.sampler is not None:
                s.sampler.close()
            raise
    s.offline_offset = dist.broadcast(s.offline_offset)
    dist.barrier()
    return s


def _checkpoints_from_store(run, ckpt_dir: Path, cfg: TrainerConfig, resume: bool,
                            dist: Dist) -> RemoteCheckpoints | None:
    """For a run on an object store: its checkpoints there (rank 0's mirror; None elsewhere). A resume on
    a machine whose work folder lacks the newest of them downloads it first; a fresh start is refused
    when the store has any, as when the work folder has."""
    from buffer.store import RemotePath

    if not isinstance(run, RemotePath):
        return None
    mirror, error = None, None
    if dist.is_main:
        mirror = RemoteCheckpoints(run, keep=cfg.keep_checkpoints)
        try:
            steps = mirror.steps()
            if steps and not resume:
                error = (f"run {str(run)!r} has checkpoints on the store (newest: step {steps[-1][0]}); pass "
                         "--resume to continue it, or start a new run directory")
            elif resume:
                got = mirror.fetch_newer(ckpt_dir)
                if got is not None:
                    log.info("downloaded checkpoint %s from %s", got.name, mirror.where)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error = f"reading the checkpoints in {mirror.where} failed: {e}"
    error = dist.broadcast(error)
    if error is not None:
        raise TrainerError(error)
    return mirror


def _prefer_the_store(mirror: RemoteCheckpoints | None, ckpt_dir: Path, state: dict | None) -> dict:
    """The checkpoint to resume from: `state` (the newest that loads here), or the store's newest complete
    one when that is newer (a damaged local copy was set aside) or nothing here loads, downloaded."""
    have = None if state is None else int(state["step"])
    got = mirror.fetch_newer(ckpt_dir, than=-1 if have is None else have) if mirror is not None else None
    if got is None:
        if state is None:
            raise TrainerError(f"no checkpoint of this run can be read here or in {mirror.where}")
        return state
    log.info("downloaded checkpoint %s from %s (newer than any that loads here)", got.name, mirror.where)
    new = load_checkpoint(got)
    new["path"] = got
    return new


def _adamw(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)


def _shard(model, ref_model, optimizer, cfg: TrainerConfig, dist: Dist, device: torch.device):
    """FSDP2 over the policy (and the frozen reference); returns the optimizer over the sharded parameters.

    A single-file checkpoint's optimizer state (loaded into `optimizer` already) moves to the
    new optimizer by parameter name, so a DDP run can resume under FSDP.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    moments = get_optimizer_state_dict(model, optimizer, options=full) if optimizer.state else None
    shard_model(model, world=dist.world, device=device, dtype=cfg.dtype)
    if ref_model is not None:
        shard_model(ref_model, world=dist.world, device=device, dtype=cfg.dtype)
    sharded = _adamw(model, cfg)
    if moments is not None:
        set_optimizer_state_dict(model, sharded, moments, options=full)
    return sharded


def _newest_readable_checkpoint(ckpt_dir: Path, checkpoints: list[tuple[int, Path]]) -> dict:
    """The newest checkpoint that loads; unreadable newer ones move to checkpoints/damaged/ with a reason.

    Checkpoints are written atomically, so only damage on disk makes one unreadable;
    resuming from the one before it repeats a few steps (the ledger is rolled back to it).
    If none loads, nothing is moved and the error names them all.
    """
    import json

    failures = []
    for step, path in reversed(checkpoints):
        try:
            state = load_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - any unpickling or format error means unusable
            failures.append((path, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]))
            continue
        state["path"] = path
        damaged = ckpt_dir / "damaged"
        for bad, reason in failures:
            damaged.mkdir(exist_ok=True)
            target = damaged / bad.name
            if target.exists():   # set aside before (a folder cannot be replaced): keep both
                target = damaged / f"{bad.name}.{time.time_ns()}"
            os.replace(bad, target)
            (damaged / f"{bad.name}.reason.json").write_text(json.dumps({"file": bad.name, "reason": reason}))
            log.warning("checkpoint %s is unreadable (%s); moved to %s, resuming from step %d",
                        bad.name, reason, damaged, step)
        return state
    raise TrainerError("no checkpoint of this run can be read: " + "; ".join(f"{p} ({r})" for p, r in failures)
                       + ". Restore one from a backup, or start a new run directory")


def _open_files(s: Session, model_folder: Path, state: dict | None, initial: dict | None) -> None:
    """Rank 0: the buffer's sampler, the weights, metrics and checkpoints, rolled back to s.step.

    initial: the model's full state dict under FSDP (gathered by every rank), else None.
    """
    from buffer import BufferDir, Sampler
    from workers.trainer.publisher import Publisher
    from buffer.store import RemotePath
    from workers.remote_weights import MirroredWeightStore, RemoteWeights
    from workers.weights import WeightStore

    buffer_root = s.run / "buffer"
    if s.offline and not BufferDir.is_buffer(buffer_root):
        raise TrainerError(f"offline training needs a buffer, and {str(buffer_root)!r} is none; "
                           "generate into the run first, or copy a buffer there")
    BufferDir(buffer_root, create=True)
    s.sampler = Sampler(buffer_root, as_of_step=s.step, reuse=s.cfg.reuse, order=s.cfg.order, seed=s.cfg.seed)
    if s.offline:
        saved = (state or {}).get("extra", {}).get("offline_offset")
        versions = s.sampler.index.version.view
        s.offline_offset = int(saved) if saved is not None else int(versions.max(initial=0))

    if isinstance(s.run, RemotePath):   # published here, then uploaded for the generators
        s.weights = MirroredWeightStore(work_dir(s.run) / "weights",
                                        RemoteWeights(s.run.store, folder=(s.run / "weights").key),
                                        source=model_folder)
    else:
        s.weights = WeightStore(s.run / "weights", source=model_folder)
    s.weights.clean_tmp()
    undone = s.weights.abandon_after(s.version)
    if undone:
        log.info("moved weights of undone versions %s to %s", undone, s.weights.abandoned)
    s.publisher = Publisher(s.weights, model_folder, s.tokenizer, keep=s.cfg.keep_weights,
                            background=s.cfg.publish_background, gathered=s.dist.sharded)
    if isinstance(s.weights, MirroredWeightStore) and s.weights.restore(s.version):
        log.info("downloaded weights of version %d from %s", s.version, s.weights.remote.store.uri)
    if s.weights.folder(s.version).exists() and not s.weights.is_complete(s.version):
        moved = s.weights.set_aside(s.version, "incomplete: config.json, *.safetensors or weights.json missing")
        log.warning("weights of version %d were incomplete; moved to %s and published again", s.version, moved)
    if not s.weights.folder(s.version).exists():
        s.publisher.publish(initial if initial is not None else s.model.state_dict(), s.version,
                            info={"step": s.step}, wait=True)
    elif s.weights.latest() != s.version:
        s.weights.set_latest(s.version)
    if isinstance(s.weights, MirroredWeightStore):
        s.weights.sync(s.version)    # killed between the local publication and its upload: upload it now

    s.metrics = MetricsWriter(s.run / "metrics", s.cfg.metrics_flush_seconds)
    dropped = s.metrics.truncate_after(s.step)
    if dropped:
        log.info("dropped %d metrics rows of steps after %d", dropped, s.step)
    remove_after(s.ckpt_dir, s.step)
    clean_tmp(s.ckpt_dir)
    if s.ckpt_mirror is not None:
        s.ckpt_mirror.remove_after(s.step)
    log.info("trainer at step %d, version %d (%s, %s); buffer %s; Arrow allocator %s", s.step, s.version,
             "resumed" if state is not None else "fresh", "offline" if s.offline else "online", buffer_root,
             arrow_allocator())
