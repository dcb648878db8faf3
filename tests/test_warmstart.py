"""Warm start (SFT tensors, determinism, the cache, the default's accuracy band) and greedy evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import CACHE, run_cli
from workers.checks import ConfigError
from workers.evaluate import EvalResult, complete, evaluate, greedy_accuracy, greedy_accuracy_folder
from workers.model import init_model, load_model, load_tokenizer
from workers.rewards import Scorer
from workers.tasks import Prompt, Task, TaskConfig, load_task
from workers.warmstart import (WarmstartConfig, WarmstartError, cache_key, cached_model, dev_split, lr_factor,
                               select_levels, sft_tensors, train_sft, warmstart)

SMALL_TASK = TaskConfig(num_train=300, num_eval=20)
SHORT = WarmstartConfig(steps=4, batch_size=16, num_threads=1, target_accuracy=None)


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
    inputs, targets, mask = sft_tensors(tok, task.train)
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
        stats = train_sft(m, tok, task.train, WarmstartConfig(steps=4, batch_size=16, seed=seed, num_threads=1,
                                                              target_accuracy=None))
        assert stats["steps"] == 4 and stats["decided_by"] == "steps" and stats["final_loss"] > 0
        models.append(m.state_dict())
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    assert not all(torch.equal(models[0][k], models[2][k]) for k in models[0])
    assert not all(torch.equal(models[0][k], v) for k, v in load_model(base).state_dict().items())


def test_loss_falls(base):
    losses = []
    m, tok = load_model(base), load_tokenizer(base)
    train_sft(m, tok, load_task(SMALL_TASK).train,
              WarmstartConfig(steps=30, batch_size=32, num_threads=1, target_accuracy=None, warmup_steps=10),
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
    same = WarmstartConfig(steps=4, batch_size=16, num_threads=2, log_every=1, target_accuracy=None)
    assert cache_key(SMALL_TASK, same) == first.name
    assert cache_key(SMALL_TASK, WarmstartConfig(steps=5, batch_size=16, target_accuracy=None)) != first.name
    assert cache_key(SMALL_TASK, WarmstartConfig(steps=4, batch_size=16, target_accuracy=0.25)) != first.name
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
    ({"target_accuracy": 0.5}, r"WarmstartConfig.target_accuracy must be within \[min_accuracy, max_accuracy\] "
                               r"= \[0.2, 0.4\], got 0.5"),
    ({"target_accuracy": 1.5}, r"WarmstartConfig.target_accuracy must be a number in \[0, 1\] or None"),
    ({"eval_every": 0}, "WarmstartConfig.eval_every must be an int >= 1, got 0"),
    ({"warmup_steps": -1}, "WarmstartConfig.warmup_steps must be an int >= 0, got -1"),
])
def test_bad_configs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        WarmstartConfig(**kwargs)


def scripted_dev(monkeypatch, accuracies):
    """Replace the stop rule's dev evaluation by a script of accuracies; returns the prompt counts."""
    script, calls = iter(accuracies), []

    def fake_evaluate(model, tokenizer, prompts, scorer, **kwargs):
        calls.append(len(prompts))
        return EvalResult(next(script), {}, len(prompts), [])
    monkeypatch.setattr("workers.warmstart.evaluate", fake_evaluate)
    return calls


RULE = dict(batch_size=8, num_threads=1, eval_every=2, warmup_steps=2, dev_size=10)


def sft(base, cfg, dev=True):
    task = load_task(SMALL_TASK)
    train, dev_prompts = dev_split(task.train, 10, 0)
    m, tok = load_model(base), load_tokenizer(base)
    return m, train_sft(m, tok, train, cfg, dev=dev_prompts if dev else None)


def weights_after(base, steps):
    """The model after exactly `steps` steps of the RULE configuration (same seed, same batches)."""
    model, _ = sft(base, WarmstartConfig(steps=steps, **{**RULE, "target_accuracy": None}), dev=False)
    return model.state_dict()


def same_weights(model, state) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), state.values()))


def test_stop_rule_stops_at_a_check_that_reaches_the_target(base, monkeypatch):
    calls = scripted_dev(monkeypatch, [0.05, 0.12, 0.31, 0.28])   # checks at 2, 4, 6; then step 5
    model, stats = sft(base, WarmstartConfig(steps=20, **RULE))
    assert stats["steps"] == 6 and stats["decided_by"] == "target" and stats["dev_accuracy"] == 0.31
    assert stats["checks"] == [[2, 0.05], [4, 0.12], [6, 0.31], [5, 0.28]] and calls == [10] * 4
    assert same_weights(model, weights_after(base, 6))


def test_stop_rule_steps_back_to_the_first_step_at_the_target(base, monkeypatch):
    scripted_dev(monkeypatch, [0.05, 0.12, 0.38, 0.31])           # step 5 already reached it
    model, stats = sft(base, WarmstartConfig(steps=20, **RULE))
    assert stats["steps"] == 5 and stats["decided_by"] == "target" and stats["dev_accuracy"] == 0.31
    assert same_weights(model, weights_after(base, 5))


def test_stop_rule_one_step_over_the_band_keeps_the_step_before(base, monkeypatch):
    scripted_dev(monkeypatch, [0.1, 0.25, 0.55, 0.45])            # 4: 0.25, 5: 0.45 (> max), 6: 0.55
    model, stats = sft(base, WarmstartConfig(steps=20, **RULE))
    assert stats["steps"] == 4 and stats["decided_by"] == "overshoot, step before kept"
    assert stats["dev_accuracy"] == 0.25 and stats["checks"][-2:] == [[6, 0.55], [5, 0.45]]
    assert same_weights(model, weights_after(base, 4))


@pytest.mark.parametrize("accuracies, message", [
    ([0.1, 0.55, 0.5], r"warm start overshot its band: dev accuracy 0.500 at step 3 is above max_accuracy 0.4, "
                       r"and the step before \(0.100 at step 2\) is below min_accuracy 0.2"),
    ([0.45, 0.41], r"overshot its band: dev accuracy 0.410 at step 1 .* step before \(none\)"),
    ([0.0, 0.01, 0.02], r"warm start reached its cap of 5 steps with dev accuracy 0.020, outside \[0.2, 0.4\] "
                        r"\(target 0.3\); raise warmstart.steps"),
])
def test_stop_rule_errors_name_the_figures(base, monkeypatch, accuracies, message):
    scripted_dev(monkeypatch, accuracies)
    with pytest.raises(WarmstartError, match=message):
        sft(base, WarmstartConfig(steps=5, **RULE))


def test_stop_rule_at_the_cap_checks_the_last_step_and_accepts_the_band(base, monkeypatch):
    scripted_dev(monkeypatch, [0.0, 0.1, 0.22])
    _, stats = sft(base, WarmstartConfig(steps=5, **RULE))   # checks at 2, 4 and the cap, 5
    assert stats["steps"] == 5 and stats["decided_by"] == "cap" and stats["checks"][-1] == [5, 0.22]


def test_stop_rule_needs_a_dev_split(base):
    with pytest.raises(ValueError, match="dev split is needed"):
        sft(base, WarmstartConfig(steps=5, **RULE), dev=False)


def test_dev_split_is_seeded_and_disjoint():
    train = load_task(SMALL_TASK).train
    rest, dev = dev_split(train, 30, 0)
    assert len(rest) == 270 and len(dev) == 30 and not {p.text for p in rest} & {p.text for p in dev}
    assert dev_split(train, 30, 0) == (rest, dev) and dev_split(train, 30, 1)[1] != dev
    with pytest.raises(WarmstartError, match="dev_size = 300 leaves no train prompts: the task has 300"):
        dev_split(train, 300, 0)


def test_lr_warmup_is_linear_then_constant():
    assert [lr_factor(s, 4) for s in (1, 2, 3, 4, 5, 100)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(1, 0) == 1.0


def test_warmstart_folder_records_what_decided_the_stop(tmp_path, base, monkeypatch):
    calls = scripted_dev(monkeypatch, [0.1, 0.33, 0.29, 0.27])   # checks 2, 4, then step 3; then eval
    task = load_task(SMALL_TASK)
    out = warmstart(base, tmp_path / "ws", task, WarmstartConfig(steps=20, **RULE))
    meta = json.loads((out / "asyncgrpo.json").read_text())["warmstart"]
    add2 = sum(p.level == "add2" for p in dev_split(task.train, 10, 0)[0])
    assert 200 < add2 < 290
    assert {k: meta[k] for k in ("steps", "decided_by", "dev_accuracy", "eval_accuracy", "num_train", "num_dev",
                                 "num_eval")} == {"steps": 4, "decided_by": "target", "dev_accuracy": 0.33,
                                                  "eval_accuracy": 0.27, "num_train": add2, "num_dev": 10,
                                                  "num_eval": 20}
    assert meta["config"]["target_accuracy"] == 0.3 and calls == [10, 10, 10, 20]


def test_levels_select_the_sft_prompts():
    train = load_task(SMALL_TASK).train
    assert {p.level for p in select_levels(train, ("add2", "mul1"))} == {"add2", "mul1"}
    assert select_levels(train, None) == train
    with pytest.raises(WarmstartError, match=r"warmstart.levels = \['div'\] selects none of the 300 train prompts "
                                             r"\(their levels: \['add2', 'add3', 'mul1', 'sub2'\]\)"):
        select_levels(train, ("div",))


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
    """What the stop rule guarantees on any machine: it stopped inside [min_accuracy, max_accuracy]
    on the dev split, within its cap, and the recorded accuracy is what the saved weights give. The
    eval split (200 prompts of the same mix) is checked against it with a margin of 0.15, over 4
    standard deviations of the difference between the two samples (200 and 1,000 prompts) at 30%."""
    cfg = WarmstartConfig()
    meta = json.loads((default_model / "asyncgrpo.json").read_text())["warmstart"]
    print({k: meta[k] for k in ("steps", "decided_by", "dev_accuracy", "eval_accuracy", "seconds")})
    assert meta["decided_by"] in ("target", "overshoot, step before kept", "cap")
    assert cfg.min_accuracy <= meta["dev_accuracy"] <= cfg.max_accuracy
    assert 1 <= meta["steps"] <= cfg.steps and meta["num_dev"] == cfg.dev_size

    torch.set_num_threads(2)
    model, tok = load_model(default_model), load_tokenizer(default_model)
    task = load_task(TaskConfig())
    dev = load_task(TaskConfig(), num_dev=cfg.dev_size).dev
    dev_acc = evaluate(model, tok, dev, Scorer(), max_new_tokens=cfg.eval_max_new_tokens).accuracy
    assert abs(dev_acc - meta["dev_accuracy"]) <= 0.02      # a greedy near-tie may flip under other threads
    greedy = evaluate(model, tok, task.eval, Scorer(), max_new_tokens=8)
    print(f"greedy {greedy.accuracy:.3f} {greedy.by_level}")
    assert abs(greedy.accuracy - meta["eval_accuracy"]) <= 0.02
    assert abs(greedy.accuracy - meta["dev_accuracy"]) <= 0.15
    assert greedy.by_level["add2"] > greedy.by_level["mul1"]


def test_onednn_switch_from_the_environment(base, monkeypatch):
    from workers.model import ONEDNN_ENV, ModelError

    before = torch.backends.mkldnn.enabled
    try:
        monkeypatch.setenv(ONEDNN_ENV, "off")
        load_model(base)
        assert torch.backends.mkldnn.enabled is False
        monkeypatch.setenv(ONEDNN_ENV, "on")
        load_model(base)
        assert torch.backends.mkldnn.enabled is True
        monkeypatch.setenv(ONEDNN_ENV, "maybe")
        with pytest.raises(ModelError, match="environment variable ASYNCGRPO_ONEDNN='maybe': use 'on' or 'off'"):
            load_model(base)
    finally:
        torch.backends.mkldnn.enabled = before   # as the environment this suite runs under set it


def test_cli_warm_start_outside_its_band_is_a_clear_error_and_caches_nothing(tmp_path):
    r = run_cli("warmstart", "--set", f"model.cache_dir={tmp_path}", "--set", "warmstart.steps=2",
                "--set", "warmstart.eval_every=1", timeout=180)
    assert r.returncode == 2, r.stderr
    assert "warm start reached its cap of 2 steps with dev accuracy 0.0" in r.stderr
    assert "outside [0.2, 0.4] (target 0.3); raise warmstart.steps" in r.stderr and "Traceback" not in r.stderr
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_cli_warmstart_prints_what_decided_the_stop(default_model):
    r = run_cli("warmstart", "--set", f"model.cache_dir={CACHE}", timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    meta = json.loads((default_model / "asyncgrpo.json").read_text())["warmstart"]
    assert out["folder"] == str(default_model)
    assert {k: out[k] for k in ("steps", "decided_by", "dev_accuracy", "eval_accuracy")} == \
        {k: meta[k] for k in ("steps", "decided_by", "dev_accuracy", "eval_accuracy")}
    assert abs(out["greedy_accuracy"] - meta["eval_accuracy"]) <= 0.02
