"""Tasks: the prompts a run trains on, and a held-out eval split.

Two kinds:

- "arithmetic": synthetic, seeded. Prompts look like "12+34=" and the answer
  is "46". Levels of mixed difficulty (2-digit addition as the bulk, a
  minority of harder ones), so that after the warm start some groups come
  out all correct, some all wrong, and some mixed. Each level's train and
  eval prompts are drawn without replacement from one pool, so no prompt
  text is in both splits.
- "file": JSONL or Parquet records with a prompt and an answer key. An answer
  in GSM8K style ("...reasoning... #### 42") counts as the text after the
  last "####". The eval split is either held out of the file (seeded) or read
  from a separate file; prompts whose text is in the eval split are dropped
  from train.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from workers.chat import ChatFormat
from workers.checks import ConfigError, is_int, is_num, require

TaskName = Literal["arithmetic", "file"]
TASK_NAMES: tuple[TaskName, ...] = ("arithmetic", "file")


class TaskError(ValueError):
    """A prompt file that cannot be used; the message names the file (and line or row)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt with its reference answer."""

    prompt_id: str
    """Stable id: the text for arithmetic prompts, "<file name>:<line>" for file prompts."""
    text: str
    """What the model is given, e.g. "12+34="."""
    answer: str
    """The reference answer, e.g. "46" (for GSM8K-style files the part after "####")."""
    level: str = ""
    """Difficulty level ("add2", ...) or the file's `level` value; "" when unknown."""


@dataclass(frozen=True)
class Level:
    """One kind of arithmetic prompt: `a op b` with a and b drawn uniformly from their ranges."""

    op: Literal["+", "-", "*"]
    a: tuple[int, int]
    b: tuple[int, int]
    nonnegative: bool = False
    """For "-": put the larger operand first, so answers are never negative."""

    def pool_size(self) -> int:
        na, nb = self.a[1] - self.a[0] + 1, self.b[1] - self.b[0] + 1
        if self.nonnegative:  # unordered pairs of one range
            assert self.a == self.b
            return na * (na + 1) // 2
        return na * nb

    def draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(*self.a), rng.randint(*self.b)
        if self.nonnegative and a < b:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[self.op]
        return f"{a}{self.op}{b}=", str(value)


LEVELS: dict[str, Level] = {
    "add2": Level("+", (0, 99), (0, 99)),            # 12+34=46: the bulk, learnable in minutes
    "add3": Level("+", (100, 999), (100, 999)),      # 123+456=579
    "sub2": Level("-", (0, 99), (0, 99), nonnegative=True),  # 57-23=34
    "mul1": Level("*", (10, 99), (2, 9)),            # 47*6=282: 2-digit by 1-digit
    "mul2": Level("*", (10, 99), (10, 99)),          # 47*63=2961: out of reach in minutes
}



@dataclass(frozen=True)
class LevelMix:
    """Relative weights (>= 0, positive sum) of the arithmetic levels; each split has these
    proportions exactly (largest remainder rounding)."""

    add2: float = 0.85
    """a+b with a, b in 0..99: the bulk, which GRPO improves within minutes."""
    add3: float = 0.05
    """a+b with a, b in 100..999 (hard after the default warm start: mostly all-wrong groups)."""
    sub2: float = 0.05
    """a-b with a, b in 0..99 and a >= b (hard after the default warm start)."""
    mul1: float = 0.05
    """a*b with a in 10..99, b in 2..9; 720 distinct prompts (hard after the default warm start)."""
    mul2: float = 0.0
    """a*b with a, b in 10..99: out of reach within minutes."""

    def __post_init__(self):
        for name in LEVELS:
            require(self, name, is_num(getattr(self, name), 0), "a weight >= 0")
        if not self.weights():
            raise ConfigError(f"LevelMix weights must not all be 0, got {dataclasses.asdict(self)}")

    def weights(self) -> dict[str, float]:
        """Level name -> weight, for the levels with a weight > 0."""
        return {name: float(getattr(self, name)) for name in LEVELS if getattr(self, name) > 0}


@dataclass(frozen=True)
class TaskConfig:
    """Which prompts a run uses; validated on construction."""

    name: TaskName = "arithmetic"
    """"arithmetic" (synthetic, seeded) or "file" (JSONL / Parquet prompts at `path`)."""
    path: str | None = None
    """Prompt file for name="file": .jsonl or .parquet with `prompt_key` and `answer_key`."""
    eval_path: str | None = None
    """Separate eval file for name="file" (same format); None holds `num_eval` prompts out of `path`."""
    prompt_key: str = "prompt"
    """Record key of the prompt text in prompt files (GSM8K calls it "question")."""
    answer_key: str = "answer"
    """Record key of the answer; "... #### 42" answers count as "42"."""
    seed: int = 0
    """Seed of the arithmetic prompts and of the held-out split."""
    num_train: int | None = 6000
    """Train prompts: how many to generate (arithmetic), or at most this many from the file
    (None: all of them)."""
    num_eval: int = 200
    """Eval prompts: generated (arithmetic), held out of `path`, or the first ones of `eval_path`."""
    mix: LevelMix = field(default_factory=LevelMix)
    """Arithmetic levels and their weights."""
    chat_template: bool = False
    """Feed each prompt through the model tokenizer's chat template (a user message, after the
    system prompt if one is set, then the assistant's opening), in generation, evaluation and the
    warm start alike: what instruct models expect. The model folder must have a template (the
    embedded tiny model has a simple one); the buffer's `prompt` column keeps the bare text."""
    system_prompt: str | None = None
    """System message put before every prompt; needs chat_template = true. None: no system message."""

    def __post_init__(self):
        require(self, "name", self.name in TASK_NAMES, f"one of {TASK_NAMES}")
        if self.name == "file":
            require(self, "path", isinstance(self.path, str) and self.path != "",
                    'a prompt file path (.jsonl or .parquet) when name = "file"')
        else:
            require(self, "path", self.path is None, 'unset unless name = "file"')
            require(self, "eval_path", self.eval_path is None, 'unset unless name = "file"')
            require(self, "num_train", is_int(self.num_train, 1), "an int >= 1 for arithmetic")
        require(self, "eval_path", self.eval_path is None or (isinstance(self.eval_path, str)
                                                              and self.eval_path != ""),
                "a file path or unset")
        require(self, "prompt_key", isinstance(self.prompt_key, str) and self.prompt_key != "",
                "a non-empty string")
        require(self, "answer_key", isinstance(self.answer_key, str) and self.answer_key != "",
                "a non-empty string")
        require(self, "seed", is_int(self.seed, 0), "an int >= 0")
        require(self, "num_train", self.num_train is None or is_int(self.num_train, 1),
                "an int >= 1 or None (all)")
        require(self, "num_eval", is_int(self.num_eval, 1), "an int >= 1")
        require(self, "mix", isinstance(self.mix, LevelMix), "a LevelMix (a table of level weights)")
        require(self, "chat_template", isinstance(self.chat_template, bool), "true or false")
        require(self, "system_prompt", self.system_prompt is None or (isinstance(self.system_prompt, str)
                                                                      and self.system_prompt != ""),
                "a non-empty string or unset")
        if self.system_prompt is not None and not self.chat_template:
            raise ConfigError(f"TaskConfig.system_prompt = {self.system_prompt!r} needs task.chat_template "
                              "= true (a system prompt is a message of the chat template); set "
                              "task.chat_template = true, or unset task.system_prompt")

    def chat(self) -> ChatFormat | None:
        """How prompts are encoded: through the chat template (with the system prompt), or None (plain)."""
        return ChatFormat(self.system_prompt) if self.chat_template else None


@dataclass
class Task:
    """The prompts of a run: train (shuffled), a disjoint eval split, and an optional dev split
    disjoint from both (drawn for the warm start's stop rule); `chat` says how they are encoded
    (`workers.chat.encode_prompts`)."""

    name: str
    train: list[Prompt]
    eval: list[Prompt]
    dev: list[Prompt] = field(default_factory=list)
    chat: ChatFormat | None = None


def load_task(cfg: TaskConfig, *, num_dev: int = 0) -> Task:
    """The task `cfg` describes. Raises TaskError for unusable prompt files.

    `num_dev` > 0 also draws a dev split of that many arithmetic prompts, disjoint from train and
    eval, in the eval split's level proportions, without changing those splits (its own seeded
    generator). File tasks have no prompts to draw from: their dev split stays empty.
    """
    if cfg.name == "arithmetic":
        task = _arithmetic(cfg)
        if num_dev > 0:
            task.dev = _arithmetic_dev(cfg, num_dev, task.train + task.eval)
    else:
        task = _from_files(cfg)
    task.chat = cfg.chat()
    return task


# ---- arithmetic ------------------------------------------------------------------------------

def level_counts(mix: dict[str, float], n: int) -> dict[str, int]:
    """Split n prompts over the levels in proportion to their weights (largest remainder)."""
    total = sum(mix.values())
    exact = {k: n * w / total for k, w in mix.items()}
    counts = {k: int(x) for k, x in exact.items()}
    by_remainder = sorted(mix, key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_remainder[: n - sum(counts.values())]:
        counts[k] += 1
    return {k: c for k, c in counts.items() if c > 0}


def _draw_distinct(name: str, rng: random.Random, k: int, exclude: set[str] = frozenset()) -> list[Prompt]:
    """`k` prompts of level `name` with distinct texts, none in `exclude`, in the order first drawn."""
    level, drawn = LEVELS[name], {}
    while len(drawn) < k:
        text, answer = level.draw(rng)
        if text not in exclude:
            drawn.setdefault(text, answer)
    return [Prompt(text, text, answer, name) for text, answer in drawn.items()]


def _arithmetic(cfg: TaskConfig) -> Task:
    rng = random.Random(cfg.seed)
    mix = cfg.mix.weights()
    n_eval, n_train = level_counts(mix, cfg.num_eval), level_counts(mix, cfg.num_train)
    train: list[Prompt] = []
    evals: list[Prompt] = []
    for name in sorted(mix):
        level, k_eval, k_train = LEVELS[name], n_eval.get(name, 0), n_train.get(name, 0)
        if k_eval + k_train > level.pool_size():
            raise TaskError(f"arithmetic level {name!r} has only {level.pool_size()} distinct prompts, "
                            f"but the mix asks for {k_train} train + {k_eval} eval; lower "
                            f"TaskConfig.num_train or mix.{name}")
        items = _draw_distinct(name, rng, k_eval + k_train)
        evals += items[:k_eval]
        train += items[k_eval:]
    rng.shuffle(train)
    rng.shuffle(evals)
    return Task("arithmetic", train, evals)


def _arithmetic_dev(cfg: TaskConfig, n: int, taken: list[Prompt]) -> list[Prompt]:
    rng = random.Random(f"dev:{cfg.seed}")
    used = {p.text for p in taken}
    dev: list[Prompt] = []
    for name, k in sorted(level_counts(cfg.mix.weights(), n).items()):
        free = LEVELS[name].pool_size() - sum(p.level == name for p in taken)
        if k > free:
            raise TaskError(f"arithmetic level {name!r} has {free} prompts left beside train and eval, too few "
                            f"for a dev split of {k}; lower warmstart.dev_size or TaskConfig.num_train")
        dev += _draw_distinct(name, rng, k, exclude=used)
    rng.shuffle(dev)
    return dev


# ---- prompt files ----------------------------------------------------------------------------

def gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K-style solution: the text after the last "####", commas removed."""
    if "####" not in answer:
        return answer.strip()
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def read_prompts(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Prompt]:
    """All prompts of a .jsonl or .parquet file; TaskError naming the file and line (or row)."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"prompt file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        records = _jsonl_records(path)
        where = "line"
    elif suffix in (".parquet", ".pq"):
        records = _parquet_records(path)
        where = "row"
    else:
        raise TaskError(f"prompt file {str(path)!r}: unknown format {suffix!r}; use .jsonl or .parquet")
    prompts = []
    for number, record in records:
        at = f"{path}: {where} {number}"
        if not isinstance(record, dict):
            raise TaskError(f"{at}: expected a JSON object, got {type(record).__name__}")
        for key in (prompt_key, answer_key):
            if key not in record:
                raise TaskError(f"{at}: no {key!r} key (keys: {sorted(record)})")
        text, answer = record[prompt_key], record[answer_key]
        if not isinstance(text, str) or text == "":
            raise TaskError(f"{at}: {prompt_key!r} must be a non-empty string, got {text!r}")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise TaskError(f"{at}: {answer_key!r} must be a string or number, got {answer!r}")
        answer = gsm8k_answer(answer)
        if answer == "":
            raise TaskError(f"{at}: {answer_key!r} is empty (nothing after '####'?)")
        level = record.get("level", "")
        prompts.append(Prompt(f"{path.name}:{number}", text, answer, str(level) if level is not None else ""))
    if not prompts:
        raise TaskError(f"prompt file {str(path)!r} holds no prompts (empty file)")
    return prompts


def _jsonl_records(path: Path):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskError(f"{path}: line {lineno}: not UTF-8 text (byte {e.start + 1}: "
                                f"{raw[e.start:e.start + 1]!r}); JSONL files are UTF-8") from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}: line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def _parquet_records(path: Path):
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise TaskError(f"prompt file {str(path)!r} is not a readable Parquet file ({e})") from None
    yield from enumerate(rows, start=1)


def _from_files(cfg: TaskConfig) -> Task:
    prompts = read_prompts(cfg.path, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
    if cfg.eval_path is not None:
        evals = read_prompts(cfg.eval_path, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
        evals = evals[: cfg.num_eval]
        train = list(prompts)
    else:
        if cfg.num_eval >= len(prompts):
            raise TaskError(f"prompt file {cfg.path!r} holds {len(prompts)} prompts, too few to hold out "
                            f"TaskConfig.num_eval = {cfg.num_eval} for eval and keep some to train on")
        order = list(prompts)
        random.Random(cfg.seed).shuffle(order)
        evals, train = order[: cfg.num_eval], order[cfg.num_eval:]
    held_out = {p.text for p in evals}
    train = [p for p in train if p.text not in held_out]
    if not train:
        raise TaskError(f"prompt file {cfg.path!r}: every prompt is also in the eval split")
    if cfg.num_train is not None:
        train = train[: cfg.num_train]
    return Task(Path(cfg.path).stem, train, evals)
