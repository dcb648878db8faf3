"""The run configuration: the components' own dataclasses composed into one, read from TOML.

A config file holds only overrides of the typed defaults (`configs/default.toml`
is nearly empty on purpose); `--set section.key=value` lays more on top (a
list such as `reward.functions` is one value, replaced whole); the fully
resolved config is saved as `<run>/config.toml`, so a run can always be
reproduced and resumed. Every field is documented once, under its field, in
its component's dataclass; `asyncgrpo config --explain` prints them all.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tomli_w

from buffer.layout import atomic_write_bytes
from buffer.store import as_path
from pipeline.schema import NONE, build, merge, set_path, to_dict, toml_value
from pipeline.trackers import TRACKER_NAMES
from workers.checks import ConfigError, is_int, is_num, require
from workers.compactor import CompactorConfig
from workers.generator import GeneratorConfig
from workers.model import CHARACTERS
from workers.rewards import RewardConfig
from workers.tasks import TaskConfig
from workers.trainer import TrainerConfig
from workers.warmstart import WarmstartConfig

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


@dataclass(frozen=True)
class ModelConfig:
    """Which policy to start from."""

    path: str | None = None
    """A local HF model folder (config.json, *.safetensors, tokenizer). Omitted: the embedded
    tiny Qwen2 model, built and warm-started on the task locally and cached (no downloads)."""
    cache_dir: str = "runs/.cache"
    """Where the embedded model is built and warm-started once, keyed by its settings."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights' dtype for generation (the trainer has its own `trainer.dtype`)."""
    device: str = "cpu"
    """Torch device of the generators ("cpu", "cuda", "cuda:1")."""

    def __post_init__(self) -> None:
        require(self, "path", self.path is None or bool(self.path.strip()), "a folder path or omitted")


@dataclass(frozen=True)
class RunConfig:
    """The whole run: how many generators, how long, and supervision."""

    seed: int = 0
    """Seed of the run: generators use seed + their index, the trainer the seed itself."""
    num_generators: int = 1
    """Generator processes started beside the one trainer (one per 2-core machine share)."""
    time_limit_s: float | None = 330.0
    """Stop the run this many seconds after its daemons start (their start-up, about 10 s, included;
    the evaluations before and after are not); None: only trainer.max_steps stops it."""
    eval_size: int | None = 200
    """Held-out prompts for the greedy accuracy before and after (None: the whole eval split)."""
    eval_max_new_tokens: int = 8
    """Completion budget of the greedy evaluation."""
    restart_backoff_s: float = 1.0
    """First wait before restarting a crashed generator; doubles on each crash, up to 30 s."""
    max_generator_restarts: int | None = 10
    """Give up (stop the run) after this many crashes of one generator, or of the compactor (None: never)."""
    pin_cores: bool = False
    """Pin the trainer to core 0 and generators to the other cores (emulates separate hardware; the local
    launcher only: under `--launcher ray` the [ray] section places the daemons)."""
    report_to: tuple[str, ...] = ()
    """Trackers fed from the run's metrics, generator metrics and sample completions: "tensorboard"
    (<run>/trackers/tensorboard/), "wandb" (<run>/trackers/wandb/, offline unless WANDB_MODE is set).
    Needs pip install -e '.[track]'. A tracker that cannot start stops the run before anything starts;
    one that fails later is logged and turned off, and training goes on."""
    track_every_s: float = 10.0
    """How often the trackers are fed the run's new rows (a follower thread of `asyncgrpo run`)."""
    plot_every_s: float | None = 180.0
    """Write <run>/plot.png and plot.html (`asyncgrpo plot`) this often while the run runs, and at its end
    (None: only `asyncgrpo plot RUN` draws them)."""

    def __post_init__(self) -> None:
        require(self, "seed", is_int(self.seed, 0), "an integer >= 0")
        require(self, "num_generators", is_int(self.num_generators, 1), "an integer >= 1")
        require(self, "time_limit_s", self.time_limit_s is None or is_num(self.time_limit_s, 0, lo_open=True),
                "a number of seconds > 0, or omitted (no limit)")
        require(self, "eval_size", self.eval_size is None or is_int(self.eval_size, 1),
                "an integer >= 1, or omitted (whole eval split)")
        require(self, "eval_max_new_tokens", is_int(self.eval_max_new_tokens, 1), "an integer >= 1")
        require(self, "restart_backoff_s", is_num(self.restart_backoff_s, 0, lo_open=True), "a number > 0")
        require(self, "max_generator_restarts",
                self.max_generator_restarts is None or is_int(self.max_generator_restarts, 0),
                "an integer >= 0, or omitted (unlimited)")
        for name in self.report_to:
            require(self, "report_to", name in TRACKER_NAMES,
                    f"a list of trackers from {', '.join(map(repr, TRACKER_NAMES))} (got {name!r})")
        require(self, "report_to", len(set(self.report_to)) == len(self.report_to), "a list without repeats")
        require(self, "track_every_s", is_num(self.track_every_s, 0, lo_open=True), "a number of seconds > 0")
        require(self, "plot_every_s", self.plot_every_s is None or is_num(self.plot_every_s, 0, lo_open=True),
                "a number of seconds > 0, or none (plot only with asyncgrpo plot)")


def _is_gpu_count(x) -> bool:
    """What Ray accepts for a GPU request: a fraction of one GPU, or whole GPUs."""
    return is_num(x, 0) and (x <= 1 or float(x).is_integer())


@dataclass(frozen=True)
class RayConfig:
    """Where the daemons run under `asyncgrpo run --launcher ray` (the local launcher ignores this section).

    Each daemon is a Ray actor that reserves these logical resources and runs the daemon's
    command as a subprocess; the daemon sees the GPUs Ray gives it (CUDA_VISIBLE_DEVICES) and
    OMP_NUM_THREADS = its CPUs (at least 1)."""

    trainer_ranks: int = 1
    """Trainer processes, on one node: 1 runs `asyncgrpo train`, more run it under torchrun
    (--nproc_per_node) in one actor whose resources, ranks x the per-rank ones below, are reserved
    together in a placement group (kept for the trainer across its restarts)."""
    trainer_cpus: float = 1.0
    """CPUs reserved per trainer rank (> 0: a placement group asks for something)."""
    trainer_gpus: float = 0.0
    """GPUs reserved per trainer rank (1 on a GPU cluster, with trainer.device = "cuda")."""
    generator_cpus: float = 1.0
    """CPUs reserved per generator."""
    generator_gpus: float = 0.0
    """GPUs reserved per generator (1 with model.device = "cuda"; a fraction shares a GPU)."""
    compactor_cpus: float = 0.0
    """CPUs reserved for the compactor (0: placed anywhere; it sleeps between passes)."""
    max_trainer_restarts: int | None = 3
    """Restart a crashed trainer (with --resume, after run.restart_backoff_s doubling) this many times,
    then stop the run (None: always)."""
    include_dashboard: bool = False
    """Start Ray's dashboard (port 8265) with the local Ray instance; off: start-up is faster and
    lighter. A cluster given with --address has its own."""

    def __post_init__(self) -> None:
        require(self, "trainer_ranks", is_int(self.trainer_ranks, 1), "an integer >= 1")
        require(self, "trainer_cpus", is_num(self.trainer_cpus, 0, lo_open=True), "a number > 0")
        for key in ("generator_cpus", "compactor_cpus"):
            require(self, key, is_num(getattr(self, key), 0), "a number >= 0")
        for key in ("trainer_gpus", "generator_gpus"):
            require(self, key, _is_gpu_count(getattr(self, key)), "a number >= 0, whole above 1 (Ray's rule)")
        require(self, "trainer_gpus", _is_gpu_count(self.trainer_gpus * self.trainer_ranks),
                f"whole when multiplied by trainer_ranks ({self.trainer_ranks}), or at most 1 in all")
        require(self, "max_trainer_restarts",
                self.max_trainer_restarts is None or is_int(self.max_trainer_restarts, 0),
                "an integer >= 0, or omitted (unlimited)")


@dataclass(frozen=True)
class Config:
    """Everything a run needs; the sections of the TOML file."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    compactor: CompactorConfig = field(default_factory=CompactorConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def parse_override(item: str) -> tuple[str, object]:
    """'trainer.lr=1e-5' -> ('trainer.lr', 1e-05); the value is read as TOML, else as a string
    (so `--set task.path=data/x.jsonl` needs no quotes; `none` turns an optional setting off)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. --set trainer.lr=1e-5")
    if "[" in key:
        raise ConfigError(f"--set {item!r}: entries of a list are not set one by one; set the whole list, e.g. "
                          "--set 'reward.functions=[{name = \"accuracy\"}, {name = \"format\", weight = 0.5}]', "
                          "or write it in the config file")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def read_toml(path: str | os.PathLike) -> dict:
    p = as_path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text: {e}") from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config from TOML file `path` (None: the defaults) with `--set` overrides on top."""
    data = read_toml(path) if path is not None else {}
    where = f"config file {str(path)!r}" if path is not None else "config"
    return _resolve(data, overrides, f"{where} with --set" if overrides else where)


def _resolve(data: dict, overrides, where: str) -> Config:
    """`data` with `--set` overrides laid on it, built and checked; errors say `where`."""
    for item in overrides:
        key, value = parse_override(item)
        data = set_path(data, key, value)
    try:
        _reject_old_reward_keys(data.get("reward"))
        cfg = build(Config, data)
        check_consistency(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return cfg


_OLD_REWARD_KEYS = ("accuracy_weight", "format_weight", "custom", "custom_weight")


def _reject_old_reward_keys(reward) -> None:
    """ConfigError for the reward keys read before rewards became a list, with the list that replaces them."""
    if not isinstance(reward, dict) or not any(k in reward for k in _OLD_REWARD_KEYS):
        return
    old = [k for k in _OLD_REWARD_KEYS if k in reward]
    functions = [{"name": "accuracy", "weight": reward.get("accuracy_weight", 1.0)}]
    if reward.get("format_weight", 0.0) != 0.0:
        functions.append({"name": "format", "weight": reward["format_weight"]})
    if reward.get("custom") not in (None, NONE):
        functions.append({"name": reward["custom"], "weight": reward.get("custom_weight", 1.0)})
    inline = ", ".join(f"{{name = {toml_value(f['name'])}, weight = {toml_value(f['weight'])}}}" for f in functions)
    raise ConfigError(f"{', '.join('reward.' + k for k in old)}: rewards are now a list of functions (built-in "
                      f"accuracy and format, or \"module:function\"), each with a weight; in the [reward] table, "
                      f"replace these keys with: functions = [{inline}] (--set 'reward.functions=[...]' takes the "
                      "same list)")


def check_consistency(cfg: Config) -> None:
    """Rules that span sections."""
    loss = cfg.trainer.loss
    if loss.loss_agg_mode == "seq-mean-token-sum-norm" and loss.max_completion_length is not None \
            and loss.max_completion_length < cfg.generator.sampling.max_new_tokens:
        raise ConfigError(f"trainer.loss.max_completion_length ({loss.max_completion_length}) must be at "
                          f"least generator.sampling.max_new_tokens ({cfg.generator.sampling.max_new_tokens})")
    if cfg.generator.backend == "vllm" and cfg.model.path is None:
        raise ConfigError("generator.backend = 'vllm' needs model.path (a local HF model folder); the "
                          "embedded tiny model runs with the 'hf' backend")
    if cfg.model.path is None and cfg.task.system_prompt is not None:
        outside = sorted(set(cfg.task.system_prompt) - set(CHARACTERS))
        if outside:
            raise ConfigError(f"task.system_prompt = {cfg.task.system_prompt!r} has characters the embedded tiny "
                              f"model's tokenizer does not know ({''.join(outside)!r}; it knows "
                              f"{''.join(CHARACTERS)!r}, no spaces or capitals); write it with those, or set "
                              "model.path to a model of your own")
    keep, limit = cfg.compactor.keep_versions, cfg.trainer.max_staleness
    if keep is not None and limit is None:
        raise ConfigError(f"compactor.keep_versions ({keep}) needs trainer.max_staleness set (it is none): "
                          "without a staleness limit every unconsumed group may still be pulled, so none may "
                          "leave the hot buffer; set trainer.max_staleness, or compactor.keep_versions = none")
    if keep is not None and keep < limit:
        raise ConfigError(f"compactor.keep_versions ({keep}) must be at least trainer.max_staleness ({limit}): "
                          "retention would remove groups the trainer may still pull")


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as TOML (temp file beside it, fsync, then rename)."""
    p = as_path(path)
    atomic_write_bytes(p.parent, p, ("# Resolved configuration of this run (written by asyncgrpo).\n"
                                     + tomli_w.dumps(to_dict(cfg))).encode())


def load_run_config(run_dir: str | os.PathLike) -> Config:
    """The resolved config saved in a run directory."""
    path = as_path(run_dir) / "config.toml"
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory (no config.toml); start one with "
                          f"`asyncgrpo run --run {run_dir}`")
    return load_config(path)


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with `--set` overrides laid on it."""
    return _resolve(to_dict(cfg), overrides, "--set")


def with_tables(cfg: Config, tables: dict, overrides: list[str] | tuple[str, ...], where: str) -> Config:
    """`cfg` with `tables` ({section: {key: value}}, as a config file holds them) and then `--set`
    overrides laid on it, built and checked; errors say `where`."""
    return _resolve(merge(to_dict(cfg), tables), overrides, where)


__all__ = ["Config", "ConfigError", "ModelConfig", "RayConfig", "RunConfig", "load_config", "load_run_config",
           "parse_override", "save_config", "with_overrides", "with_tables"]
