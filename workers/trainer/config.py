"""The trainer's settings: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from buffer.groups import STD_MODES, StdMode
from workers.checks import is_int, is_num, require
from workers.grpo.options import PolicyLossConfig

Dtype = Literal["float32", "bfloat16"]
LrSchedule = Literal["constant", "cosine", "linear"]
KLControl = Literal["fixed", "adaptive"]
Order = Literal["oldest", "newest", "uniform"]
Strategy = Literal["ddp", "fsdp"]
STRATEGIES = ("ddp", "fsdp")


def _default_loss() -> PolicyLossConfig:
    # Decoupled: under asynchrony the data lags the policy by up to max_staleness versions;
    # AReaL's decoupled objective clips only the step's own change and corrects the lag with a
    # truncated importance weight, where plain PPO (bypass) collapses at staleness 4. With
    # num_iterations = 1 it costs no extra forward pass (see step.py).
    return PolicyLossConfig(objective="decoupled")


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer pulls groups, takes GRPO steps and publishes weights."""

    loss: PolicyLossConfig = field(default_factory=_default_loss)
    """The GRPO objective (clip, importance weights, KL term, aggregation); see workers.grpo.loss."""
    groups_per_step: int = 32
    """Groups (prompts, each with its G completions) per trainer step; 32 x G=8 = 256 sequences."""
    micro_batch_size: int = 64
    """Sequences per forward/backward pass; gradients accumulate over the whole step batch, so this
    bounds memory (logits are micro_batch x tokens x vocabulary) without changing the result."""
    num_iterations: int = 1
    """Optimizer updates per step batch (PPO epochs). The version still moves by one per step."""
    max_staleness: int | None = 2
    """Most versions a group may lag the trainer (AReaL's eta); staler groups expire unused.
    Generators are held back by the admission rule so little expires. None: no limit."""
    reuse: int = 1
    """Times a group may be trained on (passes over the buffer); > 1 mainly for offline training."""
    order: Order = "oldest"
    """Which eligible groups a step takes first: "oldest" (used before they expire), "newest", "uniform"."""
    advantage_std: StdMode = "sample"
    """Advantage scale per group: "sample" std, "population" std, or "none" (Dr. GRPO: r - mean)."""
    advantage_eps: float = 1e-6
    """Added to the group's reward std before dividing, >= 0."""
    lr: float = 1e-4
    """Peak AdamW learning rate, > 0. Measured on the default run (greedy accuracy on 200 held-out
    prompts, 300 steps): 1e-4 rose 27.5% -> 61.5% steadily, 3e-4 peaked at 46% and fell back to 24%."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, >= 0."""
    adam_eps: float = 1e-8
    """AdamW epsilon, > 0."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (> 0); None: no clipping (the norm is still logged)."""
    lr_schedule: LrSchedule = "constant"
    """After warm-up: "constant", or "cosine" / "linear" decay to min_lr_ratio * lr at decay_steps."""
    warmup_steps: int = 0
    """Steps of linear warm-up from lr / (warmup_steps + 1) to lr, >= 0."""
    decay_steps: int | None = None
    """Step at which a decaying schedule reaches its floor; None: max_steps (then required)."""
    min_lr_ratio: float = 0.0
    """Floor of a decaying schedule as a fraction of lr, in [0, 1]."""
    kl_control: KLControl = "fixed"
    """"fixed": beta = loss.beta throughout; "adaptive": PPO's controller moves beta toward kl_target."""
    kl_target: float | None = None
    """Target of the adaptive controller for kl/ref (the mean per-token KL to the reference), > 0."""
    kl_horizon: int = 10000
    """Adaptive controller horizon in sequences (Ziegler et al.): beta *= 1 + clip(kl/target - 1,
    -0.2, 0.2) * B / horizon after each step of B sequences."""
    max_steps: int | None = None
    """Stop after this many steps (counting from the run's start, so a resume continues to it);
    None: until stopped (offline: until no eligible group remains)."""
    publish_every: int = 1
    """Publish weights every this many steps (and at the end); generators pick them up."""
    publish_background: bool = True
    """Write published versions from a background thread (the next step starts at once; the folder
    appears about a publication's time later). Off: the step waits for its publication."""
    keep_weights: int = 3
    """Published weight versions kept on disk (older ones are pruned), >= 1."""
    checkpoint_every: int = 50
    """Write a checkpoint every this many steps (and on a clean exit)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk, >= 1."""
    metrics_flush_seconds: float = 5.0
    """Write pending metrics rows as a Parquet shard at least this often (and at every checkpoint)."""
    seed: int = 0
    """Seed of the trainer's random numbers (micro-batch order across inner epochs)."""
    dtype: Dtype = "float32"
    """"bfloat16": forward and backward under autocast; weights and optimizer state stay float32."""
    device: str = "cpu"
    """Torch device: "cpu" or "cuda" (under torchrun each rank takes cuda:LOCAL_RANK)."""
    strategy: Strategy = "ddp"
    """How ranks under torchrun share the model. "ddp": every rank holds all of it (parameters,
    gradients, AdamW state); gradients summed by one all-reduce. "fsdp": torch's FSDP2 (fully_shard
    per decoder layer plus the root) shards all three over the ranks, for models one device cannot
    train; with dtype "bfloat16" parameters are gathered in bfloat16 and gradients reduced in float32.
    Checkpoints are then torch.distributed.checkpoint folders (step-N.dcp/), which resume on any
    number of ranks. One process: both train the same way."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    num_threads: int | None = None
    """torch.set_num_threads for this process; None leaves torch's default."""
    poll_seconds: float = 0.25
    """Longest pause between looks for enough eligible groups while waiting, > 0 (the first
    looks of a wait come sooner: 10 ms, doubling up to this)."""
    log_wait_seconds: float = 5.0
    """Log a line this often while waiting for groups, > 0."""
    max_wait_seconds: float | None = None
    """Give up (checkpoint and exit cleanly) after waiting this long for one step's groups; None: wait."""

    def __post_init__(self) -> None:
        require(self, "loss", isinstance(self.loss, PolicyLossConfig), "a PolicyLossConfig")
        for name in ("groups_per_step", "micro_batch_size", "num_iterations", "reuse", "publish_every",
                     "keep_weights", "checkpoint_every", "keep_checkpoints", "kl_horizon"):
            require(self, name, is_int(getattr(self, name), 1), "an integer >= 1")
        require(self, "max_staleness", self.max_staleness is None or is_int(self.max_staleness, 0),
                "an integer >= 0 or None (no limit)")
        require(self, "order", self.order in ("oldest", "newest", "uniform"), "'oldest', 'newest' or 'uniform'")
        require(self, "advantage_std", self.advantage_std in STD_MODES, f"one of {STD_MODES}")
        require(self, "advantage_eps", is_num(self.advantage_eps, 0), "a number >= 0")
        require(self, "lr", is_num(self.lr, 0, lo_open=True), "a number > 0")
        require(self, "betas", isinstance(self.betas, tuple) and len(self.betas) == 2
                and all(is_num(b, 0) and b < 1 for b in self.betas), "two numbers in [0, 1)")
        require(self, "weight_decay", is_num(self.weight_decay, 0), "a number >= 0")
        require(self, "adam_eps", is_num(self.adam_eps, 0, lo_open=True), "a number > 0")
        require(self, "max_grad_norm", self.max_grad_norm is None or is_num(self.max_grad_norm, 0, lo_open=True),
                "a number > 0 or None (no clipping)")
        require(self, "lr_schedule", self.lr_schedule in ("constant", "cosine", "linear"),
                "'constant', 'cosine' or 'linear'")
        require(self, "warmup_steps", is_int(self.warmup_steps, 0), "an integer >= 0")
        require(self, "decay_steps", self.decay_steps is None or is_int(self.decay_steps, 1),
                "an integer >= 1 or None (max_steps)")
        require(self, "decay_steps", self.lr_schedule == "constant" or self.decay_steps is not None
                or self.max_steps is not None,
                f"set (or max_steps set) when lr_schedule={self.lr_schedule!r}, so the decay has an end")
        require(self, "min_lr_ratio", is_num(self.min_lr_ratio, 0, 1), "a number in [0, 1]")
        require(self, "kl_control", self.kl_control in ("fixed", "adaptive"), "'fixed' or 'adaptive'")
        require(self, "kl_target", self.kl_target is None or is_num(self.kl_target, 0, lo_open=True),
                "a number > 0 or None")
        if self.kl_control == "adaptive":
            require(self, "kl_target", self.kl_target is not None,
                    "set (a number > 0) when kl_control='adaptive'")
            require(self, "kl_control", self.loss.beta > 0,
                    "'fixed' when loss.beta is 0 (an adaptive controller multiplies beta, so it needs "
                    "loss.beta > 0 as its start)")
        require(self, "max_steps", self.max_steps is None or is_int(self.max_steps, 1),
                "an integer >= 1 or None (until stopped)")
        require(self, "metrics_flush_seconds", is_num(self.metrics_flush_seconds, 0), "a number >= 0")
        require(self, "seed", is_int(self.seed, 0), "an integer >= 0")
        require(self, "dtype", self.dtype in ("float32", "bfloat16"), "'float32' or 'bfloat16'")
        require(self, "strategy", self.strategy in STRATEGIES, "'ddp' or 'fsdp'")
        require(self, "device", isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda"),
                "'cpu' or 'cuda' (optionally 'cuda:N')")
        for name in ("gradient_checkpointing", "publish_background"):
            require(self, name, isinstance(getattr(self, name), bool), "true or false")
        require(self, "num_threads", self.num_threads is None or is_int(self.num_threads, 1),
                "an integer >= 1 or None (torch's default)")
        require(self, "poll_seconds", is_num(self.poll_seconds, 0, lo_open=True), "a number > 0")
        require(self, "log_wait_seconds", is_num(self.log_wait_seconds, 0, lo_open=True), "a number > 0")
        require(self, "max_wait_seconds", self.max_wait_seconds is None
                or is_num(self.max_wait_seconds, 0, lo_open=True), "a number > 0 or None (wait for ever)")

    @property
    def decay_end(self) -> int | None:
        """Step at which a decaying schedule reaches its floor."""
        return self.decay_steps if self.decay_steps is not None else self.max_steps


def config_from_dict(data: dict) -> TrainerConfig:
    """A TrainerConfig from nested plain values (JSON/TOML): {"lr": 1e-4, "loss": {"beta": 0.1}}.

    Minimal (the pipeline's reader does types and key paths); lists become tuples and
    "none" becomes None; "loss" is laid over the default loss (objective "decoupled").
    Unknown keys raise a ConfigError naming them.
    """
    from dataclasses import fields, replace

    from workers.checks import ConfigError

    def plain(v):
        if v == "none":
            return None
        return tuple(v) if isinstance(v, list) else v

    names = {f.name for f in fields(TrainerConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown TrainerConfig keys {unknown}; known: {sorted(names)}")
    kwargs = {k: plain(v) for k, v in data.items() if k != "loss"}
    if "loss" in data:
        loss_names = {f.name for f in fields(PolicyLossConfig)}
        bad = sorted(set(data["loss"]) - loss_names)
        if bad:
            raise ConfigError(f"unknown PolicyLossConfig keys {bad}; known: {sorted(loss_names)}")
        kwargs["loss"] = replace(_default_loss(), **{k: plain(v) for k, v in data["loss"].items()})
    return TrainerConfig(**kwargs)
