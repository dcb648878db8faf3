"""A daemon's index follows a c-file from its footer when it has read every one of its sources.

A level merge late in a long run rewrites most of the buffer into one file; reading it
again in every daemon's index (the generators' and the trainer's) cost seconds and
hundreds of MiB there, though the index had seen each of its groups already. The oracle
here is a cold index that reads every file (retire=False holds every group where it is).
"""

from __future__ import annotations

import numpy as np
import pytest

import buffer.compaction
import buffer.index
from buffer import BufferDir, BufferSQL, GroupIndex, Sampler, ShardWriter, compact
from buffer.fileset import read_sources
from conftest import make_group
from test_compaction_sets import NOW


def _write(buf, first: int, n: int) -> list[str]:
    """n groups of 2 or 3 completions (so groups start mid row group), every 5th filtered; shards of
    5 groups in row groups of 2."""
    with ShardWriter(buf, flush_groups=5, flush_seconds=None, row_group_groups=2) as w:
        return [w.append(make_group(0, [1, 1, 1][: 2 + i % 2] if i % 5 == 0 else [1, 0, 1][: 2 + i % 2],
                                    prompt_id=f"p{i}", seed=i)) for i in range(first, first + n)]


def _held(idx: GroupIndex) -> dict[str, tuple]:
    """Group id -> (file name, row group, first row, available, uses) of every group the index holds."""
    return {g: (idx.files[idx.file_idx.view[i]].name, int(idx.row_group.view[i]), int(idx.row_start.view[i]),
                bool(idx.available.view[i]), int(idx.use_count.view[i]))
            for i, g in enumerate(idx.group_ids)}


def _agrees_with_a_cold_index(buf, idx: GroupIndex) -> None:
    cold = GroupIndex(buf, retire=False, quarantine=False)
    truth = _held(cold)
    held = _held(idx)
    assert held and {g: truth[g] for g in held} == held
    assert idx.counts(0, None) == cold.counts(0, None)


@pytest.fixture
def plans(monkeypatch):
    """(index, c-file rows, rows of it the index read, or None where it read the whole file) for every
    c-file an index met."""
    calls = []
    orig = GroupIndex._merge_plan

    def spy(self, meta, rg_rows):
        plan = orig(self, meta, rg_rows)
        if read_sources(meta):
            calls.append((self, int(rg_rows[-1]), None if plan is None else int(np.diff(rg_rows)[plan.read].sum())))
        return plan

    monkeypatch.setattr(GroupIndex, "_merge_plan", spy)
    monkeypatch.setattr(buffer.compaction, "C_ROW_GROUP_GROUPS", 4)   # base merges keep several row groups
    return calls


@pytest.mark.parametrize("retire", [False, True])
def test_base_and_level_merges_are_followed_from_their_footers_and_pulls_read_the_same_rows(
        buf, plans, monkeypatch, retire):
    monkeypatch.setattr(GroupIndex, "DROP_AT", 1)      # retire=True: drop dead groups at once
    ids = _write(buf, 0, 60)
    before = BufferSQL(buf).query("SELECT * FROM rollouts ORDER BY traj_id")
    idx = GroupIndex(buf, retire=retire)
    pulled = []
    with Sampler(buf) as s:
        pulled += s.pull(8, trainer_version=0, trainer_step=1, max_staleness=None).group_ids
        idx.refresh()                                   # the ledger's 8 uses
        for step in range(2, 6):
            compact(buf, target_groups=10, fanout=2, **NOW)
            idx.refresh()
            _agrees_with_a_cold_index(buf, idx)
            pulled += s.pull(4, trainer_version=0, trainer_step=step, max_staleness=None).group_ids
        # 12 shards -> 6 c-files of 10 groups (25 rows) -> 3 of 20 -> 1 of 40 and 1 of 20 left: each one's
        # held groups moved by its footer, not a row read (the sampler's index likewise)
        mine = [(rows, read) for who, rows, read in plans if who is idx]
        assert mine == [(25, 0)] * 6 + [(50, 0)] * 3 + [(100, 0)]
        assert mine == [(rows, read) for who, rows, read in plans if who is s.index]
        idx.refresh()
        _agrees_with_a_cold_index(buf, idx)
        while True:                                     # the rest, from the merged files' computed rows
            batch = s.pull(3, trainer_version=0, trainer_step=step + 1, max_staleness=None)
            if batch is None:
                break
            pulled += batch.group_ids
            step += 1
    assert sorted(pulled) == sorted(g for i, g in enumerate(ids) if i % 5)   # each trainable group once
    assert not list(BufferDir(buf).quarantine_dir.iterdir())                 # no row read under a wrong id
    rows = BufferSQL(buf).query("SELECT * FROM rollouts ORDER BY traj_id")
    assert rows.drop(["created_at"]).to_pylist() == before.drop(["created_at"]).to_pylist()


def test_a_c_file_with_a_source_the_index_has_not_read_is_read(buf, plans):
    _write(buf, 0, 20)
    idx = GroupIndex(buf)
    _write(buf, 20, 10)                                 # two shards the index has not listed
    compact(buf, target_groups=100, **NOW)              # one c-file of all six
    idx.refresh()
    # 75 rows, 28 read: the new shards' 25 and the rest of the row group (of 4 groups or more) they share
    assert [(rows, read) for who, rows, read in plans if who is idx] == [(75, 28)]
    assert len(idx) == 30
    _agrees_with_a_cold_index(buf, idx)


def test_a_footer_that_disagrees_with_what_the_index_read_is_not_trusted(buf, plans, monkeypatch):
    _write(buf, 0, 20)
    idx = GroupIndex(buf)
    compact(buf, target_groups=100, **NOW)
    real = buffer.index.read_sources
    monkeypatch.setattr(buffer.index, "read_sources",
                        lambda meta: [(name, rows + 1) for name, rows in real(meta)])   # one row too many each
    idx.refresh()
    assert [read for who, _, read in plans if who is idx] == [None]
    _agrees_with_a_cold_index(buf, idx)
