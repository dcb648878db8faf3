"""Prompt scheduler: difficulty preference, retries, uniformity, fading history, buffer history, config checks."""

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from buffer import BufferDir, ShardWriter
from conftest import REPO, make_group
from workers.checks import ConfigError
from workers.scheduler import PromptScheduler, SchedulerConfig, difficulty_weight
from workers.tasks import Prompt

PROMPTS = [Prompt(f"p{i:02d}", f"{i}+1=", str(i + 1)) for i in range(30)]
# p00, p03, ... never solved; p01, p04, ... always solved; p02, p05, ... solved half the time
RATE = {p.prompt_id: (0.0, 1.0, 0.5)[i % 3] for i, p in enumerate(PROMPTS)}
KIND = {0.0: "failed", 1.0: "mastered", 0.5: "medium"}


def _with_history(cfg: SchedulerConfig, seed: int = 0) -> PromptScheduler:
    s = PromptScheduler(PROMPTS, cfg, seed=seed)
    for _ in range(3):
        for pid, rate in RATE.items():
            s.record(pid, rate)
    return s


def _draw_kinds(s: PromptScheduler, batches: int, n: int = 8) -> Counter:
    kinds = Counter()
    for _ in range(batches):
        batch = s.next_batch(n)
        assert len(batch) == n and len({p.prompt_id for p in batch}) == n      # no duplicate in a batch
        kinds.update(KIND[RATE[p.prompt_id]] for p in batch)
    return kinds


def test_difficulty_prefers_medium_prompts_over_uniform():
    diff = _draw_kinds(_with_history(SchedulerConfig(kind="difficulty")), 500)
    unif = _draw_kinds(_with_history(SchedulerConfig(kind="uniform")), 500)
    assert diff == {"medium": 3461, "mastered": 277, "failed": 262}
    assert unif == {"medium": 1282, "mastered": 1393, "failed": 1325}
    assert diff["medium"] / unif["medium"] > 2.5
    # expected medium share: 0.85 of draws by weight (while medium prompts are free) + 0.1 exploring
    assert 0.8 < diff["medium"] / 4000 < 0.92


def test_mastered_and_failed_prompts_are_retried_sometimes():
    s = _with_history(SchedulerConfig(explore_prob=0.0, retry_prob=0.05))
    kinds = _draw_kinds(s, 500)
    assert kinds == {"medium": 3806, "mastered": 84, "failed": 110}   # 194 of 4000 ~ 0.05
    # without exploring or retrying, only medium prompts are drawn while enough of them are free
    none = _draw_kinds(_with_history(SchedulerConfig(explore_prob=0.0, retry_prob=0.0)), 200)
    assert none == {"medium": 1600}


def test_weights_are_medium_first():
    np.testing.assert_allclose(difficulty_weight(np.array([0.0, 0.25, 0.5, 0.75, 1.0])),
                               [0.0, 0.75, 1.0, 0.75, 0.0])
    s = _with_history(SchedulerConfig(explore_prob=0.0, retry_prob=0.0))
    assert s.summary() == {"prompts": 30, "unknown": 0, "mastered": 10, "failed": 10, "medium": 10,
                           "recorded": 90}


def test_draws_are_proportional_to_the_weights():
    s = PromptScheduler(PROMPTS[:3], SchedulerConfig(explore_prob=0.0, retry_prob=0.0), seed=2)
    s.record("p00", 0.5)       # weight 1
    s.record("p01", 0.25)      # weight 0.75
    s.record("p02", 1.0)       # weight 0: mastered
    counts = Counter(s.next_batch(1)[0].prompt_id for _ in range(7000))
    assert counts == {"p00": 4013, "p01": 2987}
    assert counts["p01"] / counts["p00"] == pytest.approx(0.75, abs=0.03)


def test_uniform_is_uniform():
    s = PromptScheduler(PROMPTS, SchedulerConfig(kind="uniform"), seed=1)
    counts = Counter(p.prompt_id for _ in range(1000) for p in s.next_batch(6))
    assert sorted(counts) == sorted(RATE) and sum(counts.values()) == 6000
    expected = 6000 / 30
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 52.3          # chi-square, 29 degrees of freedom, p = 0.005
    assert (min(counts.values()), max(counts.values())) == (179, 215)


def test_history_is_ignored_by_uniform_but_recorded():
    s = _with_history(SchedulerConfig(kind="uniform"))
    assert s.pass_rate("p01") == 1.0 and s.pass_rate("p02") == 0.5


def test_unseen_prompts_are_tried_first():
    s = PromptScheduler(PROMPTS, SchedulerConfig(explore_prob=0.0, retry_prob=0.0), seed=0)
    seen = {p.prompt_id for p in PROMPTS[:20]}
    for pid in seen:
        s.record(pid, RATE[pid])      # 6 of the 20 are medium (weight 1), like the 10 unseen
    batch = {p.prompt_id for p in s.next_batch(16)}
    assert batch == {p.prompt_id for p in PROMPTS[20:]} | {pid for pid in seen if RATE[pid] == 0.5}


def test_decay_weighs_recent_groups_more():
    s = PromptScheduler(PROMPTS, SchedulerConfig(history_decay=0.5))
    flat = PromptScheduler(PROMPTS, SchedulerConfig(history_decay=1.0))
    for acc in (1.0, 1.0, 1.0, 0.0):
        s.record("p00", acc)
        flat.record("p00", acc)
    assert s.pass_rate("p00") == pytest.approx(0.875 / 1.875, abs=1e-15)   # n = 1.875, s = 0.875
    assert flat.pass_rate("p00") == 0.75
    assert s.pass_rate("p01") is None


def test_forget_after_makes_a_prompt_unknown_again():
    s = PromptScheduler(PROMPTS, SchedulerConfig(forget_after=3, explore_prob=0.0, retry_prob=0.0))
    s.record("p01", 1.0)
    for acc in (0.5, 0.5):
        s.record("p02", acc)
    assert s.pass_rate("p01") == 1.0 and s.summary()["mastered"] == 1
    s.record("p02", 0.5)                     # the third group since p01's last one
    assert s.pass_rate("p01") is None and s.summary()["unknown"] == 29
    s.record("p01", 0.0)                     # a fresh history, not mixed with the forgotten one
    assert s.pass_rate("p01") == 0.0


def test_batches_larger_than_the_prompt_set_and_empty_batches():
    s = PromptScheduler(PROMPTS[:4], SchedulerConfig(), seed=3)
    assert s.next_batch(0) == []
    counts = Counter(p.prompt_id for p in s.next_batch(10))
    assert sorted(counts.values()) == [2, 2, 3, 3]
    with pytest.raises(ValueError, match="n must be an integer >= 0, got -1"):
        s.next_batch(-1)


def test_same_seed_same_batches():
    a, b = (_with_history(SchedulerConfig(), seed=7) for _ in range(2))
    assert [p.prompt_id for p in a.next_batch(12)] == [p.prompt_id for p in b.next_batch(12)]


def test_record_rejects_bad_input_and_skips_unknown_accuracy():
    s = PromptScheduler(PROMPTS)
    with pytest.raises(KeyError, match="unknown prompt_id 'nope'"):
        s.record("nope", 0.5)
    with pytest.raises(ValueError, match=r"accuracy must be a number in \[0, 1\], got 1.5"):
        s.record("p00", 1.5)
    s.record("p00", None)
    s.record("p00", float("nan"))
    assert s.pass_rate("p00") is None and s.recorded == 0
    s.record("p00", np.float32(0.25))
    assert s.pass_rate("p00") == 0.25


def test_bad_prompt_sets():
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptScheduler([])
    with pytest.raises(ValueError, match="duplicate prompt_id 'p00'"):
        PromptScheduler([PROMPTS[0], PROMPTS[1], PROMPTS[0]])


def test_load_history_from_a_buffer(tmp_path):
    buf = tmp_path / "buffer"
    outcomes = [("p00", [0, 0, 0, 0]), ("p01", [1, 1, 1, 1]), ("p02", [1, 0, 1, 0]),
                ("p02", [1, 1, 1, 0]), ("elsewhere", [1, 0, 0, 0])]
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:
        for v, (pid, correct) in enumerate(outcomes):
            w.append(make_group(v, correct, prompt_id=pid, correct=correct))
        w.append(make_group(9, [1, 0], prompt_id="p03"))          # correct unknown: no accuracy
    s = PromptScheduler(PROMPTS, SchedulerConfig(history_decay=0.5))
    assert s.load_history(tmp_path) == 4                          # a run directory works too
    assert (s.pass_rate("p00"), s.pass_rate("p01")) == (0.0, 1.0)
    assert s.pass_rate("p02") == pytest.approx((0.5 * 0.5 + 0.75) / 1.5)   # oldest first, decayed
    assert s.pass_rate("p03") is None
    assert s.summary()["unknown"] == 27
    only = PromptScheduler(PROMPTS)
    assert only.load_history(buf, task="another task") == 0


def test_load_history_from_a_missing_or_empty_buffer(tmp_path):
    s = PromptScheduler(PROMPTS)
    assert s.load_history(tmp_path / "nothing-here") == 0
    assert s.load_history(tmp_path) == 0                          # a run directory without buffer/
    BufferDir(tmp_path / "buffer", create=True)
    assert s.load_history(tmp_path / "buffer") == 0
    assert s.recorded == 0 and s.summary()["unknown"] == 30


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "easy-first"}, "SchedulerConfig.kind must be one of ('difficulty', 'uniform'), got 'easy-first'"),
    ({"explore_prob": 1.5}, "SchedulerConfig.explore_prob must be a number in [0, 1], got 1.5"),
    ({"retry_prob": -0.1}, "SchedulerConfig.retry_prob must be a number in [0, 1], got -0.1"),
    ({"explore_prob": 0.7, "retry_prob": 0.5},
     "SchedulerConfig.retry_prob must be at most 1 - explore_prob = 0.3, got 0.5"),
    ({"history_decay": 0.0}, "SchedulerConfig.history_decay must be a number in (0, 1], got 0.0"),
    ({"forget_after": 0}, "SchedulerConfig.forget_after must be an integer >= 1, or None (never forget), got 0"),
])
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError) as e:
        SchedulerConfig(**kwargs)
    assert str(e.value) == message


def test_scheduler_does_not_import_torch():
    code = "import sys, workers.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
