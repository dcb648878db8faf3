"""Unreadable shards are quarantined with a reason; SQL and pull go on."""

import json
import os

import pyarrow.parquet as pq
import pytest

from buffer import BufferSQL, GroupIndex, Sampler, ShardWriter, compact
from buffer.verify import verify
from conftest import make_group


def _fill(buf, n, flush_groups=2, tokens=4):
    with ShardWriter(buf, flush_groups=flush_groups, flush_seconds=None) as w:
        ids = [w.append(make_group(0, [1, 0, 0, 1], prompt_id=f"p{i}", seed=i, tokens=tokens)) for i in range(n)]
    return w, ids


def _truncate(p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _garbage(p):
    p.write_bytes(os.urandom(p.stat().st_size))


@pytest.mark.parametrize("damage", [_truncate, _garbage])
def test_sql_quarantines_and_goes_on(buf, damage):
    w, ids = _fill(buf, 6)
    bad = w.shards_written[1]
    damage(bad)
    rows = BufferSQL(buf).query("SELECT count(DISTINCT group_id) AS n FROM rollouts").to_pylist()
    assert rows == [{"n": 4}]
    assert not bad.exists() and (buf / "quarantine" / bad.name).exists()
    reason = json.loads((buf / "quarantine" / f"{bad.name}.reason.json").read_text())
    assert reason["file"] == bad.name and "unreadable in SQL" in reason["reason"]
    q = BufferSQL(buf).query("SELECT file, reason FROM quarantined").to_pylist()
    assert [r["file"] for r in q] == [bad.name]


@pytest.mark.parametrize("damage", [_truncate, _garbage])
def test_pull_quarantines_at_index_time_and_goes_on(buf, damage):
    w, ids = _fill(buf, 6)
    damage(w.shards_written[0])
    with Sampler(buf) as s:
        b = s.pull(4, trainer_version=0, trainer_step=1, max_staleness=None)
        assert b.group_ids == ids[2:]
        assert [n for n, _ in s.index.quarantined_now] == [w.shards_written[0].name]


def test_damaged_data_page_is_caught_by_checksum_on_pull(buf):
    w, ids = _fill(buf, 4, tokens=256)
    p = w.shards_written[0]
    with Sampler(buf) as s:  # indexed while intact
        data = bytearray(p.read_bytes())
        meta = pq.read_metadata(p)
        col = [meta.row_group(0).column(i) for i in range(meta.row_group(0).num_columns)
               if meta.row_group(0).column(i).path_in_schema == "completion_ids.list.element"][0]
        off = col.data_page_offset + 40
        data[off: off + 64] = bytes(64)
        p.write_bytes(bytes(data))
        b = s.pull(2, trainer_version=0, trainer_step=1, max_staleness=None)
        assert b.group_ids == ids[2:]  # the damaged shard's groups are unavailable, not trained on
        c = s.counts(0, None)
        assert c["unavailable"] == 2 and c["consumed"] == 2
    assert (buf / "quarantine" / p.name).exists()


def test_partial_group_shard_is_quarantined(buf):
    w, ids = _fill(buf, 2, flush_groups=1)
    p = w.shards_written[0]
    t = pq.read_table(p)
    pq.write_table(t.slice(0, 3), p)  # 3 of the group's 4 rows: an impossible, partial group
    idx = GroupIndex(buf)
    assert idx.group_ids == [ids[1]]
    assert "partial group" in idx.quarantined_now[0][1]


def test_verify_finds_page_damage_that_footers_hide(buf):
    w, ids = _fill(buf, 4, tokens=256)
    p = w.shards_written[1]
    data = bytearray(p.read_bytes())
    meta = pq.read_metadata(p)
    rg = meta.row_group(0)
    col = [rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema == "behavior_logprobs.list.element"][0]
    data[col.data_page_offset + 40: col.data_page_offset + 104] = bytes(64)
    p.write_bytes(bytes(data))
    assert list(verify(buf)) == [p.name]
    assert (buf / "quarantine" / p.name).exists()
    assert verify(buf) == {}


def test_index_follows_compaction_and_keeps_consumption(buf):
    w, ids = _fill(buf, 8, flush_groups=2)
    with Sampler(buf) as s:
        s.pull(3, trainer_version=0, trainer_step=1, max_staleness=None)
        r = compact(buf, target_groups=100, min_age_s=0.0, grace_s=0.0)
        assert (r.merged_files, r.written_files, r.groups) == (4, 1, 8)
        b = s.pull(5, trainer_version=0, trainer_step=2, max_staleness=None)
        assert b.group_ids == ids[3:]
        assert s.counts(0, None)["consumed"] == 8
    (c,) = [n for n in os.listdir(buf / "shards")]
    assert c.startswith("c-") and pq.read_metadata(buf / "shards" / c).num_row_groups == 1   # 8 groups: one row group (C_ROW_GROUP_GROUPS)
    assert GroupIndex(buf).counts(0, None)["consumed"] == 8



def test_a_damaged_page_found_while_merging_aborts_the_merge_and_quarantines_only_that_shard(buf, monkeypatch):
    """A shard whose footer reads but whose data page is damaged: compaction reads it row group by row
    group, meets the damage part-way through writing the c-file, quarantines that shard, and leaves no
    c-file and no temp file; the next pass merges the others, every group once."""
    w, ids = _fill(buf, 8, flush_groups=2, tokens=64)
    bad = w.shards_written[2]
    lost = set(pq.read_table(bad).column("group_id").to_pylist())
    data = bytearray(bad.read_bytes())
    meta = pq.read_metadata(bad)
    start = meta.row_group(0).column(0).data_page_offset
    for i in range(start + 20, start + 60):       # inside the first column's data page; the footer is intact
        data[i] ^= 0xFF
    bad.write_bytes(bytes(data))
    pq.read_metadata(bad)
    monkeypatch.setattr("buffer.compaction.C_ROW_GROUP_GROUPS", 1)   # the c-file is open when the damage is met
    r = compact(buf, target_groups=64, min_age_s=0.0, grace_s=0.0)
    assert r.written_files == 0 and r.groups == 0
    assert not bad.exists() and (buf / "quarantine" / bad.name).exists()
    reason = json.loads((buf / "quarantine" / f"{bad.name}.reason.json").read_text())
    assert "unreadable during compaction" in reason["reason"]
    assert list((buf / "tmp").iterdir()) == [] and not list((buf / "shards").glob("c-*"))
    r = compact(buf, target_groups=64, min_age_s=0.0, grace_s=0.0)
    assert r.written_files == 1 and r.groups == 6
    got = BufferSQL(buf).query("SELECT group_id, count(*) AS n FROM rollouts GROUP BY 1").to_pylist()
    assert {g["group_id"] for g in got} == set(ids) - lost and len(lost) == 2
    assert all(g["n"] == 4 for g in got)
