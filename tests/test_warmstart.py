"""Warm start (SFT tensors, determinism, the cache, the default's accuracy band) and greedy evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import CACHE
from workers.checks import ConfigError
from workers.evaluate import complete, evaluate, greedy_accuracy, greedy_accuracy_folder
from workers.model import init_model, load_model, load_tokenizer
from workers.rewards import Scorer
from workers.tasks import Prompt, Task, TaskConfig, load_task
from workers.warmstart import WarmstartConfig, cache_key, cached_model, sft_tensors, train_sft, warmstart

SMALL_TASK = TaskConfig(num_train=300, num_eval=20)
SHORT = WarmstartConfig(steps=4, batch_size=16, num_threads=1)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("ws") / "base", seed=0)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default warm start (default task and steps), from the cache `make run` and the other
    end-to-end tests share (built once, ~1-2 min, by whichever needs it first)."""
    return cached_model(CACHE, TaskConfig(), WarmstartConfig())


def test_sft_tensors_mask_answer_and_eos_only(base):
    tok = load_tokenizer(base)
    task = Task("t", [Prompt("a", "1+2=", "3"), Prompt("b", "10+20=", "30")], [])
    inputs, targets, mask = sft_tensors(tok, task)
    ids = lambda s: tok.convert_tokens_to_ids(list(s))  # noqa: E731
    bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    row0 = [bos, *ids("1+2=3"), eos, pad, pad, pad]
    row1 = [bos, *ids("10+20=30"), eos]
    assert inputs.tolist() == [row0[:-1], row1[:-1]]
    assert targets.tolist() == [row0[1:], row1[1:]]
    # row 0: targets "1+2=" (4) get no loss, "3" and <eos> do, padding does not
    assert mask.tolist() == [[0, 0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1, 1]]


def test_same_seed_same_weights(base):
    task = load_task(SMALL_TASK)
    models = []
    for seed in (0, 0, 1):
        m, tok = load_model(base), load_tokenizer(base)
        stats = train_sft(m, tok, task, WarmstartConfig(steps=4, batch_size=16, seed=seed, num_threads=1))
        assert stats["steps"] == 4 and stats["final_loss"] > 0
        models.append(m.state_dict())
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    assert not all(torch.equal(models[0][k], models[2][k]) for k in models[0])
    assert not all(torch.equal(models[0][k], v) for k, v in load_model(base).state_dict().items())


def test_loss_falls(base):
    losses = []
    m, tok = load_model(base), load_tokenizer(base)
    train_sft(m, tok, load_task(SMALL_TASK), WarmstartConfig(steps=30, batch_size=32, num_threads=1),
              callback=lambda step, model, loss: losses.append(loss))
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_warmstart_folder_and_cache(tmp_path, base, monkeypatch):
    out = warmstart(base, tmp_path / "ws", load_task(SMALL_TASK), SHORT)
    meta = json.loads((out / "asyncgrpo.json").read_text())
    assert meta["warmstart"]["steps"] == 4 and meta["warmstart"]["config"]["batch_size"] == 16
    assert load_tokenizer(out)("1+2=")["input_ids"] == load_tokenizer(base)("1+2=")["input_ids"]

    cache = tmp_path / "cache"
    first = cached_model(cache, SMALL_TASK, SHORT)
    assert first == cache / cache_key(SMALL_TASK, SHORT)
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [first.name]  # no temp left
    assert all(torch.equal(a, b) for a, b in zip(load_model(first).state_dict().values(),
                                                 load_model(out).state_dict().values()))

    def no_rebuild(*a, **k):
        raise AssertionError("rebuilt a cached model")
    monkeypatch.setattr("workers.warmstart.warmstart", no_rebuild)
    assert cached_model(cache, SMALL_TASK, SHORT) == first
    # threads and logging do not change the key; steps and the task do
    assert cache_key(SMALL_TASK, WarmstartConfig(steps=4, batch_size=16, num_threads=2, log_every=1)) == first.name
    assert cache_key(SMALL_TASK, WarmstartConfig(steps=5, batch_size=16)) != first.name
    assert cache_key(TaskConfig(num_train=301, num_eval=20), SHORT) != first.name


def test_cache_key_follows_prompt_file_contents(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    cfg = TaskConfig(name="file", path=str(path), num_eval=1)
    before = cache_key(cfg, SHORT)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "5"}\n')
    assert cache_key(cfg, SHORT) != before


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": -1}, "WarmstartConfig.steps must be an int >= 0, got -1"),
    ({"lr": 0.0}, "WarmstartConfig.lr must be a number > 0, got 0.0"),
    ({"beta2": 1.0}, r"WarmstartConfig.beta2 must be a number in \[0, 1\), got 1.0"),
    ({"num_threads": 0}, "WarmstartConfig.num_threads must be an int >= 1 or None"),
])
def test_bad_configs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        WarmstartConfig(**kwargs)


@pytest.mark.slow
def test_greedy_completions_do_not_depend_on_batching(default_model):
    model, tok = load_model(default_model), load_tokenizer(default_model)
    torch.set_num_threads(1)
    prompts = load_task(TaskConfig()).eval[:48]              # mixed lengths: add2, add3, mul1, sub2
    assert len({len(p.text) for p in prompts}) >= 3
    one_by_one = complete(model, tok, [p.text for p in prompts], max_new_tokens=8, batch_size=1)
    batched = complete(model, tok, [p.text for p in prompts], max_new_tokens=8, batch_size=48)
    assert batched == one_by_one
    assert all("<" not in c and len(c) <= 8 for c in batched)
    scorer = Scorer()
    expected = sum(scorer.score(p, c).correct for p, c in zip(prompts, batched)) / len(prompts)
    assert greedy_accuracy(model, tok, prompts, scorer, max_new_tokens=8, batch_size=5) == expected
    assert greedy_accuracy_folder(default_model, prompts, scorer, max_new_tokens=8) == expected


@pytest.mark.slow
def test_default_warmstart_lands_in_its_accuracy_band(default_model):
    """GRPO needs room to improve and a signal to start from: greedy accuracy on the eval split
    between 20% and 45%, sampling at T=1 right at least 10% of the time."""
    torch.set_num_threads(2)
    model, tok = load_model(default_model), load_tokenizer(default_model)
    task = load_task(TaskConfig())
    greedy = evaluate(model, tok, task.eval, Scorer(), max_new_tokens=8)
    sampled = evaluate(model, tok, task.eval, Scorer(), max_new_tokens=8, temperature=1.0, seed=0)
    print(f"greedy {greedy.accuracy:.3f} {greedy.by_level}; T=1 {sampled.accuracy:.3f} {sampled.by_level}")
    assert 0.20 <= greedy.accuracy <= 0.45
    assert sampled.accuracy >= 0.10
    assert greedy.by_level["add2"] > greedy.by_level["mul1"]
