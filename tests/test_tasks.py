"""Tasks: seeded arithmetic prompts with a level mix, disjoint splits, prompt files and their errors."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workers.checks import ConfigError
from workers.model import CHARACTERS
from workers.tasks import LevelMix, Prompt, TaskConfig, TaskError, gsm8k_answer, level_counts, load_task


def test_arithmetic_is_deterministic_by_seed():
    a, b, c = (load_task(TaskConfig(seed=s, num_train=500, num_eval=50)) for s in (0, 0, 1))
    assert a.train == b.train and a.eval == b.eval
    assert [p.text for p in a.train] != [p.text for p in c.train]


def test_arithmetic_splits_are_disjoint_and_sized_by_the_mix():
    task = load_task(TaskConfig())  # the defaults: 6000 train, 200 eval, mix 0.85 / 0.05 / 0.05 / 0.05
    assert Counter(p.level for p in task.train) == {"add2": 5100, "add3": 300, "sub2": 300, "mul1": 300}
    assert Counter(p.level for p in task.eval) == {"add2": 170, "add3": 10, "sub2": 10, "mul1": 10}
    train_texts = {p.text for p in task.train}
    assert len(train_texts) == len(task.train)
    assert not train_texts & {p.text for p in task.eval}
    assert len({p.prompt_id for p in task.train + task.eval}) == 6200


def test_arithmetic_prompts_are_right_and_in_the_vocabulary():
    task = load_task(TaskConfig(num_train=2000, mix=LevelMix(mul2=0.2)))
    allowed = set(CHARACTERS)
    seen = set()
    for p in task.train + task.eval:
        assert set(p.text + p.answer) <= allowed, p
        a, op, b = _split(p.text)
        assert p.answer == str({"+": a + b, "-": a - b, "*": a * b}[op]), p
        seen.add(p.level)
        if p.level == "add2":
            assert op == "+" and 0 <= a <= 99 and 0 <= b <= 99
        elif p.level == "add3":
            assert op == "+" and 100 <= a <= 999 and 100 <= b <= 999
        elif p.level == "sub2":
            assert op == "-" and 0 <= b <= a <= 99
        elif p.level == "mul1":
            assert op == "*" and 10 <= a <= 99 and 2 <= b <= 9
        else:
            assert p.level == "mul2" and op == "*" and 10 <= a <= 99 and 10 <= b <= 99
    assert seen == {"add2", "add3", "sub2", "mul1", "mul2"}
    # the levels are interleaved, not in blocks
    assert len({p.level for p in task.train[:50]}) >= 3


def _split(text: str) -> tuple[int, str, int]:
    assert text.endswith("=")
    for op in "+-*":
        if op in text:
            a, b = text[:-1].split(op)
            return int(a), op, int(b)
    raise AssertionError(text)


def test_level_counts_largest_remainder():
    assert level_counts({"a": 1, "b": 1, "c": 1}, 10) == {"a": 4, "b": 3, "c": 3}
    assert level_counts({"a": 0.7, "b": 0.3}, 3) == {"a": 2, "b": 1}
    assert level_counts({"a": 1.0, "b": 0.001}, 10) == {"a": 10}


def test_a_level_too_small_for_the_request_is_an_error():
    with pytest.raises(TaskError, match=r"'mul1' has only 720 distinct prompts, but the mix asks for 990 train"):
        load_task(TaskConfig(num_train=990, num_eval=10, mix=LevelMix(add2=0, add3=0, sub2=0, mul1=1)))


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "file"}, "TaskConfig.path must be a prompt file path"),
    ({"path": "x.jsonl"}, "TaskConfig.path must be unset unless"),
    ({"num_eval": 0}, "TaskConfig.num_eval must be an int >= 1, got 0"),
    ({"num_train": None}, "TaskConfig.num_train must be an int >= 1 for arithmetic, got None"),
    ({"name": "math"}, "TaskConfig.name must be one of"),
])
def test_bad_configs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TaskConfig(**kwargs)


def test_bad_mix():
    with pytest.raises(ConfigError, match=r"LevelMix.sub2 must be a weight >= 0, got -0.5"):
        LevelMix(sub2=-0.5)
    with pytest.raises(ConfigError, match=r"LevelMix weights must not all be 0"):
        LevelMix(add2=0, add3=0, sub2=0, mul1=0)


# ---- prompt files ----------------------------------------------------------------------------

def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_jsonl_with_gsm8k_answers_and_held_out_eval(tmp_path):
    records = [{"prompt": f"q{i}?", "answer": f"work ... #### {1000 + i:,}"} for i in range(10)]
    records.append({"prompt": "plain", "answer": 7, "level": "easy"})
    path = write_jsonl(tmp_path / "p.jsonl", records)
    task = load_task(TaskConfig(name="file", path=path, num_eval=3, num_train=None))
    assert task.name == "p"
    assert len(task.eval) == 3 and len(task.train) == 8
    assert not {p.text for p in task.eval} & {p.text for p in task.train}
    by_text = {p.text: p for p in task.train + task.eval}
    assert by_text["q3?"] == Prompt("p.jsonl:4", "q3?", "1003", "")
    assert by_text["plain"] == Prompt("p.jsonl:11", "plain", "7", "easy")
    again = load_task(TaskConfig(name="file", path=path, num_eval=3, num_train=None))
    assert again.eval == task.eval
    other_seed = load_task(TaskConfig(name="file", path=path, num_eval=3, seed=5, num_train=None))
    assert other_seed.eval != task.eval
    capped = load_task(TaskConfig(name="file", path=path, num_eval=3, num_train=2))
    assert capped.train == task.train[:2]


def test_gsm8k_keys_and_separate_eval_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"question": "a", "answer": "x\n#### 1"},
                                                    {"question": "b", "answer": "#### -2"},
                                                    {"question": "shared", "answer": "#### 3"}])
    test = write_jsonl(tmp_path / "test.jsonl", [{"question": "shared", "answer": "#### 3"},
                                                  {"question": "c", "answer": "#### 4.5"},
                                                  {"question": "d", "answer": "#### 5"}])
    task = load_task(TaskConfig(name="file", path=train, eval_path=test, prompt_key="question", num_eval=2))
    assert [(p.text, p.answer) for p in task.eval] == [("shared", "3"), ("c", "4.5")]
    assert [(p.text, p.answer) for p in task.train] == [("a", "1"), ("b", "-2")]  # "shared" is eval


def test_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2=", "3+3="], "answer": ["2", "#### 4", "6"]}), path)
    task = load_task(TaskConfig(name="file", path=str(path), num_eval=1))
    assert sorted((p.prompt_id, p.answer) for p in task.train + task.eval) == [
        ("p.parquet:1", "2"), ("p.parquet:2", "4"), ("p.parquet:3", "6")]


def test_gsm8k_answer():
    assert gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert gsm8k_answer("#### 1,234") == "1234"
    assert gsm8k_answer("a #### 1 #### 2") == "2"
    assert gsm8k_answer("  42 ") == "42"


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], r"bad\.jsonl: line 2: not valid JSON"),
    (['{"prompt": "a", "answer": "1"}', '', '{"answer": "2"}'], r"bad\.jsonl: line 3: no 'prompt' key"),
    (['{"prompt": "a"}'], r"bad\.jsonl: line 1: no 'answer' key \(keys: \['prompt'\]\)"),
    ([], r"bad\.jsonl' holds no prompts \(empty file\)"),
    (['', '   '], r"bad\.jsonl' holds no prompts \(empty file\)"),
    (['[1, 2]'], r"bad\.jsonl: line 1: expected a JSON object, got list"),
    (['{"prompt": "", "answer": "1"}'], r"bad\.jsonl: line 1: 'prompt' must be a non-empty string"),
    (['{"prompt": "a", "answer": null}'], r"bad\.jsonl: line 1: 'answer' must be a string or number"),
    (['{"prompt": "a", "answer": "work ####  "}'], r"bad\.jsonl: line 1: 'answer' is empty"),
])
def test_bad_jsonl_files(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(TaskError, match=message):
        load_task(TaskConfig(name="file", path=str(path), num_eval=1))


def test_bad_files_other(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    with pytest.raises(TaskError, match=r"prompt file '.*missing\.jsonl' does not exist"):
        load_task(TaskConfig(name="file", path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(TaskError, match=r"'.*good\.jsonl' holds 2 prompts, too few to hold out TaskConfig\.num_eval = 2"):
        load_task(TaskConfig(name="file", path=good, num_eval=2))
    with pytest.raises(TaskError, match=r"unknown format '\.csv'; use \.jsonl or \.parquet"):
        (tmp_path / "p.csv").write_text("prompt,answer\n")
        load_task(TaskConfig(name="file", path=str(tmp_path / "p.csv")))
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(TaskError, match=r"'.*fake\.parquet' is not a readable Parquet file"):
        load_task(TaskConfig(name="file", path=str(tmp_path / "fake.parquet")))
    pq.write_table(pa.table({"prompt": ["a", "b"], "solution": ["1", "2"]}), tmp_path / "nokey.parquet")
    with pytest.raises(TaskError, match=r"nokey\.parquet: row 1: no 'answer' key"):
        load_task(TaskConfig(name="file", path=str(tmp_path / "nokey.parquet")))
    with pytest.raises(TaskError, match=r"every prompt is also in the eval split"):
        load_task(TaskConfig(name="file", path=good, eval_path=good))
    bad_eval = write_jsonl(tmp_path / "bad_eval.jsonl", ['{"prompt": "x"}'])
    with pytest.raises(TaskError, match=r"bad_eval\.jsonl: line 1: no 'answer' key"):
        load_task(TaskConfig(name="file", path=good, eval_path=bad_eval))


def test_arithmetic_dev_split_is_disjoint_stratified_and_leaves_the_other_splits_alone():
    cfg = TaskConfig()
    plain, with_dev = load_task(cfg), load_task(cfg, num_dev=1000)
    assert with_dev.train == plain.train and with_dev.eval == plain.eval and plain.dev == []
    dev = with_dev.dev
    assert len(dev) == len({p.text for p in dev}) == 1000
    assert not {p.text for p in dev} & ({p.text for p in plain.train} | {p.text for p in plain.eval})
    assert Counter(p.level for p in dev) == {"add2": 850, "add3": 50, "sub2": 50, "mul1": 50}
    assert all(str(eval(p.text[:-1])) == p.answer for p in dev)      # noqa: S307 (our own arithmetic)
    assert load_task(cfg, num_dev=1000).dev == dev and load_task(TaskConfig(seed=1), num_dev=1000).dev != dev


def test_arithmetic_dev_split_too_large_for_a_level_names_the_setting():
    only_mul1 = LevelMix(add2=0, add3=0, sub2=0, mul1=1)                                    # 720 prompts
    with pytest.raises(TaskError, match=r"level 'mul1' has 0 prompts left beside train and eval, too few for a "
                                        r"dev split of 5; lower warmstart.dev_size"):
        load_task(TaskConfig(num_train=710, num_eval=10, mix=only_mul1), num_dev=5)
