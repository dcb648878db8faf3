import json
import math
import multiprocessing as mp
import os
import types

import numpy as np
import pyarrow.parquet as pq
import pytest

from buffer import (ROLLOUT_SCHEMA, BufferDir, BufferError, BufferSQL, Completion, Group, Sampler, ShardWriter,
                    StorageError, filter_reason, group_reward_stats)
from buffer.layout import tmp_name
from conftest import make_group


def test_lecture_example_advantages():
    mean, sd, adv = group_reward_stats([1, 0, 1, 0], "population")
    assert mean == 0.5 and sd == 0.5
    np.testing.assert_allclose(adv, [1, -1, 1, -1], atol=1e-5)
    mean, sd, adv = group_reward_stats([1, 0, 1, 0], "sample")
    assert sd == pytest.approx(math.sqrt(1 / 3))
    np.testing.assert_allclose(adv, [0.8660254, -0.8660254, 0.8660254, -0.8660254], atol=1e-5)
    _, _, adv = group_reward_stats([1, 0, 1, 0], "none")
    np.testing.assert_array_equal(adv, [0.5, -0.5, 0.5, -0.5])


def test_all_equal_group_gives_zeros_not_nan():
    for std in ("sample", "population", "none"):
        mean, sd, adv = group_reward_stats([0.7, 0.7, 0.7], std)
        assert (mean, sd) == (pytest.approx(0.7), 0.0)
        assert adv.tolist() == [0.0, 0.0, 0.0]
    _, sd, adv = group_reward_stats([1.0], "sample")  # G = 1: ddof=1 would be NaN
    assert sd == 0.0 and adv.tolist() == [0.0]


@pytest.mark.parametrize("rewards, correct, reason", [
    ([1, 1, 1], [True, True, True], "all_correct"),
    ([0, 0, 0], [False, False, False], "all_wrong"),
    ([0.5, 0.5], [None, None], "all_equal"),
    ([0.5, 0.5], [True, False], "all_equal"),
    ([1, 0, 1], [True, False, True], None),
])
def test_filter_reason(rewards, correct, reason):
    assert filter_reason(rewards, correct) == reason


def test_round_trip_every_column(buf):
    g = make_group(3, [1, 0, 1, 0], prompt_id="q7", tokens=5, seed=1, correct=[1, 0, 1, 0])
    with ShardWriter(buf, generator_id="gen-a", flush_groups=10, flush_seconds=None) as w:
        gid = w.append(g)
    (shard,) = w.shards_written
    t = pq.read_table(shard)
    assert t.schema.remove_metadata() == ROLLOUT_SCHEMA
    rows = t.to_pylist()
    assert [r["traj_id"] for r in rows] == [f"{gid}-{i}" for i in range(4)]
    assert {r["group_id"] for r in rows} == {gid} and gid == f"{w.writer_id}-00000000"
    for r, c in zip(rows, g.completions):
        assert r["completion_ids"] == c.token_ids.tolist()
        assert r["behavior_logprobs"] == c.logprobs.tolist()  # float32 exactly
        assert r["num_tokens"] == 5 and r["reward"] == c.reward
        assert dict(r["reward_components"]) == {"accuracy": c.reward}
    r0 = rows[0]
    assert r0["version"] == 3 and r0["group_size"] == 4 and r0["prompt_ids"] == [1, 2, 3]
    assert r0["generator_id"] == "gen-a" and r0["writer_id"] == w.writer_id
    assert r0["group_reward_mean"] == 0.5 and r0["filtered"] is False and r0["filter_reason"] is None
    assert [r["advantage"] for r in rows] == pytest.approx([0.8660254, -0.8660254] * 2, abs=1e-5)
    assert [r["correct"] for r in rows] == [True, False, True, False]


@pytest.mark.parametrize("background", [False, True])
def test_flush_every_n_groups_and_on_close(buf, background):
    w = ShardWriter(buf, flush_groups=4, flush_seconds=None, background=background)
    for i in range(10):
        w.append(make_group(0, [1, 0], prompt_id=f"p{i}"))
    if background:
        w.wait()
    assert len(w.shards_written) == 2 and w.pending_groups == 2
    w.close()
    assert [pq.read_metadata(p).num_rows for p in w.shards_written] == [8, 8, 4]
    assert [p.name for p in w.shards_written] == [f"{w.writer_id}-00000{i}.parquet" for i in range(3)]


def test_flush_after_t_seconds(buf, monkeypatch):
    import buffer.writer as writer_module

    # The writer's clock moves only when the test moves it: "not yet due" cannot turn into "due" on a slow machine.
    now = [1000.0]
    monkeypatch.setattr(writer_module, "time", types.SimpleNamespace(time=lambda: now[0]))
    w = ShardWriter(buf, flush_groups=100, flush_seconds=1.0)
    w.append(make_group(0, [1, 0]))
    now[0] += 0.5
    assert w.flush_if_due() is None and not w.shards_written
    now[0] += 0.5
    assert w.flush_if_due() is not None
    w.append(make_group(0, [1, 0]))
    now[0] += 1.0
    w.append(make_group(0, [1, 0]))  # the append itself notices the oldest group is due
    assert len(w.shards_written) == 2 and w.pending_groups == 0


def test_parquet_settings(buf):
    with ShardWriter(buf, flush_seconds=None) as w:
        w.append(make_group(0, [1, 0, 1], tokens=64))
    meta = pq.read_metadata(w.shards_written[0])
    rg = meta.row_group(0)
    cols = {rg.column(i).path_in_schema: rg.column(i) for i in range(rg.num_columns)}
    assert all(c.compression == "ZSTD" for c in cols.values())
    dict_enc = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}
    for name in ("completion_ids.list.element", "behavior_logprobs.list.element", "prompt_ids.list.element"):
        assert not dict_enc & set(cols[name].encodings), name
        assert not cols[name].is_stats_set, name
    assert not dict_enc & (set(cols["traj_id"].encodings) | set(cols["completion"].encodings))  # unique values
    assert not dict_enc & set(cols["created_at"].encodings)   # one value per group
    for name in ("prompt", "group_id", "finish_reason", "version", "reward", "sample_index", "advantage"):
        assert dict_enc & set(cols[name].encodings), name   # repeating values, numeric ones included
    assert cols["version"].is_stats_set and cols["version"].statistics.max == 0
    assert meta.metadata[b"asyncgrpo.groups"] == b"1"


@pytest.mark.parametrize("per_rg, expect", [(2, [5, 4, 4]), (3, [6, 7]), (5, [13]), (1, [2, 3, 1, 3, 4])])
def test_row_groups_hold_whole_groups(buf, per_rg, expect):
    """Row groups of `row_group_groups` whole groups (a pull reads whole row groups), the last one short."""
    with ShardWriter(buf, flush_seconds=None, row_group_groups=per_rg) as w:
        for i, g in enumerate([2, 3, 1, 3, 4]):
            w.append(make_group(0, [1, 0, 1, 0][:g] if g > 1 else [1], prompt_id=f"p{i}"))
    meta = pq.read_metadata(w.shards_written[0])
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == expect
    assert meta.metadata[b"asyncgrpo.groups"] == b"5"
    with Sampler(buf) as s:
        assert s.pull(4, trainer_version=0, trainer_step=0, max_staleness=None).table.num_rows == 12


def test_row_group_groups_must_be_positive(buf):
    with pytest.raises(BufferError, match="row_group_groups must be >= 1, got 0"):
        ShardWriter(buf, row_group_groups=0)


@pytest.mark.parametrize("mutate, message", [
    (lambda g: g.completions.clear(), "no completions"),
    (lambda g: setattr(g, "version", -1), "version must be an integer >= 0, got -1"),
    (lambda g: setattr(g.completions[1], "reward", float("nan")), "completion 1: reward must be a finite number, got nan"),
    (lambda g: setattr(g.completions[0], "reward", "1"), "reward must be a finite number, got '1'"),
    (lambda g: setattr(g.completions[0], "logprobs", [0.0]), "4 token_ids but 1 logprobs"),
    (lambda g: setattr(g.completions[0], "finish_reason", "eos"), "finish_reason must be one of"),
])
def test_bad_groups_are_rejected_and_nothing_is_written(buf, mutate, message):
    w = ShardWriter(buf, flush_groups=1, flush_seconds=None)
    g = make_group(0, [1, 0, 1], prompt_id="bad")
    mutate(g)
    with pytest.raises(BufferError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        w.append(g)
    assert "prompt_id='bad'" in str(e.value)
    w.close()
    assert os.listdir(BufferDir(buf).shards) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"flush_groups": 0}, "flush_groups must be >= 1, got 0"),
    ({"flush_seconds": 0}, "flush_seconds must be > 0 or None, got 0"),
])
def test_bad_writer_settings(buf, kwargs, message):
    with pytest.raises(BufferError, match=message):
        ShardWriter(buf, **kwargs)


def _allocate(root, n, q):
    q.put([BufferDir(root).allocate_writer_id(f"g{os.getpid()}") for _ in range(n)])


def test_writer_ids_unique_across_processes(buf):
    BufferDir(buf, create=True)
    q = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=_allocate, args=(str(buf), 10, q)) for _ in range(4)]
    for p in procs:
        p.start()
    ids = sum((q.get(timeout=60) for _ in procs), [])
    for p in procs:
        p.join()
    assert len(ids) == 40 and len(set(ids)) == 40
    assert sorted(ids) == [f"w{i:06d}" for i in range(40)]
    info = json.loads((buf / "writers" / "w000000.json").read_text())
    assert set(info) >= {"writer_id", "generator_id", "host", "pid"}


def test_tmp_files_of_dead_writers_are_cleaned_on_open(buf):
    d = BufferDir(buf, create=True)
    dead = d.tmp / "x%999999999%abcd%w000000-000000.parquet.tmp".replace("x", os.uname().nodename)
    dead.write_bytes(b"half a shard")
    mine = d.tmp / tmp_name("w000001-000000.parquet")
    mine.write_bytes(b"in flight")
    ShardWriter(buf)
    assert not dead.exists() and mine.exists()
    assert BufferSQL(buf).query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 0}]


def test_unknown_reward_types_and_numpy_inputs(buf):
    g = Group(prompt_id="np", prompt="x", prompt_ids=np.array([1, 2], np.int64), version=np.int64(2),
              completions=[Completion("a", np.array([1, 2], np.int64), np.array([-0.5, -0.25]), np.float32(1.0)),
                           Completion("b", [3], [-1.0], 0, finish_reason="length")])
    with ShardWriter(buf, flush_seconds=None) as w:
        w.append(g)
    rows = pq.read_table(w.shards_written[0]).to_pylist()
    assert [r["completion_ids"] for r in rows] == [[1, 2], [3]]
    assert [r["finish_reason"] for r in rows] == ["stop", "length"]
    assert rows[0]["behavior_logprobs"] == [-0.5, -0.25] and rows[0]["version"] == 2


@pytest.mark.parametrize("std", ["sample", "population", "none"])
def test_shard_stats_equal_group_reward_stats_bit_for_bit(buf, std):
    """The writer computes a whole shard's statistics at once; they are exactly the per-group ones."""
    rng = np.random.default_rng(5)
    groups = []
    for i in range(40):
        size = (4, 8, 1, 3)[i % 4]                      # mixed group sizes in one shard
        rewards = rng.normal(size=size) if i % 5 else np.full(size, 0.3)
        if i % 7 == 0:
            rewards = rng.integers(0, 2, size=size).astype(float)
        groups.append(make_group(i, rewards, prompt_id=f"p{i}", seed=i,
                                 correct=[r > 0 for r in rewards] if i % 3 else None))
    with ShardWriter(buf, flush_groups=100, flush_seconds=None, advantage_std=std) as w:
        gids = [w.append(g) for g in groups]
    rows = pq.read_table(w.shards_written[0]).to_pylist()
    assert len(rows) == sum(len(g.completions) for g in groups)
    k = 0
    for g, gid in zip(groups, gids):
        rewards = [c.reward for c in g.completions]
        mean, sd, adv = group_reward_stats(rewards, std)
        reason = filter_reason(rewards, [c.correct for c in g.completions])
        for i, c in enumerate(g.completions):
            r = rows[k]
            k += 1
            assert (r["group_id"], r["traj_id"], r["sample_index"], r["group_size"]) == (
                gid, f"{gid}-{i}", i, len(g.completions))
            assert (r["group_reward_mean"], r["group_reward_std"], r["reward"]) == (mean, sd, c.reward)
            assert r["advantage"] == float(adv[i])                      # float32, exactly
            assert (r["filtered"], r["filter_reason"]) == (reason is not None, reason)
            assert r["completion_ids"] == c.token_ids.tolist() and r["prompt_ids"] == [1, 2, 3]
            assert r["correct"] == c.correct and r["version"] == g.version
    assert sum(r["filtered"] for r in rows) > 0 and sum(not r["filtered"] for r in rows) > 0


def test_python_list_tokens_and_numpy_tokens_give_the_same_shard(buf, tmp_path):
    g = make_group(1, [1, 0, 1], prompt_id="q", tokens=6, seed=2, correct=[1, 0, 1])
    as_lists = Group(prompt_id="q", prompt=g.prompt, prompt_ids=list(g.prompt_ids), version=1, task=g.task,
                     completions=[Completion(c.text, c.token_ids.tolist(), c.logprobs.astype(np.float64).tolist(),
                                             c.reward, reward_components=c.reward_components, correct=c.correct)
                                  for c in g.completions])
    tables = []
    for root, group in ((buf, g), (tmp_path / "lists", as_lists)):
        with ShardWriter(root, flush_seconds=None) as w:
            w.append(group)
        tables.append(pq.read_table(w.shards_written[0]).drop(["created_at"]))
    assert tables[0].equals(tables[1])
    with pytest.raises(Exception, match="2147483648|too large|out of bounds|overflow"):
        with ShardWriter(tmp_path / "big", flush_seconds=None) as w:
            w.append(make_group(0, [1.0], tokens=1))
            w.append(Group(prompt_id="big", prompt="x", prompt_ids=[1], version=0,
                           completions=[Completion("a", np.array([2**31]), [0.0], 1.0)]))


@pytest.mark.parametrize("stage", ["encode", "write"])
def test_background_flush_failure_stops_later_shards_and_requeues_their_groups(buf, monkeypatch, stage):
    """A shard that fails in a flush thread (encoding, or writing its file) stops the shards after it
    (readers only ever see a writer's first k shards); its error comes out of the next call, every group
    of the failed shards is queued again in order, and a retry writes them under the same names:
    nothing lost, nothing twice."""
    import errno
    import threading

    import buffer.writer as writer_mod

    gate = threading.Event()
    name = {"encode": "encode_grouped", "write": "_write_buffer"}[stage]
    real = getattr(writer_mod, name)

    def failing(*args):
        second = (args[0].column("group_id")[0].as_py().endswith("-00000002") if stage == "encode"
                  else args[0].name.endswith("w000000-000001.parquet.tmp"))
        if second:
            gate.wait(10)                                                 # until the third is queued
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(writer_mod, name, failing)
    w = ShardWriter(buf, flush_groups=2, flush_seconds=None)
    ids = [w.append(make_group(0, [1, 0], prompt_id=f"p{i}")) for i in range(6)]  # shards 0, 1, 2
    gate.set()
    with pytest.raises(StorageError, match=r"cannot write .*/shards/w000000-000001\.parquet: No space left"):
        w.flush()
    assert [p.name for p in w.shards_written] == ["w000000-000000.parquet"]
    assert sorted(os.listdir(buf / "shards")) == ["w000000-000000.parquet"] and os.listdir(buf / "tmp") == []
    assert w.pending_groups == 4
    monkeypatch.setattr(writer_mod, name, real)
    w.append(make_group(0, [1, 0], prompt_id="p6"))
    w.close()
    # the 4 requeued groups and the new one reach flush_groups together: one shard, the failed one's name
    assert [p.name for p in w.shards_written] == ["w000000-000000.parquet", "w000000-000001.parquet"]
    got = BufferSQL(buf).query("SELECT group_id, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1").to_pylist()
    assert got == [{"group_id": g, "n": 2} for g in ids + ["w000000-00000006"]]
    assert [pq.read_table(p).column("group_id").to_pylist()[::2] for p in w.shards_written] == \
        [ids[0:2], ids[2:6] + ["w000000-00000006"]]


def test_a_writer_remembers_only_its_newest_shards(tmp_path, monkeypatch):
    """A writer runs for days: its list of written shards is bounded, its count is not."""
    import buffer.writer

    monkeypatch.setattr(buffer.writer, "SHARDS_REMEMBERED", 2)
    with ShardWriter(tmp_path / "b", flush_groups=1, flush_seconds=None) as w:
        for i in range(5):
            w.append(make_group(0, [1, 0], prompt_id=f"p{i}", seed=i))
    assert w.num_shards_written == 5
    assert [p.name for p in w.shards_written] == [f"{w.writer_id}-00000{i}.parquet" for i in (3, 4)]
