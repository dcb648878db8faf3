"""A listing that raced a writer's renames must not cost the index a shard.

A directory listing is no snapshot: while two shards of one writer are renamed into place it
can return the later and miss the earlier. The index's per-writer watermark (the highest
sequence a complete refresh read) then covered the missed shard's groups, and the next
refresh took them for groups it had dropped: never indexed, never pulled, expired. The
synthetic soak lost a 32-group shard so, once in 100,000 steps. Here the race is made
certain by handing the index such a listing once.
"""

from __future__ import annotations

import numpy as np

from buffer import GroupIndex, Sampler, ShardWriter
from buffer.index import ELIGIBLE
from conftest import make_group


def _write(buf, first: int, n: int) -> list[str]:
    """n trainable groups (rewards 1, 0) at version 0, shards of 2 groups; their ids."""
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:
        return [w.append(make_group(0, [1, 0], prompt_id=f"p{i}", seed=i)) for i in range(first, first + n)]


def _mark(idx: GroupIndex, writer: int) -> int:
    """The index's watermark for a writer number (-1: none)."""
    return int(idx._upto[writer]) if writer < len(idx._upto) else -1


def _racing_listing(idx: GroupIndex, hide: set[str]) -> list[list[str]]:
    """Make the index's first listing miss `hide`; the listings it takes, in order."""
    real = idx.dir.live_shard_names
    calls: list[list[str]] = []

    def listing() -> list[str]:
        names = real()
        if not calls:
            names = [n for n in names if n not in hide]
        calls.append(names)
        return names

    idx.dir.live_shard_names = listing
    return calls


def test_a_shard_missed_by_a_listing_is_indexed_by_the_next(buf):
    first = _write(buf, 0, 2)
    idx = GroupIndex(buf, retire=True)
    assert sorted(idx.group_ids) == sorted(first)
    # a second writer process: its shards w000001-000000 (groups 0, 1) and -000001 (2, 3)
    later = _write(buf, 2, 4)
    missed = later[0].rsplit("-", 1)[0] + "-000000.parquet"
    calls = _racing_listing(idx, {missed})
    idx.refresh()
    assert missed not in calls[0] and missed in calls[1] and len(calls) == 2   # one more listing
    assert idx.relists == 1
    assert sorted(idx.group_ids) == sorted(first + later)
    assert (idx.states(0, 0) == ELIGIBLE).all()
    assert [_mark(idx, 0), _mark(idx, 1)] == [1, 3]


def test_a_pull_after_a_racing_listing_takes_every_group(buf):
    """A new writer's shards 0 and 1 land while the listing runs, which sees only shard 1. Before
    the fix the watermark went to its group 3, and shard 0's groups (0, 1) were never pulled."""
    ids = _write(buf, 0, 4)                      # shards 0, 1 of writer w000000
    with Sampler(buf) as s:
        with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:   # writer w000001: a new process
            more = [w.append(make_group(0, [1, 0], prompt_id=f"q{i}", seed=10 + i)) for i in range(4)]
        calls = _racing_listing(s.index, {"w000001-000000.parquet"})
        batch = s.pull(8, trainer_version=0, trainer_step=1, max_staleness=0)
        assert batch is not None and sorted(batch.group_ids) == sorted(ids + more)
        assert len(calls) == 2


def test_a_real_hole_lets_the_watermark_pass_after_one_more_listing(buf):
    """A shard gone for good (lost, or quarantined by another process) leaves a gap that two
    listings in a row show: the watermark passes it, and later refreshes list once."""
    first = _write(buf, 0, 2)
    idx = GroupIndex(buf, retire=True)
    later = _write(buf, 2, 6)                    # writer w000001: shards 000000, 000001, 000002
    (buf / "shards" / "w000001-000001.parquet").unlink()   # groups 2, 3 of w000001: lost
    calls = _racing_listing(idx, set())
    idx.refresh()
    assert len(calls) == 2                       # the gap at sequence 2, shown twice: a hole
    assert [_mark(idx, 0), _mark(idx, 1)] == [1, 5]
    assert sorted(idx.group_ids) == sorted(first + later[:2] + later[4:])
    calls.clear()
    _write(buf, 8, 2)                            # writer w000002 runs on from 0: no gap
    idx.refresh()
    assert len(calls) == 1


def test_listings_that_keep_racing_set_no_watermark(buf, monkeypatch):
    """If every listing shows a new gap, the refresh gives up after RELISTS more listings and sets
    no watermark (what it dropped is remembered by key), rather than step over a shard."""
    _write(buf, 0, 2)
    idx = GroupIndex(buf, retire=True)
    _write(buf, 2, 2)
    gaps = iter(range(100))
    monkeypatch.setattr(GroupIndex, "_gaps", lambda self: {1: next(gaps)})
    calls = _racing_listing(idx, set())
    idx.refresh()
    assert len(calls) == 1 + GroupIndex.RELISTS
    assert [_mark(idx, 0), _mark(idx, 1)] == [1, -1]   # writer 1's groups held, but no watermark for them
    assert len(idx.group_ids) == 4 and np.all(idx.states(0, 0) == ELIGIBLE)
