"""Supervised warm start: teach the model the answer format before GRPO.

A randomly initialised model never emits a right answer, so every group is
all-wrong and GRPO has nothing to learn from. A short SFT phase on the task's
train prompts gets it to the point where sampling sometimes succeeds:

    loss = mean over answer tokens and <eos> of -log p(token | prompt, previous answer tokens)

(prompt tokens carry no loss), AdamW, constant learning rate, batches drawn
epoch by epoch from a seeded permutation of the train prompts, stopped after
`steps` steps. The default step count stops it part-way through learning
2-digit addition, leaving GRPO clear room to improve (see `DEFAULT_STEPS`).

`cached_model` builds the embedded model and warm-starts it once per
(task config, warm-start config); later calls return the cached folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from workers.checks import is_int, is_num, require
from workers.tasks import Task, TaskConfig, load_task

log = logging.getLogger("asyncgrpo.warmstart")

CACHE_VERSION = 1
"""Bumped when the warm start's code changes what it builds, so old cache entries are not reused."""

DEFAULT_STEPS = 510
"""Measured on the default task (seed 0; the same on 1 and 2 threads), eval split, greedy / T=1:
step 480: 16.5% / 8%; 500: 22.5% / 10.5%; 510: 27.5% / 19%; 520: 37% / 20%; 540: 44.5% / 20.5%;
600: 62% / 46% (the hard levels stay near 0). 2-digit addition is learned in a sharp jump around
here; stopping inside it leaves GRPO a model that is sometimes right when sampling (a signal)
and far from its ceiling (room). About 60 s on 2 threads at ~120 ms a step."""


@dataclass(frozen=True)
class WarmstartConfig:
    """Supervised warm start; validated on construction."""

    steps: int = DEFAULT_STEPS
    """Optimizer steps. Stops part-way through learning the task on purpose, so GRPO has room to
    improve accuracy; 0 keeps the initial weights."""
    batch_size: int = 128
    """Prompts per step."""
    lr: float = 2e-3
    """AdamW learning rate (constant)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.98
    """AdamW beta2."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    seed: int = 0
    """Seed of the batch order (and of the embedded model's initial weights in `cached_model`)."""
    num_threads: int | None = None
    """torch CPU threads while training; None leaves torch's setting alone. Not part of the cache key."""
    log_every: int = 50
    """Log a progress line every this many steps. Not part of the cache key."""

    def __post_init__(self):
        require(self, "steps", is_int(self.steps, 0), "an int >= 0")
        require(self, "batch_size", is_int(self.batch_size, 1), "an int >= 1")
        require(self, "lr", is_num(self.lr, 0, lo_open=True), "a number > 0")
        require(self, "beta1", is_num(self.beta1, 0, 1) and self.beta1 < 1, "a number in [0, 1)")
        require(self, "beta2", is_num(self.beta2, 0, 1) and self.beta2 < 1, "a number in [0, 1)")
        require(self, "weight_decay", is_num(self.weight_decay, 0), "a number >= 0")
        require(self, "seed", is_int(self.seed, 0), "an int >= 0")
        require(self, "num_threads", self.num_threads is None or is_int(self.num_threads, 1),
                "an int >= 1 or None (torch's default)")
        require(self, "log_every", is_int(self.log_every, 1), "an int >= 1")


def sft_tensors(tokenizer, task: Task):
    """Right-padded sequences `<bos> prompt answer <eos>` of the train prompts.

    Returns (inputs (N, T), targets (N, T), loss_mask (N, T)): targets are the inputs shifted by
    one, and the mask is 1 where the target is an answer token or the final `<eos>`. Right padding
    needs no attention mask: under causal attention no real token sees the padding after it.
    """
    import torch

    seqs, starts = [], []
    for p in task.train:
        prompt_ids = tokenizer(p.text)["input_ids"]
        answer_ids = tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt_ids + answer_ids)
        starts.append(len(prompt_ids))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, start - 1:len(seq) - 1] = 1.0  # position t predicts token t + 1
    return ids[:, :-1], ids[:, 1:], mask


def train_sft(model, tokenizer, task: Task, cfg: WarmstartConfig, *, progress: bool = False,
              callback: Callable[[int, object, float], None] | None = None) -> dict:
    """Warm-start `model` in place; returns {"steps", "final_loss", "seconds"}.

    `callback(step, model, loss)` runs after each step (for measurements); `progress` shows a bar.
    """
    import torch
    from tqdm.auto import tqdm

    old_threads = torch.get_num_threads()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed)
        inputs, targets, mask = sft_tensors(tokenizer, task)          # (N, T) each
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                weight_decay=cfg.weight_decay)
        model.train()
        order, cursor = torch.randperm(len(inputs), generator=gen), 0
        loss_value, t0 = float("nan"), time.perf_counter()
        bar = tqdm(range(1, cfg.steps + 1), desc="warm start", unit="step",
                   disable=True if not progress else None)   # None: no bar unless a terminal (log lines remain)
        for step in bar:
            if cursor + cfg.batch_size > len(order):  # next epoch; the short remainder is skipped
                order, cursor = torch.randperm(len(inputs), generator=gen), 0
            idx = order[cursor:cursor + cfg.batch_size]                  # (B,)
            cursor += cfg.batch_size
            logits = model(input_ids=inputs[idx]).logits                 # (B, T, V)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets[idx], reduction="none")
            loss = (nll * mask[idx]).sum() / mask[idx].sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_value = loss.item()
            if step % cfg.log_every == 0 or step == cfg.steps:
                bar.set_postfix(loss=f"{loss_value:.3f}")
                log.info("warm start step %d/%d loss %.4f (%.1f s)", step, cfg.steps, loss_value,
                         time.perf_counter() - t0)
            if callback is not None:
                callback(step, model, loss_value)
        model.eval()
        return {"steps": cfg.steps, "final_loss": loss_value, "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        torch.set_num_threads(old_threads)


def warmstart(base_folder: str | os.PathLike, out_folder: str | os.PathLike, task: Task,
              cfg: WarmstartConfig = WarmstartConfig(), *, progress: bool = False) -> Path:
    """Warm-start the model in `base_folder` on `task.train` and save it to `out_folder`.

    The base folder (tokenizer files included) is copied to a temp folder, the trained weights are
    saved over it, and the temp folder is renamed to `out_folder`, replacing any folder there.
    """
    from workers.model import load_model, load_tokenizer

    base, out = Path(base_folder), Path(out_folder)
    model, tokenizer = load_model(base), load_tokenizer(base)
    stats = train_sft(model, tokenizer, task, cfg, progress=progress)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    model.save_pretrained(tmp)
    meta_path = tmp / "asyncgrpo.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta["warmstart"] = {"config": dataclasses.asdict(cfg), "task": task.name,
                         "num_train": len(task.train), **stats}
    meta_path.write_text(json.dumps(meta, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("warm start: %d steps in %.1f s, final loss %.4f -> %s", stats["steps"], stats["seconds"],
             stats["final_loss"], out)
    return out


def cache_key(task_cfg: TaskConfig, ws_cfg: WarmstartConfig) -> str:
    """Hash of what the cached model depends on: both configs and the prompt files' bytes."""
    ws = {k: v for k, v in dataclasses.asdict(ws_cfg).items() if k not in ("num_threads", "log_every")}
    files = {}
    for path in (task_cfg.path, task_cfg.eval_path):
        if path is not None and Path(path).is_file():
            files[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    blob = json.dumps({"version": CACHE_VERSION, "task": dataclasses.asdict(task_cfg), "warmstart": ws,
                       "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_model(cache_dir: str | os.PathLike, task_cfg: TaskConfig, ws_cfg: WarmstartConfig = WarmstartConfig(),
                 *, progress: bool = False) -> Path:
    """The embedded tiny model, warm-started on the task: `cache_dir/<hash>/`, built on first use.

    Builds under a lock in a temp folder and renames it into place, so concurrent callers and
    crashes never see a half-written model; later calls return the folder at once.
    """
    from filelock import FileLock

    from workers.model import check_model_folder, init_model

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(task_cfg, ws_cfg)
    final = cache_dir / key
    if final.is_dir():
        return check_model_folder(final)
    with FileLock(str(cache_dir / f".{key}.lock")):
        if final.is_dir():
            return check_model_folder(final)
        log.info("building the warm-started model %s (%d steps)", final, ws_cfg.steps)
        work = cache_dir / f".build-{key}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        try:
            base = init_model(work / "base", seed=ws_cfg.seed)
            warmstart(base, final, load_task(task_cfg), ws_cfg, progress=progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
