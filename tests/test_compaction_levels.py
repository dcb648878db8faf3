"""Level merges of rollout shards, and the ledger's footer summary that `status` reads instead of records.

A run of days makes millions of groups: with c-files of `target_groups` each,
SQL and `status` would pay for hundreds of files and thousands of small row
groups. Level merges (buffer.compaction: `fanout` c-files of one level become
one of the next, up to `max_groups`) keep few large files; merged ledger files
carry their record counts per (group version, use index), so `status` reads
their footers only.
"""

from __future__ import annotations

import json
import os
import time

import pyarrow.parquet as pq
from buffer import BufferDir, BufferSQL, GroupIndex, Sampler, compact, compact_ledger, merge_levels
from buffer.fileset import LEDGER_SUMMARY, SHARD_SUMMARY, SUMMARY_KEY, pack_columns, read_summary, summary_columns
from pipeline.status import buffer_status
from test_compaction_sets import NOW, _consumed, _fill, _pull_steps

LEVELS = dict(target_groups=20, fanout=2, max_groups=80, **NOW)


def _live(buf) -> dict[str, int]:
    """Live shard name -> groups (from the footer count every writer and merge puts there)."""
    d = BufferDir(buf)
    return {p.name: int(pq.read_metadata(p).metadata[b"asyncgrpo.groups"]) for p in d.live_shards()}


def test_level_merges_rewrite_c_files_into_fewer_larger_ones_while_a_trainer_pulls_each_group_once(buf):
    ids = _fill(buf, 160, flush_groups=10)                     # 16 shards of 10 groups
    pulled = []
    with Sampler(buf) as s:
        def pull(step):
            pulled.extend(s.pull(5, trainer_version=0, trainer_step=step, max_staleness=None).group_ids)

        pull(1)
        sizes = []
        for step in range(2, 6):
            compact(buf, **LEVELS)
            sizes.append(sorted(_live(buf).values()))
            pull(step)
        # base: 16 shards -> 8 c-files of 20; levels of 10 * 2^(k-1) groups: 20 -> 4 of 40 -> 2 of 80;
        # level 3 would make 160 > max_groups: stays
        assert sizes == [[20] * 8, [40] * 4, [80] * 2, [80] * 2]
        step = 6
        while len(pulled) < len(ids):
            pull(step)
            step += 1
    assert sorted(pulled) == sorted(ids)                       # every group exactly once, across three rewrites
    consumed = _consumed(buf)
    assert len(consumed) == 160 and len({g for g, _ in consumed}) == 160
    sql = BufferSQL(buf).query("SELECT count(*) AS n, count(DISTINCT group_id) AS g FROM rollouts").to_pylist()
    assert sql == [{"n": 160 * 4, "g": 160}]
    assert GroupIndex(buf).counts(0, None)["consumed"] == 160


def test_level_merged_files_have_large_row_groups_and_a_base_merge_keeps_small_ones(buf):
    _fill(buf, 160, flush_groups=10)
    compact(buf, **LEVELS)
    base = [pq.read_metadata(p) for p in BufferDir(buf).live_shards()]
    # base merges cut row groups at C_ROW_GROUP_GROUPS (256) groups: 20 groups stay one row group each
    assert [m.num_row_groups for m in base] == [1] * 8
    compact(buf, **LEVELS)
    compact(buf, **LEVELS)
    merged = [pq.read_metadata(p) for p in BufferDir(buf).live_shards()]
    # 80 groups of 4 rows: far below LEVEL_ROW_GROUP_BYTES, so one row group per file
    assert [(m.num_rows, m.num_row_groups) for m in merged] == [(320, 1), (320, 1)]
    summary = [read_summary(m) for m in merged]
    assert [s["rows"] for s in summary] == [320, 320]
    cells = [summary_columns(s, SHARD_SUMMARY) for s in summary]
    assert sum(int(c["groups"].sum()) for c in cells) == 160         # groups per (version, reason) add up
    assert [int(c["completions"].sum()) for c in cells] == [320, 320]


def _row_group_rows(buf) -> list[list[int]]:
    """Rows of each row group of each live shard, in name order."""
    metas = [pq.read_metadata(p) for p in sorted(BufferDir(buf).live_shards())]
    return [[m.row_group(i).num_rows for i in range(m.num_row_groups)] for m in metas]


def test_level_row_groups_grow_with_the_merge_up_to_a_byte_cap(buf, monkeypatch):
    """A level merge's row groups hold at least 1/LEVEL_ROW_GROUPS of its groups (so a level file's
    footer stops growing with the run), cut early at LEVEL_ROW_GROUP_MAX_BYTES; whole groups each."""
    import buffer.compaction as compaction

    monkeypatch.setattr(compaction, "C_ROW_GROUP_GROUPS", 1)       # base merges keep the shards' row groups
    monkeypatch.setattr(compaction, "LEVEL_ROW_GROUP_BYTES", 0)
    monkeypatch.setattr(compaction, "LEVEL_ROW_GROUPS", 2)
    _fill(buf, 160, flush_groups=10)                                # 16 shards of one row group of 10 groups
    compact(buf, **LEVELS)
    assert _row_group_rows(buf) == [[40, 40]] * 8                    # base: 20 groups of 4 rows, as written
    compact(buf, **LEVELS)
    assert _row_group_rows(buf) == [[80, 80]] * 4                    # 40 groups: row groups of >= 20 groups
    compact(buf, **LEVELS)
    assert _row_group_rows(buf) == [[160, 160]] * 2                  # 80 groups: >= 40 groups
    monkeypatch.setattr(compaction, "LEVEL_ROW_GROUP_MAX_BYTES", 1)  # the cap: cut after every source row group
    _fill(buf, 160, flush_groups=10)                                # 160 more: 8 c-files of 20, then 4 of 40
    for _ in range(2):
        compact(buf, **LEVELS)
    assert sorted(_row_group_rows(buf)) == [[40] * 4] * 4 + [[160, 160]] * 2
    assert BufferSQL(buf).query("SELECT count(DISTINCT group_id) AS g FROM rollouts").to_pylist() == [{"g": 320}]


def test_no_level_merges_without_fanout(buf):
    _fill(buf, 160, flush_groups=10)
    for _ in range(3):
        compact(buf, target_groups=20, **NOW)
    assert sorted(_live(buf).values()) == [20] * 8


def test_merged_ledger_footer_counts_records_per_version_and_use_and_status_reads_it(buf):
    _fill(buf, 200, versions=[i // 50 for i in range(200)])   # versions 0..3, 50 groups each
    with Sampler(buf, reuse=2) as s:
        for step in range(1, 61):   # 300 pulls: every group once (use_index 0), then 100 of them again (1)
            s.pull(5, trainer_version=3, trainer_step=step, max_staleness=None)
    compact_ledger(buf, **NOW)
    (name,) = BufferDir(buf).ledger_shard_names()
    meta = pq.read_metadata(BufferDir(buf).ledger / name)
    summary = json.loads(meta.metadata[SUMMARY_KEY])
    rows = BufferSQL(buf).query("SELECT group_version AS v, use_index AS u, count(*) AS n FROM consumed "
                                "GROUP BY 1, 2 ORDER BY 1, 2").to_pylist()
    cells = summary_columns(summary, LEDGER_SUMMARY)
    assert summary["rows"] == 300
    assert [list(c) for c in zip(*(cells[k].tolist() for k in LEDGER_SUMMARY))] == [[r["v"], r["u"], r["n"]]
                                                                                   for r in rows]
    for reuse in (1, 2):
        fast = buffer_status(buf, trainer_version=3, reuse=reuse, max_ranges=None)
        careful = GroupIndex(buf).counts(3, None, reuse)
        assert fast["consumed"] == careful["consumed"] == (100 if reuse == 2 else 200)
        assert {k: fast[k] for k in careful} == careful


def test_status_scans_a_resume_cut_ledger_file_which_has_no_summary(buf):
    _fill(buf, 200)
    first = _pull_steps(buf, 20)
    compact_ledger(buf, **NOW)
    _pull_steps(buf, 8, first_step=13, as_of_step=12)          # cuts the merged file at step 12
    d = BufferDir(buf)
    cut = d.ledger_shard_names()[0]
    assert read_summary(pq.read_metadata(d.ledger / cut)) is None
    assert buffer_status(buf)["consumed"] == 100 == GroupIndex(buf).counts(0, None)["consumed"]
    assert len(first) == 20


def test_a_summary_that_does_not_add_up_is_not_trusted(buf):
    """A merged ledger file whose footer summary disagrees with its rows is scanned instead."""
    from buffer.compaction import compact_small

    _fill(buf, 100)
    _pull_steps(buf, 10)

    def wrong(t):   # one record too many in the first cell
        import pyarrow as pa

        agg = pa.table({"group_version": [0], "use_index": [0], "records": [t.num_rows + 1]})
        return {"rows": t.num_rows, "columns": pack_columns(agg)}

    compact_small(BufferDir(buf).ledger_set, target_rows=1000, summary=wrong, **NOW)
    assert buffer_status(buf)["consumed"] == 50


def test_base_merges_go_live_before_the_level_merges_are_written(buf, monkeypatch):
    """One pass swaps its base merges in first: young shards do not stay live while a level merge runs."""
    import buffer.compaction as compaction
    from buffer import ShardWriter
    from conftest import make_group

    _fill(buf, 160, flush_groups=10)
    compact(buf, **LEVELS)                                     # 8 c-files of 20: level merges next pass
    with ShardWriter(buf, flush_groups=10, flush_seconds=None) as w:
        for i in range(20):                                    # 2 young shards: a base merge next pass
            w.append(make_group(0, [1, 0, 0, 1], prompt_id=f"new{i}", seed=1000 + i, correct=[1, 0, 0, 1]))
    young = {n for n in BufferDir(buf).live_shard_names() if not n.startswith("c-")}
    assert len(young) == 2
    seen = []
    merge = compaction._merge_shards

    def spy(d, batch, out_name, **rg):
        if rg:                                                 # a level merge: what is live while it is written
            seen.append(set(BufferDir(buf).live_shard_names()))
        return merge(d, batch, out_name, **rg)

    monkeypatch.setattr(compaction, "_merge_shards", spy)
    compact(buf, **LEVELS)
    assert len(seen) == 4 and all(not (young & live) for live in seen)
    assert sorted(_live(buf).values()) == [20] + [40] * 4


def test_without_max_groups_levels_go_on_so_the_c_file_count_grows_with_the_log_of_the_groups(buf):
    # the daemon's default without retention: no group limit, only bytes; 320 groups in files of 10
    _fill(buf, 320, flush_groups=10)
    sizes = []
    for _ in range(6):
        compact(buf, target_groups=20, fanout=2, max_groups=None, max_bytes=None, **NOW)
        sizes.append(sorted(_live(buf).values()))
    # 32 shards -> 16 of 20 -> 8 of 40 -> 4 of 80 -> 2 of 160 -> 1 of 320, then nothing left to merge
    assert sizes == [[20] * 16, [40] * 8, [80] * 4, [160] * 2, [320], [320]]
    assert BufferSQL(buf).query("SELECT count(DISTINCT group_id) AS g FROM rollouts").to_pylist() == [{"g": 320}]


def test_max_bytes_stops_a_level_merge_whose_sources_are_too_large(buf):
    _fill(buf, 160, flush_groups=10)
    compact(buf, target_groups=20, fanout=2, max_groups=None, **NOW)
    c_files = BufferDir(buf).live_shards()
    sizes = sorted(p.stat().st_size for p in c_files)
    compact(buf, target_groups=20, fanout=2, max_groups=None, max_bytes=2 * sizes[0] - 1, **NOW)
    assert sorted(_live(buf).values()) == [20] * 8                 # every pair is over: none merged
    compact(buf, target_groups=20, fanout=2, max_groups=None, max_bytes=sizes[-1] + sizes[-2], **NOW)
    assert sorted(_live(buf).values()) == [40] * 4


def test_a_merge_sums_its_summary_in_chunks_to_the_same_cells(buf, monkeypatch):
    import buffer.compaction as compaction

    def merged_summary(root):
        _fill(root, 120, filtered_every=3, versions=[i // 7 for i in range(120)])
        compact(root, target_groups=200, **NOW)
        (c,) = BufferDir(root).live_shards()
        return summary_columns(read_summary(pq.read_metadata(c)), SHARD_SUMMARY)

    whole = merged_summary(buf / "a")
    monkeypatch.setattr(compaction, "SUMMARY_CHUNK_GROUPS", 25)    # 120 groups: 5 chunks, cells across them
    chunked = merged_summary(buf / "b")
    assert {k: v.tolist() for k, v in chunked.items()} == {k: v.tolist() for k, v in whole.items()}
    assert len(whole["version"]) == 18 + 17                       # versions 0..17, each filtered and not
    assert int(whole["groups"].sum()) == 120 and int(whole["completions"].sum()) == 480
    assert float(whole["reward_sum"].sum()) == 40 * 4 + 80 * 2     # all-ones groups and [1, 0, 0, 1] ones


def _young(buf, tag: str, n: int = 20) -> None:
    """n new groups in shards of 10: a base merge's work."""
    from buffer import ShardWriter
    from conftest import make_group

    with ShardWriter(buf, flush_groups=10, flush_seconds=None) as w:
        for i in range(n):
            w.append(make_group(0, [1, 0, 0, 1], prompt_id=f"{tag}{i}", seed=hash(tag) % 1000 + i, correct=[1, 0, 0, 1]))


def _on_disk(buf) -> list[str]:
    return sorted(n for n in os.listdir(BufferDir(buf).shards) if n.endswith(".parquet"))


def test_deferred_level_merges_go_live_one_by_one_while_base_merges_and_pulls_run_beside_them(buf):
    """compact(defer_levels=True) plans the level merges; merge_levels writes them without the buffer's
    lock, so a base merge and a trainer's pulls go on while one is written, and each swaps in alone."""
    ids = _fill(buf, 160, flush_groups=10)
    compact(buf, **LEVELS)                                     # 8 c-files of 20: level material
    _young(buf, "a")                                           # 2 young shards
    r = compact(buf, defer_levels=True, **LEVELS)
    assert [[n for _, n in batch] for batch in r.levels] == [[20, 20]] * 4
    assert sorted(_live(buf).values()) == [20] * 9             # the young ones merged; no level merge yet
    assert (r.merged_files, r.written_files) == (2, 1)
    pulled, asked, live_seen = [], [], []
    with Sampler(buf) as s:
        def pull(step):
            pulled.extend(s.pull(5, trainer_version=0, trainer_step=step, max_staleness=None).group_ids)

        def beside() -> bool:                                  # asked before each merge and source row group
            asked.append(1)
            live_seen.append(sorted(_live(buf).values()))
            if len(asked) == 2:                                # the first merge's temp file open
                with BufferDir(buf).lock.acquire(timeout=5):   # not held while a level merge is written
                    pass
                _young(buf, "b")
                assert compact(buf, defer_levels=True, **LEVELS).written_files == 1   # a base merge, meanwhile
                pull(len(asked))
            return False

        m = merge_levels(buf, r.levels, stop=beside)
        assert (m.merged_files, m.written_files, m.groups, m.abandoned) == (8, 4, 160, 0)
        step = 100
        while len(pulled) < 200:
            pull(step)
            step += 1
    assert len(asked) == 4 + 8                                 # 4 merges of 2 sources of one row group each
    # each level file went live in its own swap, before the next merge
    assert [len(v) for v in live_seen] == [9, 9, 10, 9, 9, 9, 8, 8, 8, 7, 7, 7]
    assert sorted(_live(buf).values()) == [20, 20] + [40] * 4
    (gen,) = {n.split("-")[1] for n in _on_disk(buf) if "-L" in n}   # the generation when the merges began
    assert [n for n in _on_disk(buf) if "-L" in n] == [f"c-{gen}-L{i:03d}.parquet" for i in range(4)]
    assert set(ids) <= set(pulled)
    assert len(pulled) == len(set(pulled)) == 200               # every group once: 160 + 20 + 20
    sql = BufferSQL(buf).query("SELECT count(*) AS n, count(DISTINCT group_id) AS g FROM rollouts").to_pylist()
    assert sql == [{"n": 200 * 4, "g": 200}]
    assert GroupIndex(buf).counts(0, None)["consumed"] == 200


def test_a_deferred_level_merge_whose_sources_left_meanwhile_is_dropped_before_it_is_visible(buf):
    _fill(buf, 160, flush_groups=10)
    compact(buf, **LEVELS)
    planned = compact(buf, defer_levels=True, **LEVELS).levels
    assert len(planned) == 4
    asked = []

    def other_pass() -> bool:
        asked.append(1)
        if len(asked) == 1:
            compact(buf, **LEVELS)                             # another pass merges the same sources first
        return False

    m = merge_levels(buf, planned, stop=other_pass)
    assert (m.merged_files, m.written_files, m.abandoned) == (0, 0, 4)
    assert sorted(_live(buf).values()) == [40] * 4
    assert not [n for n in _on_disk(buf) if "-L" in n]         # nothing of the dropped merges left
    assert os.listdir(BufferDir(buf).tmp) == []
    sql = BufferSQL(buf).query("SELECT count(*) AS n, count(DISTINCT group_id) AS g FROM rollouts").to_pylist()
    assert sql == [{"n": 640, "g": 160}]


def test_stopping_drops_the_level_merge_in_progress_and_a_later_call_does_them_all(buf):
    _fill(buf, 160, flush_groups=10)
    compact(buf, **LEVELS)
    planned = compact(buf, defer_levels=True, **LEVELS).levels
    asked = []
    m = merge_levels(buf, planned, stop=lambda: asked.append(1) or len(asked) >= 5)   # in the 2nd merge
    assert (m.merged_files, m.written_files, m.abandoned) == (2, 1, 1)
    assert sorted(_live(buf).values()) == [20] * 6 + [40]
    assert len(_on_disk(buf)) == 8 + 1 and os.listdir(BufferDir(buf).tmp) == []   # the replaced two stay: grace
    m = merge_levels(buf, compact(buf, defer_levels=True, **LEVELS).levels)
    assert (m.merged_files, m.written_files, m.abandoned) == (6, 3, 0)
    assert sorted(_live(buf).values()) == [40] * 4
    assert BufferSQL(buf).query("SELECT count(DISTINCT group_id) AS g FROM rollouts").to_pylist() == [{"g": 160}]


def _sizes_now(buf) -> list[int] | None:
    """Groups of each live shard, sorted, while the compactor runs; None when a listed shard was merged
    and deleted before its footer was read (grace_s=0 gives readers no grace): the caller looks again."""
    try:
        return sorted(_live(buf).values())
    except FileNotFoundError:
        return None


def test_the_compactor_daemon_writes_level_merges_on_its_thread(tmp_path):
    """run_compactor (local run): passes plan the levels, its LevelMerges thread writes them."""
    import threading

    from workers.compactor import CompactorConfig, run_compactor
    from workers.stop import StopFlag

    run_dir = tmp_path / "run"
    ids = _fill(run_dir / "buffer", 160, flush_groups=10)
    cfg = CompactorConfig(every_s=0.1, min_age_s=0.0, grace_s=0.0, target_groups=20, fanout=2, max_groups=80)
    out = {}
    with StopFlag() as stop:
        t = threading.Thread(target=lambda: out.update(run_compactor(run_dir, cfg, stop)))
        t.start()
        deadline = time.time() + 60
        while _sizes_now(run_dir / "buffer") != [80, 80] and time.time() < deadline:
            time.sleep(0.05)
        stop.set()
        t.join(60)
    assert not t.is_alive()
    assert sorted(_live(run_dir / "buffer").values()) == [80, 80]
    assert all("-L" in n for n in BufferDir(run_dir / "buffer").live_shard_names())
    assert out["level_merges"] >= 2 and out["groups"] >= 160 + 160 + 160   # base, then two levels
    got = BufferSQL(run_dir).query("SELECT count(*) AS n, count(DISTINCT group_id) AS g FROM rollouts").to_pylist()
    assert got == [{"n": 640, "g": 160}] and len(ids) == 160


def test_a_level_merge_waits_while_a_pass_runs_then_goes_on_and_a_stop_ends_the_wait(buf):
    """LevelMerges.yielding (around each of the daemon's passes): the level merge in progress pauses at its
    next row group, holding no lock, so the daemon takes one core; it completes once the pass ends, and a
    stop while it waits drops it."""
    import threading

    from workers.compactor import LevelMerges
    from workers.stop import StopFlag

    _fill(buf, 160, flush_groups=10)
    compact(buf, **LEVELS)
    with StopFlag() as stop:
        levels = LevelMerges(buf.parent, stop)
        asked, stopping = threading.Event(), levels._stopping
        levels._stopping = lambda: asked.set() or stopping()    # the thread has reached its first check
        with levels.yielding():
            levels.start(compact(buf, defer_levels=True, **LEVELS).levels)
            assert asked.wait(60)
            time.sleep(1.0)                                      # so it pauses at least this long
            assert levels.busy() and sorted(_live(buf).values()) == [20] * 8
            assert not [n for n in _on_disk(buf) if "-L" in n]
            with BufferDir(buf).lock:    # the paused merge holds no lock: a pass could take it
                pass
        levels.join()
        assert sorted(_live(buf).values()) == [40] * 4
        assert levels.totals["level_merges"] == 1 and levels.totals["abandoned"] == 0
        assert 0.9 <= levels.totals["paused_s"] < 10

        planned = compact(buf, defer_levels=True, **LEVELS).levels    # the 40s into two of 80
        assert len(planned) == 2
        written = levels.totals["written_files"]
        with levels.yielding():
            levels.start(planned)
            time.sleep(0.5)
            stop.set()
            levels.join()
    assert levels.totals["written_files"] == written and os.listdir(BufferDir(buf).tmp) == []
    assert sorted(_live(buf).values()) == [40] * 4 and not levels.busy()
    got = BufferSQL(buf).query("SELECT count(*) AS n, count(DISTINCT group_id) AS g FROM rollouts").to_pylist()
    assert got == [{"n": 640, "g": 160}]
