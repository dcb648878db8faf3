"""Supervised warm start: teach the model the answer format before GRPO.

A randomly initialised model never emits a right answer, so every group is
all-wrong and GRPO has nothing to learn from. A short SFT phase on the task's
train prompts gets it to the point where it is sometimes right:

    loss = mean over answer tokens and <eos> of -log p(token | prompt, previous answer tokens)

(prompt tokens carry no loss; prompts are encoded as generation encodes them,
through the chat template when the task asks for it, so the model learns the
chat format), AdamW with a linear learning-rate warm-up then
a constant rate, batches drawn epoch by epoch from a seeded permutation.

When to stop is decided by measurement, not by a step count. Learning 2-digit
addition comes in a sharp jump whose step moves with the seed and with the
machine's floating-point kernels (thread count, CPU features, library
builds), so a fixed step can land before, inside or after it. Instead, a
dev split of `dev_size` prompts disjoint from the train and eval splits is
drawn, greedy accuracy on it is measured every `eval_every` steps, and the
warm start stops at the first step whose dev accuracy reaches
`target_accuracy`:

- when a check reaches the target, the steps since the previous check are
  measured in order (their weights are kept) and the first one at or above
  the target is taken: the jump passes many points between two checks but
  only a few in one step;
- if that step is above `max_accuracy` (one step jumped over the whole band),
  the step before it is kept if its accuracy is at least `min_accuracy`,
  else WarmstartError;
- `steps` reached without the target: kept if the last step is within
  [`min_accuracy`, `max_accuracy`], else WarmstartError.

With `target_accuracy = None` it trains exactly `steps` steps. By default the
warm start trains on the add2 level only (`levels`), which makes the jump come
sooner and less variably than training on the whole mix.

`cached_model` builds the embedded model and warm-starts it once per
(task config, warm-start config); later calls return the cached folder. The
folder's `asyncgrpo.json` records what decided the stop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from workers.chat import ChatFormat, check_chat_template, encode_prompts
from workers.checks import is_int, is_num, require
from workers.evaluate import evaluate
from workers.rewards import Scorer
from workers.tasks import Prompt, Task, TaskConfig, load_task

log = logging.getLogger("asyncgrpo.warmstart")

CACHE_VERSION = 2
"""Bumped when the warm start's code changes what it builds, so old cache entries are not reused."""


class WarmstartError(Exception):
    """The warm start ended outside its accuracy band; the message says where and what to change."""


@dataclass(frozen=True)
class WarmstartConfig:
    """Supervised warm start; validated on construction."""

    steps: int = 1500
    """Most optimizer steps (the cap) when `target_accuracy` is set; exactly this many when it is
    None (then 0 keeps the initial weights)."""
    target_accuracy: float | None = 0.30
    """Stop at the first dev check whose greedy accuracy is at least this: GRPO then starts from a
    model that is sometimes right (a signal) and far from its ceiling (room). None: train `steps`."""
    min_accuracy: float = 0.20
    """Lowest dev accuracy accepted when the cap is reached or the target was overshot."""
    max_accuracy: float = 0.40
    """Highest dev accuracy accepted at the stop."""
    eval_every: int = 20
    """Steps between dev checks; the weights of the steps in between are kept (4 MB each for the
    tiny model) so that the stop can step back to the first one that reached the target."""
    dev_size: int = 1000
    """Prompts in the dev split of the stop rule, disjoint from the train and eval splits: drawn
    afresh for the arithmetic task (in the eval split's level proportions), held out of the train
    split (seeded) for prompt files. Large, so that the stop is not decided by sampling noise."""
    levels: tuple[str, ...] | None = ("add2",)
    """Train only on prompts of these levels; the dev split keeps every level, as the eval split does.
    On the arithmetic task the model learns add2 within the budget, while the harder levels' longer
    answers slow that learning down (they are left to GRPO). None: train on every prompt."""
    eval_max_new_tokens: int = 8
    """Longest greedy completion on the dev split (the run's `run.eval_max_new_tokens`)."""
    batch_size: int = 128
    """Prompts per step."""
    lr: float = 3e-3
    """AdamW learning rate after the warm-up."""
    warmup_steps: int = 100
    """Steps of linear learning-rate warm-up from lr / warmup_steps to lr."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.98
    """AdamW beta2."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    seed: int = 0
    """Seed of the batch order and the dev split (and of the embedded model's initial weights in
    `cached_model`)."""
    num_threads: int | None = None
    """torch CPU threads while training; None leaves torch's setting alone. Not part of the cache key."""
    log_every: int = 50
    """Log a progress line every this many steps. Not part of the cache key."""

    def __post_init__(self):
        require(self, "steps", is_int(self.steps, 0), "an int >= 0")
        require(self, "target_accuracy", self.target_accuracy is None or is_num(self.target_accuracy, 0, 1),
                "a number in [0, 1] or None (train exactly `steps` steps)")
        require(self, "min_accuracy", is_num(self.min_accuracy, 0, 1), "a number in [0, 1]")
        require(self, "max_accuracy", is_num(self.max_accuracy, 0, 1), "a number in [0, 1]")
        if self.target_accuracy is not None:
            require(self, "target_accuracy", self.min_accuracy <= self.target_accuracy <= self.max_accuracy,
                    f"within [min_accuracy, max_accuracy] = [{self.min_accuracy}, {self.max_accuracy}]")
        require(self, "eval_every", is_int(self.eval_every, 1), "an int >= 1")
        require(self, "dev_size", is_int(self.dev_size, 1), "an int >= 1")
        require(self, "levels", self.levels is None or (len(self.levels) > 0 and all(
            isinstance(x, str) for x in self.levels)), "a non-empty list of level names or None (all)")
        require(self, "eval_max_new_tokens", is_int(self.eval_max_new_tokens, 1), "an int >= 1")
        require(self, "batch_size", is_int(self.batch_size, 1), "an int >= 1")
        require(self, "lr", is_num(self.lr, 0, lo_open=True), "a number > 0")
        require(self, "warmup_steps", is_int(self.warmup_steps, 0), "an int >= 0")
        require(self, "beta1", is_num(self.beta1, 0, 1) and self.beta1 < 1, "a number in [0, 1)")
        require(self, "beta2", is_num(self.beta2, 0, 1) and self.beta2 < 1, "a number in [0, 1)")
        require(self, "weight_decay", is_num(self.weight_decay, 0), "a number >= 0")
        require(self, "seed", is_int(self.seed, 0), "an int >= 0")
        require(self, "num_threads", self.num_threads is None or is_int(self.num_threads, 1),
                "an int >= 1 or None (torch's default)")
        require(self, "log_every", is_int(self.log_every, 1), "an int >= 1")


def dev_split(prompts: list[Prompt], size: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, dev): `size` prompts drawn (seeded) out of `prompts` as the dev split, the rest in order."""
    if size >= len(prompts):
        raise WarmstartError(f"WarmstartConfig.dev_size = {size} leaves no train prompts: the task has "
                             f"{len(prompts)}; lower warmstart.dev_size")
    held = set(random.Random(seed).sample(range(len(prompts)), size))
    return ([p for i, p in enumerate(prompts) if i not in held], [prompts[i] for i in sorted(held)])


def sft_tensors(tokenizer, prompts: list[Prompt], chat: ChatFormat | None = None):
    """Right-padded sequences `<bos> prompt answer <eos>` of `prompts` (with `chat`: the prompt's ids
    are those of the chat template, `workers.chat.encode_prompts`).

    Returns (inputs (N, T), targets (N, T), loss_mask (N, T)): targets are the inputs shifted by
    one, and the mask is 1 where the target is an answer token or the final `<eos>`. Right padding
    needs no attention mask: under causal attention no real token sees the padding after it.
    """
    import torch

    seqs, starts = [], []
    for p, prompt_ids in zip(prompts, encode_prompts(tokenizer, [p.text for p in prompts], chat)):
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


def select_levels(prompts: list[Prompt], levels: tuple[str, ...] | None) -> list[Prompt]:
    """The prompts whose level is in `levels` (all of them for None); WarmstartError if none is."""
    if levels is None:
        return list(prompts)
    chosen = [p for p in prompts if p.level in levels]
    if not chosen:
        found = sorted({p.level for p in prompts})
        raise WarmstartError(f"warmstart.levels = {list(levels)} selects none of the {len(prompts)} train prompts "
                             f"(their levels: {found}); set warmstart.levels to some of those, or to none")
    return chosen


def lr_factor(step: int, warmup_steps: int) -> float:
    """Learning-rate multiplier at optimizer step `step` (1-based): step / warmup_steps, then 1."""
    return 1.0 if warmup_steps == 0 else min(1.0, step / warmup_steps)


class _StopRule:
    """The dev-accuracy stop rule of the module docstring.

    Keeps the weights of every step since the last check (`eval_every` copies; 4 MB each for the
    tiny model), so when a check reaches the target the rule can step back to the first step that
    did: the jump can pass many points between two checks, but only a few in one step.
    """

    def __init__(self, cfg: WarmstartConfig, tokenizer, dev: list[Prompt], chat: ChatFormat | None = None):
        self.cfg, self.tokenizer, self.dev, self.scorer, self.chat = cfg, tokenizer, dev, Scorer(), chat
        self.checks: list[tuple[int, float]] = []          # (step, dev accuracy), in the order measured
        self.recent: deque[tuple[int, dict]] = deque(maxlen=cfg.eval_every)  # (step, weights) since last check
        self.below: tuple[int, float, dict] | None = None    # the last measured step below the target
        self.stop: tuple[int, float] | None = None
        self.decided_by: str | None = None

    def _accuracy(self, step: int, model) -> float:
        acc = evaluate(model, self.tokenizer, self.dev, self.scorer,
                       max_new_tokens=self.cfg.eval_max_new_tokens, chat=self.chat).accuracy
        self.checks.append((step, acc))
        return acc

    def after_step(self, step: int, model) -> bool:
        """Called after every optimizer step; True when the warm start should stop (weights set)."""
        self.recent.append((step, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        if step % self.cfg.eval_every != 0:
            return False
        return self._check(step, model)

    def _check(self, step: int, model) -> bool:
        cfg = self.cfg
        current = self.recent[-1][1]
        acc = self._accuracy(step, model)
        if acc < cfg.target_accuracy:
            self.below = (step, acc, current)
            self.recent.clear()
            return False
        # Reached: find the first step since the last check at or above the target.
        first = (step, acc, current)
        for s, state in list(self.recent)[:-1]:
            model.load_state_dict(state)
            a = self._accuracy(s, model)
            if a >= cfg.target_accuracy:
                first = (s, a, state)
                break
            self.below = (s, a, state)
        if first[1] <= cfg.max_accuracy:
            self._stop_at(model, first, "target")
        elif self.below is not None and self.below[1] >= cfg.min_accuracy:
            self._stop_at(model, self.below, "overshoot, step before kept")
        else:
            before = "none" if self.below is None else f"{self.below[1]:.3f} at step {self.below[0]}"
            raise WarmstartError(
                f"warm start overshot its band: dev accuracy {first[1]:.3f} at step {first[0]} is above "
                f"max_accuracy {cfg.max_accuracy}, and the step before ({before}) is below min_accuracy "
                f"{cfg.min_accuracy}; lower warmstart.lr or raise warmstart.max_accuracy")
        return True

    def _stop_at(self, model, point: tuple[int, float, dict], why: str) -> None:
        model.load_state_dict(point[2])
        self.stop, self.decided_by = (point[0], point[1]), why

    def at_cap(self, step: int, model) -> None:
        """The cap is reached without the target: accept the last step if it is within the band."""
        cfg = self.cfg
        measured = self.checks and self.checks[-1][0] == step
        if not measured and self._check(step, model):
            return
        acc = self.checks[-1][1]
        if not cfg.min_accuracy <= acc <= cfg.max_accuracy:
            raise WarmstartError(
                f"warm start reached its cap of {cfg.steps} steps with dev accuracy {acc:.3f}, outside "
                f"[{cfg.min_accuracy}, {cfg.max_accuracy}] (target {cfg.target_accuracy}); raise "
                "warmstart.steps, or set warmstart.target_accuracy = none to train a fixed number of steps")
        self.stop, self.decided_by = (step, acc), "cap"


def train_sft(model, tokenizer, train: list[Prompt], cfg: WarmstartConfig, *, dev: list[Prompt] | None = None,
              progress: bool = False, callback: Callable[[int, object, float], None] | None = None,
              chat: ChatFormat | None = None) -> dict:
    """Warm-start `model` in place on `train`; returns what decided the stop.

    With `cfg.target_accuracy` set, `dev` is required and the stop rule of the module docstring
    applies; otherwise exactly `cfg.steps` steps are taken. Returns {"steps" (used), "decided_by"
    ("target", "overshoot, step before kept", "cap" or "steps"), "dev_accuracy" (None without a
    stop rule), "checks" [(step, dev accuracy), in the order measured], "final_loss", "seconds"}.
    `callback(step, model, loss)` runs after each step (for measurements); `progress` shows a bar.
    `chat`: prompts (trained on and evaluated) go through the tokenizer's chat template.
    """
    import torch
    from tqdm.auto import tqdm

    if cfg.target_accuracy is not None and not dev:
        raise ValueError("train_sft: cfg.target_accuracy is set, so a dev split is needed")
    old_threads = torch.get_num_threads()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed)
        inputs, targets, mask = sft_tensors(tokenizer, train, chat)        # (N, T) each
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                weight_decay=cfg.weight_decay)
        rule = _StopRule(cfg, tokenizer, dev, chat) if cfg.target_accuracy is not None else None
        model.train()
        order, cursor = torch.randperm(len(inputs), generator=gen), 0
        loss_value, step, t0 = float("nan"), 0, time.perf_counter()
        bar = tqdm(total=cfg.steps, desc="warm start", unit="step",
                   disable=True if not progress else None)   # None: no bar unless a terminal (log lines remain)
        while step < cfg.steps:
            step += 1
            if cursor + cfg.batch_size > len(order):  # next epoch; the short remainder is skipped
                order, cursor = torch.randperm(len(inputs), generator=gen), 0
            idx = order[cursor:cursor + cfg.batch_size]                    # (B,)
            cursor += cfg.batch_size
            for group in opt.param_groups:
                group["lr"] = cfg.lr * lr_factor(step, cfg.warmup_steps)
            logits = model(input_ids=inputs[idx]).logits                   # (B, T, V)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets[idx], reduction="none")
            loss = (nll * mask[idx]).sum() / mask[idx].sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_value = loss.item()
            bar.update(1)
            if callback is not None:
                callback(step, model, loss_value)
            stop = rule is not None and rule.after_step(step, model)
            if step % cfg.log_every == 0 or stop or step == cfg.steps:
                dev_acc = f", dev accuracy {rule.checks[-1][1]:.3f}" if rule and rule.checks else ""
                bar.set_postfix_str(f"loss={loss_value:.3f}{dev_acc}")
                log.info("warm start step %d/%d loss %.4f%s (%.1f s)", step, cfg.steps, loss_value, dev_acc,
                         time.perf_counter() - t0)
            if stop:
                break
        bar.close()
        if rule is not None and rule.decided_by is None:
            rule.at_cap(step, model)
        model.eval()
        return {"steps": rule.stop[0] if rule else step, "decided_by": rule.decided_by if rule else "steps",
                "dev_accuracy": rule.stop[1] if rule else None,
                "checks": [] if rule is None else [list(c) for c in rule.checks],
                "final_loss": loss_value, "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        torch.set_num_threads(old_threads)


def warmstart(base_folder: str | os.PathLike, out_folder: str | os.PathLike, task: Task,
              cfg: WarmstartConfig = WarmstartConfig(), *, progress: bool = False) -> Path:
    """Warm-start the model in `base_folder` on `task.train` and save it to `out_folder`.

    The dev split is `task.dev` when the task drew one (arithmetic: `load_task(num_dev=...)`), else
    `cfg.dev_size` prompts held out of `task.train`; the train prompts are filtered to `cfg.levels`.
    Greedy accuracy on `task.eval` at the stop is measured and recorded beside the stop's figures in
    the folder's `asyncgrpo.json`. The base folder (tokenizer files included) is copied to a temp folder, the
    trained weights are saved over it, and the temp folder is renamed to `out_folder`, replacing
    any folder there.
    """
    from workers.model import load_model, load_tokenizer

    base, out = Path(base_folder), Path(out_folder)
    tokenizer = load_tokenizer(base)
    check_chat_template(tokenizer, task.chat, base)
    model = load_model(base)
    if cfg.target_accuracy is None:
        train, dev = task.train, []
    elif task.dev:
        train, dev = task.train, task.dev
    else:
        train, dev = dev_split(task.train, cfg.dev_size, cfg.seed)
    train = select_levels(train, cfg.levels)
    stats = train_sft(model, tokenizer, train, cfg, dev=dev, progress=progress, chat=task.chat)
    stats["eval_accuracy"] = evaluate(model, tokenizer, task.eval, Scorer(),
                                      max_new_tokens=cfg.eval_max_new_tokens, chat=task.chat).accuracy
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    model.save_pretrained(tmp)
    meta_path = tmp / "asyncgrpo.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta["warmstart"] = {"config": dataclasses.asdict(cfg), "task": task.name,
                         "chat": None if task.chat is None else dataclasses.asdict(task.chat), "num_train": len(train),
                         "num_dev": len(dev), "num_eval": len(task.eval), **stats}
    meta_path.write_text(json.dumps(meta, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("warm start: %d steps (%s) in %.1f s, dev accuracy %s, eval accuracy %.3f -> %s", stats["steps"],
             stats["decided_by"], stats["seconds"], stats["dev_accuracy"], stats["eval_accuracy"], out)
    return out


CHAT_KEYS = ("chat_template", "system_prompt")
"""TaskConfig fields that enter the cache key only when chat_template is on: the key of a config
without chat prompts is the hash of the other fields alone, as it was before chat prompts existed,
so models cached then are still found."""


def cache_key(task_cfg: TaskConfig, ws_cfg: WarmstartConfig) -> str:
    """Hash of what the cached model depends on: both configs and the prompt files' bytes."""
    ws = {k: v for k, v in dataclasses.asdict(ws_cfg).items() if k not in ("num_threads", "log_every")}
    task = dataclasses.asdict(task_cfg)
    if not task_cfg.chat_template:
        task = {k: v for k, v in task.items() if k not in CHAT_KEYS}
    files = {}
    for path in (task_cfg.path, task_cfg.eval_path):
        if path is not None and Path(path).is_file():
            files[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    blob = json.dumps({"version": CACHE_VERSION, "task": task, "warmstart": ws,
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
        log.info("building the warm-started model %s (target dev accuracy %s, at most %d steps)", final,
                 ws_cfg.target_accuracy, ws_cfg.steps)
        work = cache_dir / f".build-{key}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        try:
            base = init_model(work / "base", seed=ws_cfg.seed)
            num_dev = ws_cfg.dev_size if ws_cfg.target_accuracy is not None else 0
            warmstart(base, final, load_task(task_cfg, num_dev=num_dev), ws_cfg, progress=progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
