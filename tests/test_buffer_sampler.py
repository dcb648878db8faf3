import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buffer import BufferError, BufferSQL, GroupIndex, Sampler, ShardWriter, admission_limit
from conftest import make_group

G = 4


def _fill(buf, versions, *, filtered_every=None, flush_groups=3):
    """Groups with the given versions; every `filtered_every`-th is all-correct."""
    ids = []
    with ShardWriter(buf, flush_groups=flush_groups, flush_seconds=None) as w:
        for i, v in enumerate(versions):
            rewards = [1] * G if filtered_every and i % filtered_every == 0 else [1, 0, 0, 1]
            ids.append(w.append(make_group(v, rewards, prompt_id=f"p{i}", seed=i, correct=rewards)))
    return ids


def _check_whole_groups(batch):
    t = batch.table
    gids = t.column("group_id").to_pylist()
    assert len(gids) == G * batch.num_groups
    expect = [g for g in batch.group_ids for _ in range(G)]
    assert gids == expect  # rows in pull order, each group's rows together
    assert t.column("sample_index").to_pylist() == list(range(G)) * batch.num_groups
    assert not any(t.column("filtered").to_pylist())


def test_oldest_first_and_staleness_limit_exact(buf):
    ids = _fill(buf, [0, 0, 1, 1, 2, 2, 3, 3])
    with Sampler(buf) as s:
        # at version 3 with limit 2, versions 0 are expired, 1 is exactly at the limit
        assert s.pull(7, trainer_version=3, trainer_step=1, max_staleness=2) is None
        b = s.pull(2, trainer_version=3, trainer_step=1, max_staleness=2)
        assert b.group_ids == ids[2:4] and b.staleness.tolist() == [2, 2]
        _check_whole_groups(b)
        b = s.pull(4, trainer_version=3, trainer_step=2, max_staleness=2)
        assert b.group_ids == ids[4:8] and b.staleness.tolist() == [1, 1, 0, 0]
        c = s.counts(3, 2)
        assert (c["eligible"], c["consumed"], c["expired"], c["filtered"]) == (0, 6, 2, 0)
        assert c["by_version"] == {0: {"expired": 2}, 1: {"consumed": 2}, 2: {"consumed": 2},
                                   3: {"consumed": 2}}
        assert s.pull(1, trainer_version=3, trainer_step=3, max_staleness=None).group_ids == ids[:1]


def test_newest_and_uniform_orders(buf):
    ids = _fill(buf, [0, 1, 2, 3, 4, 5])
    with Sampler(buf, order="newest") as s:
        assert s.pull(2, trainer_version=5, trainer_step=1, max_staleness=None).group_ids == [ids[5], ids[4]]
    picks = []
    for seed in (0, 0, 1):
        with Sampler(buf, order="uniform", seed=seed, as_of_step=0) as s:
            picks.append(s.pull(3, trainer_version=5, trainer_step=1, max_staleness=None).group_ids)
    assert picks[0] == picks[1] and set(picks[0]) <= set(ids)
    assert picks[0] != picks[2]  # seed 1 draws differently (fixed numbers: not flaky)


def test_filtered_and_future_groups_never_pulled(buf):
    ids = _fill(buf, [0, 0, 0, 0, 5, 5], filtered_every=2)
    with Sampler(buf) as s:
        c = s.counts(1, None)
        assert c["filtered"] == 3 and c["filtered_by_reason"]["all_correct"] == 3 and c["future"] == 1
        assert c["eligible"] == 2 and c["admitted"] == 3
        b = s.pull(2, trainer_version=1, trainer_step=1, max_staleness=None)
        assert b.group_ids == [ids[1], ids[3]]
        assert s.pull(1, trainer_version=1, trainer_step=2, max_staleness=None) is None
        assert s.pull(1, trainer_version=5, trainer_step=2, max_staleness=None).group_ids == [ids[5]]


def test_reopen_replays_ledger_nothing_twice_nothing_skipped(buf):
    ids = _fill(buf, [0] * 10 + [1] * 10, filtered_every=7)
    learnable = [g for i, g in enumerate(ids) if i % 7]
    seen = []
    for step in range(1, 100):
        with Sampler(buf) as s:  # a fresh trainer process each step
            b = s.pull(3, trainer_version=1, trainer_step=step, max_staleness=None)
            if b is None:
                rest = s.counts(1, None)["eligible"]
                break
            seen += b.group_ids
    assert len(seen) == len(set(seen)) == 15 and rest == 2
    assert set(seen) < set(learnable)
    with Sampler(buf) as s:
        last = s.pull(2, trainer_version=1, trainer_step=step, max_staleness=None)
    assert sorted(seen + last.group_ids) == sorted(learnable)


def test_as_of_step_gives_back_exactly_the_undone_groups(buf):
    _fill(buf, [0] * 12)
    with Sampler(buf) as s:
        per_step = {k: s.pull(2, trainer_version=0, trainer_step=k, max_staleness=None).group_ids
                    for k in range(1, 6)}
    # the trainer crashed after step 5 and resumes from its checkpoint at step 2
    with Sampler(buf, as_of_step=2) as s:
        redo = {k: s.pull(2, trainer_version=0, trainer_step=k, max_staleness=None).group_ids
                for k in range(3, 6)}
        assert redo == {k: per_step[k] for k in range(3, 6)}  # same groups, same order
        assert s.counts(0, None)["eligible"] == 2
    abandoned = sorted(os.listdir(buf / "ledger" / "abandoned"))
    assert [n.split("-", 2)[2] for n in abandoned] == [f"step-{k:09d}-0000.parquet" for k in (3, 4, 5)]
    rows = BufferSQL(buf).query("SELECT trainer_step, count(*) AS n, count(DISTINCT group_id) AS d "
                                "FROM consumed GROUP BY 1 ORDER BY 1").to_pylist()
    assert rows == [{"trainer_step": k, "n": 2, "d": 2} for k in range(1, 6)]
    twice = BufferSQL(buf).query("SELECT count(*) AS n FROM groups WHERE times_consumed > 1")
    assert twice.to_pylist() == [{"n": 0}]
    # read-only index as of a step ignores later records without moving anything
    assert GroupIndex(buf, as_of_step=1, quarantine=False).counts(0, None)["consumed"] == 2


def test_reuse_makes_passes(buf):
    ids = _fill(buf, [0] * 4)
    with Sampler(buf, reuse=2) as s:
        got = [s.pull(2, trainer_version=0, trainer_step=k, max_staleness=None).group_ids for k in range(1, 5)]
        assert s.pull(1, trainer_version=0, trainer_step=5, max_staleness=None) is None
    assert got == [ids[:2], ids[2:], ids[:2], ids[2:]]
    uses = BufferSQL(buf).query("SELECT use_index, count(*) AS n FROM consumed GROUP BY 1 ORDER BY 1")
    assert uses.to_pylist() == [{"use_index": 0, "n": 4}, {"use_index": 1, "n": 4}]


def test_one_trainer_per_buffer(buf):
    _fill(buf, [0])
    with Sampler(buf):
        with pytest.raises(BufferError, match="another trainer holds"):
            Sampler(buf)
    Sampler(buf).close()  # released on close


@pytest.mark.parametrize("kwargs, message", [
    ({"reuse": 0}, "reuse must be >= 1"), ({"order": "lifo"}, "order must be one of"),
    ({"as_of_step": -1}, "as_of_step must be >= 0, got -1"),
])
def test_bad_sampler_settings(buf, kwargs, message):
    _fill(buf, [0])
    with pytest.raises(BufferError, match=message):
        Sampler(buf, **kwargs)


def test_bad_pull_arguments(buf):
    _fill(buf, [0])
    with Sampler(buf) as s:
        with pytest.raises(BufferError, match="pull size must be >= 1, got 0"):
            s.pull(0, trainer_version=0, trainer_step=1, max_staleness=None)
        with pytest.raises(BufferError, match="max_staleness must be >= 0 or None, got -1"):
            s.pull(1, trainer_version=0, trainer_step=1, max_staleness=-1)


def test_admission_limit_formula():
    assert admission_limit(0, 0, 32) == 32
    assert admission_limit(5, 2, 32) == (2 + 5 + 1) * 32
    assert admission_limit(5, None, 32) is None


# ---- property: random histories against a reference model --------------------------------

ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("pull"), st.integers(1, 5), st.sampled_from([None, 0, 1, 2])),
    st.tuples(st.just("advance"), st.integers(1, 2)),
    st.tuples(st.just("reopen")),
), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=ops)
def test_pull_matches_reference_model(tmp_path_factory, history):
    buf = tmp_path_factory.mktemp("prop") / "buffer"
    # inline flushes: the model must know exactly which groups are visible at each pull
    writer = ShardWriter(buf, flush_groups=2, flush_seconds=None, background=False)
    sampler = Sampler(buf, cache_bytes=4096)
    t, step, model = 0, 0, {}  # model: group_id -> dict(version, filtered, consumed, order)
    pending = []
    for op in history:
        if op[0] == "append":
            _, count, lag, all_same = op
            for _ in range(count):
                v = max(0, t - lag)
                rewards = [1.0] * G if all_same else [1.0, 0.0, 1.0, 0.0]
                gid = writer.append(make_group(v, rewards, prompt_id=f"p{len(model)}"))
                model[gid] = dict(version=v, filtered=all_same, consumed=False, order=len(model))
                pending.append(gid)
                pending = pending[len(pending) - writer.pending_groups:]  # the rest was flushed
        elif op[0] == "pull":
            _, n, limit = op
            visible = {g: m for g, m in model.items() if g not in pending}
            elig = sorted((g for g, m in visible.items() if not m["filtered"] and not m["consumed"]
                           and 0 <= t - m["version"] and (limit is None or t - m["version"] <= limit)),
                          key=lambda g: (model[g]["version"], model[g]["order"]))
            step += 1
            b = sampler.pull(n, trainer_version=t, trainer_step=step, max_staleness=limit)
            if len(elig) < n:
                assert b is None
            else:
                assert b.group_ids == elig[:n]
                _check_whole_groups(b)
                assert all(0 <= s <= (limit if limit is not None else 99) for s in b.staleness)
                for g in b.group_ids:
                    model[g]["consumed"] = True
        elif op[0] == "advance":
            t += op[1]
        else:  # reopen: a restarted trainer replays the ledger
            sampler.close()
            sampler = Sampler(buf, cache_bytes=4096)
    writer.close()
    sampler.close()
    consumed = BufferSQL(buf).query("SELECT group_id, count(*) AS n FROM consumed GROUP BY 1").to_pylist()
    assert {r["group_id"] for r in consumed} == {g for g, m in model.items() if m["consumed"]}
    assert all(r["n"] == 1 for r in consumed)
    s = Sampler(buf)
    c = s.counts(t, None)
    s.close()
    assert c["consumed"] == sum(m["consumed"] for m in model.values())
    assert c["filtered"] == sum(m["filtered"] for m in model.values())
    assert c["groups"] == len(model)


def test_pull_after_compaction_of_multi_row_group_shards(buf, monkeypatch):
    """Shards of several row groups are merged into row groups of at least C_ROW_GROUP_GROUPS groups, cut
    between the sources' row groups (here 4: row groups of 4, 5, 5 and 1 groups); a pull then reads the
    same rows (variable group sizes, so groups start mid row group), in pull order."""
    import pyarrow.parquet as pq

    import buffer.compaction
    from buffer import compact

    monkeypatch.setattr(buffer.compaction, "C_ROW_GROUP_GROUPS", 4)

    with ShardWriter(buf, flush_groups=5, flush_seconds=None, row_group_groups=2) as w:
        ids = [w.append(make_group(0, [1, 0, 1][: 2 + i % 2], prompt_id=f"p{i}", seed=i)) for i in range(15)]
    before = BufferSQL(buf).query("SELECT * FROM rollouts ORDER BY traj_id")
    r = compact(buf, target_groups=100, min_age_s=0.0, grace_s=0.0)
    assert (r.merged_files, r.written_files, r.groups) == (3, 1, 15)
    (c,) = os.listdir(buf / "shards")
    meta = pq.read_metadata(buf / "shards" / c)
    assert meta.num_rows == before.num_rows
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [10, 12, 13, 2]
    with Sampler(buf, order="newest") as s:
        b = s.pull(15, trainer_version=0, trainer_step=0, max_staleness=None)
    assert b.group_ids == ids[::-1]
    sizes = [2 + i % 2 for i in range(15)][::-1]
    assert b.table.column("group_id").to_pylist() == [g for g, n in zip(b.group_ids, sizes) for _ in range(n)]
    assert b.table.column("sample_index").to_pylist() == [k for n in sizes for k in range(n)]
    got = b.table.sort_by([("traj_id", "ascending")])
    assert got.drop(["created_at"]).to_pylist() == before.drop(["created_at"]).to_pylist()


@pytest.mark.parametrize("order", ["oldest", "newest", "uniform"])
def test_row_group_cache_changes_nothing_but_speed(tmp_path, order):
    """Pulls through the decoded-row-group cache return exactly what uncached pulls return, and the
    cache stays within its budget (versions lag, so shards are read at several steps)."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(7)
    versions = [max(0, i // 6 - int(rng.choice([0, 0, 1, 2]))) for i in range(60)]
    bufs = [tmp_path / "a", tmp_path / "b"]
    for b in bufs:
        _fill(b, versions, filtered_every=5, flush_groups=7)
    one = pq.read_table(next((bufs[1] / "shards").iterdir())).nbytes   # a shard is one row group here
    budget = int(2.5 * one)
    with Sampler(bufs[0], order=order, cache_bytes=0) as plain, \
            Sampler(bufs[1], order=order, cache_bytes=budget) as cached:
        for step in range(12):
            kw = dict(trainer_version=step + 2, trainer_step=step, max_staleness=3)
            a, b = plain.pull(3, **kw), cached.pull(3, **kw)
            assert (a is None) == (b is None)
            if a is None:
                continue
            assert a.group_ids == b.group_ids
            assert a.table.drop(["created_at"]).equals(b.table.drop(["created_at"]))
            assert plain.cached_bytes == 0 and one <= cached.cached_bytes <= budget


def test_cache_bytes_must_not_be_negative(buf):
    _fill(buf, [0])
    with pytest.raises(BufferError, match=r"cache_bytes must be >= 0 \(0: no cache\), got -1"):
        Sampler(buf, cache_bytes=-1)


def test_the_cache_holds_no_more_memory_than_its_bound(tmp_path, monkeypatch):
    """Row groups of one c-file are cached as separate reads: the distinct buffers the cache keeps alive
    add up to at most cache_bytes (slices of one multi-row-group read kept every sibling's rows alive)."""
    from buffer import compact

    buf = tmp_path / "b"
    _fill(buf, [i // 4 for i in range(200)], flush_groups=4)
    monkeypatch.setattr("buffer.compaction.C_ROW_GROUP_GROUPS", 8)     # a c-file of 25 row groups
    compact(buf, target_groups=256, min_age_s=0.0, grace_s=0.0)
    import pyarrow.parquet as pq

    (cfile,) = (buf / "shards").glob("c-*.parquet")
    pf = pq.ParquetFile(cfile)
    assert pf.metadata.num_row_groups >= 4
    budget = int(2.5 * pf.read_row_group(0).get_total_buffer_size())
    with Sampler(buf, order="uniform", seed=3, cache_bytes=budget) as s:
        for step in range(20):
            assert s.pull(6, trainer_version=60, trainer_step=step + 1, max_staleness=None) is not None
            held = {}
            for part in s._cache.values():
                for col in part.columns:
                    for chunk in col.chunks:
                        for b in chunk.buffers():
                            if b is not None:
                                held[b.address] = b.size
            assert 0 < sum(held.values()) <= budget, (step, sum(held.values()), s.cached_bytes)
