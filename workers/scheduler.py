"""Prompt scheduler: which prompts the generator samples next.

Groups whose completions are all correct or all wrong carry no gradient (GRPO
advantages are 0) and are filtered out of training, so a group spent on a
prompt the policy always or never solves is wasted. The "difficulty"
scheduler therefore keeps a pass-rate history per prompt and prefers prompts
of medium difficulty:

    history     n <- decay * n + 1,   s <- decay * s + accuracy   (per prompt, per recorded group)
    pass rate   p = s / n             (None while a prompt has no history: "unknown")
    weight      w(p) = 4 p (1 - p)    (Bernoulli variance of a completion's correctness, 1 at p = 1/2);
                w = 1 for unknown prompts, so every prompt gets tried

A prompt with p == 1 is "mastered", with p == 0 "failed" (weight 0). Each draw
of a batch is one of three kinds:

    explore_prob                  uniform over all prompts (difficulty ignored)
    retry_prob                    uniform over the mastered and failed prompts, so they are
                                  re-tested as the policy changes
    1 - explore_prob - retry_prob  proportional to w over the other prompts

History fades in two ways: `history_decay` weighs a prompt's recent groups
more than its old ones, and `forget_after` drops a prompt's history once that
many groups (of any prompt) have been recorded since its last one, so it
counts as unknown and is tried again. The history can be rebuilt from the
buffer at start-up (`load_history`), so a restarted generator keeps it.

"uniform" draws every prompt with the same probability (and still records
history, for inspection). Neither kind repeats a prompt within a batch unless
the batch is larger than the prompt set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from workers.checks import is_int, is_num, require
from workers.tasks import Prompt

SchedulerKind = Literal["difficulty", "uniform"]
SCHEDULER_KINDS: tuple[SchedulerKind, ...] = ("difficulty", "uniform")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the generator picks the prompts of each batch."""

    kind: SchedulerKind = "difficulty"
    """"difficulty": prefer prompts of medium pass rate; "uniform": every prompt alike."""
    explore_prob: float = 0.1
    """Chance that a draw ignores difficulty and picks uniformly among all prompts."""
    retry_prob: float = 0.05
    """Chance that a draw picks among the mastered (pass rate 1) and failed (pass rate 0) prompts,
    so that they are re-tested as the policy changes."""
    history_decay: float = 0.5
    """Weight of a prompt's earlier groups against its newest one, in (0, 1]: at 0.5 the newest
    group counts as much as all earlier ones together; at 1 all count alike."""
    forget_after: int | None = None
    """Groups recorded (of any prompt) after which a prompt's history is dropped and it counts as
    unknown again; None: never."""

    def __post_init__(self):
        require(self, "kind", self.kind in SCHEDULER_KINDS, f"one of {SCHEDULER_KINDS}")
        require(self, "explore_prob", is_num(self.explore_prob, 0, 1), "a number in [0, 1]")
        require(self, "retry_prob", is_num(self.retry_prob, 0, 1), "a number in [0, 1]")
        require(self, "retry_prob", self.explore_prob + self.retry_prob <= 1,
                f"at most 1 - explore_prob = {1 - self.explore_prob:g}")
        require(self, "history_decay", is_num(self.history_decay, 0, 1, lo_open=True), "a number in (0, 1]")
        require(self, "forget_after", self.forget_after is None or is_int(self.forget_after, lo=1),
                "an integer >= 1, or None (never forget)")


def difficulty_weight(pass_rate: np.ndarray) -> np.ndarray:
    """w(p) = 4 p (1 - p) for pass rates p (P,); 0 at p = 0 and p = 1, 1 at p = 1/2."""
    return 4.0 * pass_rate * (1.0 - pass_rate)


class PromptScheduler:
    """Draws batches of prompts and keeps their pass-rate history; see the module doc."""

    def __init__(self, prompts: Sequence[Prompt], cfg: SchedulerConfig | None = None, seed: int = 0):
        if not prompts:
            raise ValueError("PromptScheduler needs at least one prompt, got none "
                             "(is the task's train split empty?)")
        self.prompts = list(prompts)
        self.cfg = cfg if cfg is not None else SchedulerConfig()
        self.index: dict[str, int] = {}
        for i, p in enumerate(self.prompts):
            if p.prompt_id in self.index:
                raise ValueError(f"duplicate prompt_id {p.prompt_id!r} (prompts {self.index[p.prompt_id]} "
                                 f"and {i}): prompt ids must be unique for their history to mean anything")
            self.index[p.prompt_id] = i
        self.rng = np.random.default_rng(seed)
        num = len(self.prompts)
        self._n = np.zeros(num)                    # decayed number of recorded groups, (P,)
        self._s = np.zeros(num)                    # decayed sum of their accuracies, (P,)
        self._last = np.zeros(num, dtype=np.int64)  # value of `recorded` at each prompt's last group
        self.recorded = 0                          # groups recorded so far

    # -- history ------------------------------------------------------------------------------------

    def record(self, prompt_id: str, accuracy: float | None) -> None:
        """Add one group's outcome: the fraction of its completions judged correct, in [0, 1].

        None (or NaN: the task has no notion of correct) records nothing.
        """
        i = self.index.get(prompt_id)
        if i is None:
            raise KeyError(f"record: unknown prompt_id {prompt_id!r}; it is not among the scheduler's "
                           f"{len(self.prompts)} prompts")
        if accuracy is None:
            return
        try:
            acc = float(accuracy)
        except (TypeError, ValueError):
            acc = None
        if isinstance(accuracy, bool) or acc is None or not (0.0 <= acc <= 1.0 or math.isnan(acc)):
            raise ValueError(f"record({prompt_id!r}): accuracy must be a number in [0, 1], got {accuracy!r}")
        if math.isnan(acc):
            return
        forget = self.cfg.forget_after
        if forget is not None and self.recorded - self._last[i] >= forget:   # start afresh
            self._n[i] = self._s[i] = 0.0
        decay = self.cfg.history_decay
        self._n[i] = decay * self._n[i] + 1.0
        self._s[i] = decay * self._s[i] + acc
        self.recorded += 1
        self._last[i] = self.recorded

    def load_history(self, buffer_root: str | os.PathLike, *, task: str | None = None) -> int:
        """Replay the groups of a buffer (or run directory) into the history, oldest first.

        Only groups of this scheduler's prompts (and of `task`, if given) with a
        known accuracy count. A missing or empty buffer gives no history and no
        error. Returns the number of groups recorded.
        """
        from buffer import BufferDir, BufferSQL, find_buffer
        from buffer.layout import BufferError

        try:
            root = find_buffer(buffer_root)
        except BufferError:
            return 0
        if not BufferDir(root).live_shards():
            return 0
        where = "accuracy IS NOT NULL"
        if task is not None:
            where += " AND task = '" + task.replace("'", "''") + "'"
        rows = BufferSQL(root).query(
            f"SELECT prompt_id, accuracy FROM groups WHERE {where} ORDER BY created_at, version, group_id")
        count = 0
        for prompt_id, accuracy in zip(rows.column("prompt_id").to_pylist(), rows.column("accuracy").to_pylist()):
            if prompt_id in self.index:
                self.record(prompt_id, accuracy)
                count += 1
        return count

    def pass_rate(self, prompt_id: str) -> float | None:
        """The prompt's decayed pass rate s / n, or None while it has no (unforgotten) history."""
        p, known = self._pass_rates()
        i = self.index[prompt_id]
        return float(p[i]) if known[i] else None

    def summary(self) -> dict[str, int]:
        """How many prompts are unknown, mastered (pass rate 1), failed (0) and in between."""
        p, known = self._pass_rates()
        mastered, failed = known & (p == 1.0), known & (p == 0.0)
        return {"prompts": len(self.prompts), "unknown": int((~known).sum()), "mastered": int(mastered.sum()),
                "failed": int(failed.sum()), "medium": int((known & ~mastered & ~failed).sum()),
                "recorded": self.recorded}

    def _stale(self) -> np.ndarray:
        """(P,) bool: the prompt's last group is `forget_after` or more recorded groups old."""
        if self.cfg.forget_after is None:
            return np.zeros(len(self.prompts), dtype=bool)
        return self.recorded - self._last >= self.cfg.forget_after

    def _pass_rates(self) -> tuple[np.ndarray, np.ndarray]:
        """Pass rates (P,) (0.5 where unknown) and whether each prompt has a history (P,)."""
        known = (self._n > 0) & ~self._stale()
        return np.divide(self._s, self._n, out=np.full(len(self.prompts), 0.5), where=known), known

    # -- drawing ------------------------------------------------------------------------------------

    def next_batch(self, n: int) -> list[Prompt]:
        """`n` prompts, none twice unless n > len(prompts) (then each at most ceil(n / P) times)."""
        if not is_int(n, lo=0):
            raise ValueError(f"next_batch: n must be an integer >= 0, got {n!r}")
        chosen: list[int] = []
        while len(chosen) < n:
            chosen += self._distinct(min(n - len(chosen), len(self.prompts)))
        return [self.prompts[i] for i in chosen]

    def _distinct(self, k: int) -> list[int]:
        """k <= P distinct prompt indices."""
        num = len(self.prompts)
        if self.cfg.kind == "uniform":
            return self.rng.choice(num, size=k, replace=False).tolist()
        p, known = self._pass_rates()
        decided = known & ((p == 0.0) | (p == 1.0))      # (P,) mastered or failed
        weight = np.where(decided, 0.0, np.where(known, difficulty_weight(p), 1.0))
        free = np.ones(num, dtype=bool)
        explore, retry = self.cfg.explore_prob, self.cfg.retry_prob
        out = []
        for _ in range(k):
            u = self.rng.random()
            if u < explore:
                cand = free.astype(float)
            elif u < explore + retry and (decided & free).any():
                cand = (decided & free).astype(float)
            else:
                cand = weight * free
                if not cand.any():   # only mastered/failed prompts are left: any free one will do
                    cand = free.astype(float)
            cum = np.cumsum(cand)
            i = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
            if i >= num or not cand[i]:    # rounding at the very top: the last candidate
                i = int(np.flatnonzero(cand)[-1])
            out.append(i)
            free[i] = False
        return out
