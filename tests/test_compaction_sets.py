"""Compaction of the ledger, metrics and generator metrics; an index of bounded memory; kill -9 mid-compaction.

Every kind of file a run grows by is merged in the background (workers/compactor.py);
readers must never count a row twice or miss one, the ledger must still give
exactly-once consumption (also after a resume "as of step k" that cuts a merged
ledger file), and a kill -9 at any point of a pass must lose nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from buffer import BufferDir, BufferSQL, GroupIndex, Sampler, ShardWriter, compact, compact_ledger, compact_small
from buffer.layout import ledger_range, run_file_set
from conftest import REPO, kill_9_at_pause, make_group
from workers.compactor import CompactorConfig, compact_run, live_files
from workers.generator_stats import GeneratorStats
from workers.trainer.metrics import MetricsWriter

G = 4
NOW = dict(min_age_s=0.0, grace_s=0.0)


def _fill(buf, n, *, filtered_every=None, flush_groups=10, versions=None):
    ids = []
    with ShardWriter(buf, flush_groups=flush_groups, flush_seconds=None) as w:
        for i in range(n):
            rewards = [1] * G if filtered_every and i % filtered_every == 0 else [1, 0, 0, 1]
            v = versions[i] if versions is not None else 0
            ids.append(w.append(make_group(v, rewards, prompt_id=f"p{i}", seed=i, correct=rewards)))
    return ids


def _pull_steps(buf, steps, n=5, *, first_step=1, **kw):
    """Pulls of n groups at steps first_step.. (trainer version 0, no limit); the group ids of each step."""
    out = []
    with Sampler(buf, **kw) as s:
        for step in range(first_step, first_step + steps):
            out.append(s.pull(n, trainer_version=0, trainer_step=step, max_staleness=None).group_ids)
    return out


def _consumed(root) -> list[tuple[str, int]]:
    return [(r["group_id"], r["trainer_step"]) for r in
            BufferSQL(root).query("SELECT group_id, trainer_step FROM consumed ORDER BY trainer_step, group_id")
            .to_pylist()]


def test_merged_ledger_keeps_exactly_once_for_readers_and_a_new_trainer(buf):
    ids = _fill(buf, 200)
    pulled = _pull_steps(buf, 20)
    d = BufferDir(buf)
    assert len(d.ledger_shard_names()) == 20
    observer = GroupIndex(buf)          # read the 20 files before the merge
    assert observer.counts(0, None)["consumed"] == 100
    r = compact_ledger(buf, **NOW)
    assert (r.merged_files, r.written_files, r.groups, r.deleted_files) == (20, 1, 100, 20)
    (name,) = d.ledger_shard_names()
    assert name.startswith("step-000000001-c") and name.endswith("-000000020.parquet")
    assert sorted(os.listdir(d.ledger)) == sorted([name, "abandoned", "manifest.json"])
    observer.refresh()                  # the merged file's sources were read already: nothing new
    assert observer.counts(0, None)["consumed"] == 100
    assert GroupIndex(buf).counts(0, None)["consumed"] == 100
    consumed = _consumed(buf)
    assert len(consumed) == 100 and len({g for g, _ in consumed}) == 100
    assert [g for g, s in consumed if s == 7] == sorted(pulled[6])
    rest = _pull_steps(buf, 20, first_step=21)          # a new trainer: the other 100 groups, none twice
    assert sorted(sum(pulled + rest, [])) == sorted(ids)


def test_a_merged_ledger_of_merged_files_counts_each_record_once(buf):
    _fill(buf, 200)
    _pull_steps(buf, 10)
    compact_ledger(buf, **NOW)
    observer = GroupIndex(buf)
    _pull_steps(buf, 6, first_step=11)
    observer.refresh()                                   # it has read the first merge and 6 new files
    assert observer.counts(0, None)["consumed"] == 80
    _pull_steps(buf, 4, first_step=17)
    r = compact_ledger(buf, **NOW)                       # merged file + 10 new files -> one file
    assert (r.merged_files, r.written_files) == (11, 1)
    observer.refresh()                                   # 4 files' records are new to it, 16 steps' are not
    assert observer.counts(0, None)["consumed"] == 100 == len(_consumed(buf))
    assert GroupIndex(buf).counts(0, None)["consumed"] == 100


def test_resume_as_of_a_step_inside_a_merged_ledger_file_cuts_it_there(buf):
    ids = _fill(buf, 200)
    first = _pull_steps(buf, 20)
    compact_ledger(buf, **NOW)
    again = _pull_steps(buf, 8, first_step=13, as_of_step=12)   # a trainer restored at step 12
    assert again == first[12:20]                           # the same groups, oldest first, exactly once
    d = BufferDir(buf)
    names = d.ledger_shard_names()
    assert names[0].startswith("step-000000001-c") and names[0].endswith("-000000012.parquet")
    assert len(names) == 9 and all(n.startswith("step-0000000") and "-c" not in n for n in names[1:])
    consumed = _consumed(buf)
    assert len(consumed) == 100 and len({g for g, _ in consumed}) == 100
    assert sorted(g for g, s in consumed if s <= 12) == sorted(sum(first[:12], []))
    assert len(os.listdir(d.abandoned)) == 1 and GroupIndex(buf).counts(0, None)["consumed"] == 100
    rest = _pull_steps(buf, 20, first_step=21)
    assert sorted(sum(first[:12] + again + rest, [])) == sorted(ids)


def test_resume_also_abandons_replaced_ledger_files_in_their_grace_period(buf):
    _fill(buf, 100)
    first = _pull_steps(buf, 10)
    compact_ledger(buf, min_age_s=0.0, grace_s=3600.0)     # sources replaced, kept for readers
    d = BufferDir(buf)
    assert len(os.listdir(d.ledger)) == 10 + 1 + 2
    again = _pull_steps(buf, 5, first_step=6, as_of_step=5)
    assert again == first[5:]
    # the new files reuse the step numbers, never a name that is on disk and replaced
    assert len(_consumed(buf)) == 50 and GroupIndex(buf).counts(0, None)["consumed"] == 50


def _metrics(run) -> list[int]:
    return [r["step"] for r in BufferSQL(run).query("SELECT step FROM metrics ORDER BY step").to_pylist()]


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "buffer").mkdir(parents=True)
    return run


def test_metrics_merge_and_a_resume_truncates_across_the_merged_file(run_dir):
    _fill(run_dir / "buffer", 4)
    m = MetricsWriter(run_dir / "metrics", flush_seconds=0.0)
    for step in range(1, 31):
        m.add({"step": step, "loss": 1.0 / step, **({"extra": 1.0} if step > 20 else {})})
    assert len(run_file_set(run_dir / "metrics", "metrics").live_names()) == 30
    r = compact_small(run_file_set(run_dir / "metrics", "metrics"), target_rows=1000, sort_by="step", **NOW)
    assert (r.merged_files, r.written_files, r.groups) == (30, 1, 30)
    assert _metrics(run_dir) == list(range(1, 31))
    assert BufferSQL(run_dir).query("SELECT count(extra) n FROM metrics").to_pylist() == [{"n": 10}]
    m2 = MetricsWriter(run_dir / "metrics", flush_seconds=0.0)   # the trainer restored at step 17
    assert m2.truncate_after(17) == 13
    assert _metrics(run_dir) == list(range(1, 18))
    for step in range(18, 26):
        m2.add({"step": step, "loss": 0.0})
    assert _metrics(run_dir) == list(range(1, 26))


def test_generator_metrics_merge_exactly(run_dir):
    _fill(run_dir / "buffer", 4)
    for w in ("w000000", "w000001"):
        stats = GeneratorStats(run_dir, "gen", w, flush_seconds=0.0)
        for b in range(12):
            stats.add(batch=b, version=0, started_at=time.time(), groups=2)
        stats.close()
    fs = run_file_set(run_dir / "generator_metrics", "generator_metrics")
    assert len(fs.live_names()) == 24
    r = compact_small(fs, target_rows=10, **NOW)
    assert r.written_files == 3 and len(fs.live_names()) == 3
    got = BufferSQL(run_dir).query("SELECT writer_id, count(*) n, sum(groups) g FROM generator_metrics "
                                   "GROUP BY 1 ORDER BY 1").to_pylist()
    assert got == [{"writer_id": "w000000", "n": 12, "g": 24}, {"writer_id": "w000001", "n": 12, "g": 24}]


def test_a_retiring_index_holds_only_what_may_still_be_pulled_and_counts_like_a_full_one(buf, monkeypatch):
    monkeypatch.setattr(GroupIndex, "DROP_AT", 8)
    versions = [i // 10 for i in range(120)]
    _fill(buf, 120, filtered_every=4, versions=versions)
    watcher = GroupIndex(buf, retire=True)
    with Sampler(buf) as s:
        for step in range(1, 13):
            assert s.pull(5, trainer_version=12, trainer_step=step, max_staleness=None) is not None
        s.counts(12, 4)                                   # a refresh: retired rows dropped
        # the 30 filtered dropped on arrival; the consumed ones in one drop, once 45 (half the held) were
        assert s.index.retired == 30 + 45 and len(s.index) == 30 + 15
    watcher.refresh()
    full = GroupIndex(buf)
    for t, limit in ((12, 4), (12, None), (20, 2)):
        assert watcher.counts(t, limit) == full.counts(t, limit)
    assert len(watcher) == 30 and len(full) == 120
    compact(buf, target_groups=1000, **NOW)               # dropped groups move to a c-file: not new again
    watcher.refresh()
    assert len(watcher) == 30 and watcher.counts(12, 4) == GroupIndex(buf).counts(12, 4)
    with Sampler(buf) as s:                               # and a trainer after the merge pulls the rest once
        got = [s.pull(5, trainer_version=12, trainer_step=20 + i, max_staleness=None).group_ids for i in range(6)]
        assert s.pull(1, trainer_version=12, trainer_step=30, max_staleness=None) is None
    assert len(set(sum(got, []))) == 30


def test_a_merge_leaves_a_retiring_index_nothing_to_remember_of_the_groups_it_dropped(buf, monkeypatch):
    """After a merge of shards and ledger files, a retiring index re-reads records of groups it dropped
    long ago; they must change nothing and leave nothing behind (a merged ledger file repeats every record
    of its sources: 201,088 after one pass late in a 60-minute run), while the groups it holds get their
    uses, by either lookup path (a merged file's many ids, one step's few)."""
    monkeypatch.setattr(GroupIndex, "DROP_AT", 4)
    _fill(buf, 100, flush_groups=5)
    watcher = GroupIndex(buf, retire=True)
    assert len(watcher) == 100
    first = _pull_steps(buf, 12)                          # 60 groups consumed, in 12 ledger files
    compact_ledger(buf, **NOW)                            # ... merged into one before the watcher looks
    watcher.refresh()                                     # 60 ids against 100 held: Arrow's lookup
    assert watcher.retired == 60 and len(watcher) == 40  # all 60 counted consumed, then dropped
    assert watcher.counts(0, None) == GroupIndex(buf).counts(0, None)
    second = _pull_steps(buf, 2, first_step=13)           # 10 more, 2 files of 5 ids: dict lookups
    watcher.refresh()
    assert len(watcher) == 40 and [watcher.use_count.view[watcher.id_to_idx[g]] for g in sum(second, [])] == [1] * 10
    compact(buf, target_groups=1000, **NOW)               # every group moves to a c-file
    compact_ledger(buf, **NOW)                            # one file of 70 records, 60 of dropped groups
    watcher.refresh()
    assert watcher._early_uses == {}                      # nothing kept for the dropped ones
    assert watcher.retired == 60 and len(watcher) == 40
    assert watcher.counts(0, None) == GroupIndex(buf).counts(0, None)
    assert watcher.counts(0, None)["consumed"] == 70 and len(set(sum(first + second, []))) == 70
    with Sampler(buf) as s:                               # the 30 never pulled are what is left, once
        rest = s.pull(30, trainer_version=0, trainer_step=15, max_staleness=None).group_ids
        assert s.pull(1, trainer_version=0, trainer_step=16, max_staleness=None) is None
    assert not set(rest) & set(sum(first + second, []))


def test_writer_seqs_parses_like_the_id_format_says():
    """'w<writer>-<sequence>' ids give both numbers; any other id (a user's own) gives -1, -1."""
    from buffer.index import writer_seqs

    ids = ["w000007-00000012", "w1-2", "w0-0", "x1-2", "w-1", "w1-", "w12-34-56", "gen0", "", "w1-2x",
           "w" + "9" * 18 + "-1"]
    w, q = writer_seqs(ids)
    assert list(zip(w.tolist(), q.tolist())) == [(7, 12), (1, 2), (0, 0), (-1, -1), (-1, -1), (-1, -1),
                                                 (-1, -1), (-1, -1), (-1, -1), (-1, -1), (10**18 - 1, 1)]
    w, q = writer_seqs([])
    assert len(w) == len(q) == 0


def _populate(run) -> dict:
    """A run with 20 shards, 10 ledger files, 10 metrics files and 6 generator-metrics files; their counts."""
    _fill(run / "buffer", 40, flush_groups=2)
    _pull_steps(run / "buffer", 10, n=2)
    m = MetricsWriter(run / "metrics", flush_seconds=0.0)
    for step in range(1, 11):
        m.add({"step": step, "loss": 0.5})
    stats = GeneratorStats(run, "gen0", "w000000", flush_seconds=0.0)
    for b in range(6):
        stats.add(batch=b, version=0, started_at=time.time(), groups=1)
    return {"shards": 20, "ledger": 10, "metrics": 10, "generator_metrics": 6}


def _exact(run) -> tuple:
    db = BufferSQL(run)
    q = ("SELECT (SELECT count(*) FROM rollouts), (SELECT count(DISTINCT group_id) FROM rollouts), "
         "(SELECT count(*) FROM consumed), (SELECT count(DISTINCT group_id) FROM consumed), "
         "(SELECT count(*) FROM metrics), (SELECT count(DISTINCT step) FROM metrics), "
         "(SELECT count(*) FROM generator_metrics)")
    return tuple(db.query(q).to_pylist()[0].values())


EXACT = (160, 40, 20, 20, 10, 10, 6)


@pytest.mark.parametrize("point", ["written", "swapped", "deleting"])
@pytest.mark.parametrize("kind", ["shards", "ledger", "metrics", "generator_metrics"])
def test_kill_9_in_the_middle_of_a_compaction_loses_nothing(run_dir, kind, point):
    files = _populate(run_dir)
    assert live_files(run_dir) == files and _exact(run_dir) == EXACT
    marker = run_dir.parent / "paused"
    kill_9_at_pause([sys.executable, str(REPO / "tests" / "helpers" / "compact_pause.py"), str(run_dir), kind, point,
                     str(marker)], marker)
    assert _exact(run_dir) == EXACT                        # readers: every row once, none missing
    live = live_files(run_dir)
    assert live[kind] == (1 if point != "written" else files[kind])
    with Sampler(run_dir / "buffer") as s:                 # the trainer: the 20 consumed groups stay consumed
        assert s.counts(0, None)["consumed"] == 20
    compact_run(run_dir, CompactorConfig(min_age_s=0.0, grace_s=0.0))   # the next pass finishes the work
    assert _exact(run_dir) == EXACT
    assert all(n == 1 for n in live_files(run_dir).values())
    folder = {"shards": run_dir / "buffer" / "shards", "ledger": run_dir / "buffer" / "ledger",
              "metrics": run_dir / "metrics", "generator_metrics": run_dir / "generator_metrics"}[kind]
    on_disk = [n for n in os.listdir(folder) if n.endswith(".parquet")]
    assert len(on_disk) == 1                               # no orphan c-file, no replaced file left
    BufferDir(run_dir / "buffer").clean_tmp()
    assert os.listdir(run_dir / "buffer" / "tmp") == []


@pytest.mark.parametrize("point", ["writing", "written"])
def test_kill_9_in_the_middle_of_a_deferred_level_merge_loses_nothing(run_dir, point):
    """The daemon's level merges (planned by a pass, written without the lock): killed with the temp
    file open, or with the c-file renamed into place but not swapped in."""
    files = _populate(run_dir)
    levels = dict(target_groups=4, fanout=2, max_groups=None, **NOW)
    compact(run_dir / "buffer", **levels)                       # 20 shards of 2 -> 10 c-files of 4
    assert live_files(run_dir)["shards"] == 10 and _exact(run_dir) == EXACT
    marker = run_dir.parent / "paused"
    kill_9_at_pause([sys.executable, str(REPO / "tests" / "helpers" / "compact_pause.py"), str(run_dir), "levels",
                     point, str(marker)], marker)
    shards = run_dir / "buffer" / "shards"
    left = [n for n in os.listdir(shards) if "-L" in n]
    assert len(left) == (point == "written")                   # the orphan: on disk, never live
    assert live_files(run_dir)["shards"] == 10 and _exact(run_dir) == EXACT
    with Sampler(run_dir / "buffer") as s:
        assert s.counts(0, None)["consumed"] == 20
    for _ in range(4):                                          # the next passes finish the work: c-files of 4 groups,
        compact(run_dir / "buffer", **levels)                   # 10 -> 5 of 8 -> 2 of 16 + 8 -> 32 + 8, then stays
    assert live_files(run_dir)["shards"] == 2 and _exact(run_dir) == EXACT
    assert [n for n in os.listdir(shards) if n.endswith(".parquet")] == BufferDir(run_dir / "buffer").live_shard_names()
    BufferDir(run_dir / "buffer").clean_tmp()
    assert os.listdir(run_dir / "buffer" / "tmp") == []
    assert files["shards"] == 20


def test_compactor_daemon_merges_every_kind_while_a_trainer_pulls_and_readers_query(run_dir):
    """The daemon (fast settings), a trainer process pulling and writing metrics, and a SQL reader, together."""
    _fill(run_dir / "buffer", 400, flush_groups=4)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    from pipeline.config import load_config, save_config
    save_config(load_config(None, []), run_dir / "config.toml")
    comp = subprocess.Popen([sys.executable, "-m", "pipeline", "compactor", "--run", str(run_dir),
                             "--set", "compactor.every_s=0.3", "--set", "compactor.min_age_s=0",
                             "--set", "compactor.grace_s=1"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(run_dir), "80"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, errors = [], []
    try:
        while trainer.poll() is None:
            try:
                seen.append(_reader_check(run_dir))
            except Exception as e:  # noqa: BLE001 - counted: there must be none
                errors.append(repr(e))
        out, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 0, err
        # The daemon's next passes merge the trainer's last files: wait for them (as test_compactor does).
        deadline = time.time() + 60
        while not _few_live(live_files(run_dir)) and comp.poll() is None and time.time() < deadline:
            time.sleep(0.1)
    finally:
        comp.send_signal(signal.SIGTERM)
        comp.communicate(timeout=30)
    assert errors == [] and seen and all(ok for ok, _ in seen)
    assert [n for _, n in seen] == sorted(n for _, n in seen)     # consumption only grows
    assert _consumed_counts(run_dir) == (320, 320)                 # 80 steps x 4 groups, each once
    assert BufferSQL(run_dir).query("SELECT count(*) n, count(DISTINCT step) d FROM metrics").to_pylist() == [
        {"n": 80, "d": 80}]
    live = live_files(run_dir)
    assert _few_live(live), live
    again = _pull_steps(run_dir / "buffer", 20, n=4, first_step=41, as_of_step=40)   # resume at step 40
    assert _consumed_counts(run_dir) == (240, 240)
    assert len(set(sum(again, []))) == 80
    with Sampler(run_dir / "buffer") as s:
        assert s.counts(0, None)["consumed"] == 240


def _few_live(live: dict) -> bool:
    return live["ledger"] <= 3 and live["metrics"] <= 3 and live["shards"] <= 3


def _consumed_counts(run) -> tuple[int, int]:
    r = BufferSQL(run).query("SELECT count(*) n, count(DISTINCT group_id) d FROM consumed").to_pylist()[0]
    return r["n"], r["d"]


def _reader_check(run) -> tuple[bool, int]:
    """(every count consistent, groups consumed) from one query on fresh views."""
    q = ("SELECT (SELECT count(*) FROM rollouts) AS rows, (SELECT count(DISTINCT group_id) FROM rollouts) AS groups, "
         "(SELECT count(*) FROM consumed) AS uses, (SELECT count(DISTINCT group_id) FROM consumed) AS used")
    r = BufferSQL(run).query(q).to_pylist()[0]
    return (r["rows"] == 1600 and r["groups"] == 400 and r["uses"] == r["used"] and r["uses"] % 4 == 0), r["uses"]


_TRAINER = """
import sys, time
from pathlib import Path
from buffer import Sampler
from workers.trainer.metrics import MetricsWriter
run, steps = Path(sys.argv[1]), int(sys.argv[2])
m = MetricsWriter(run / "metrics", flush_seconds=0.0)
with Sampler(run / "buffer") as s:
    for step in range(1, steps + 1):
        b = s.pull(4, trainer_version=0, trainer_step=step, max_staleness=None)
        assert b is not None, step
        m.add({"step": step, "groups": b.num_groups})
        time.sleep(0.03)
"""


def test_merged_files_name_their_sources_in_row_order(buf):
    _fill(buf, 30, flush_groups=5)
    names = BufferDir(buf).live_shard_names()
    compact(buf, target_groups=1000, min_age_s=0.0, grace_s=3600.0)
    (c,) = BufferDir(buf).live_shards()
    from buffer.fileset import read_sources
    sources = read_sources(pq.read_metadata(c))
    assert [s for s, _ in sources] == names and [n for _, n in sources] == [20] * 6
    rows = pq.read_table(c, columns=["group_id"]).column(0).to_pylist()
    assert np.all(np.diff([int(g.split("-")[1]) for g in rows[::G]]) == 1)


def test_dropped_groups_stay_dropped_when_merged_twice_between_two_refreshes(buf, monkeypatch):
    """A retiring index that slept through two merges (its shards -> C1 -> C2, C2's footer names only C1)
    still knows the groups it dropped: no group is offered twice."""
    monkeypatch.setattr(GroupIndex, "DROP_AT", 2)
    ids = _fill(buf, 20, flush_groups=5)
    with Sampler(buf) as s:
        first = [s.pull(5, trainer_version=0, trainer_step=k, max_staleness=None).group_ids for k in (1, 2)]
        s.counts(0, None)
        assert s.index.retired == 10 and len(s.index) == 10
        compact(buf, target_groups=1000, **NOW)                       # C1 <- the 4 shards
        more = _fill(buf, 10, flush_groups=5)
        assert compact(buf, target_groups=1000, **NOW).merged_files == 3   # C2 <- C1 + 2 new shards
        rest = [s.pull(5, trainer_version=0, trainer_step=k, max_staleness=None).group_ids for k in (3, 4, 5, 6)]
        assert s.pull(1, trainer_version=0, trainer_step=7, max_staleness=None) is None
        assert s.counts(0, None)["consumed"] == 30
    assert sorted(sum(first + rest, [])) == sorted(ids + more)


def test_a_refresh_that_missed_a_shard_remembers_the_groups_it_dropped_on_arrival(buf, monkeypatch):
    """A retiring index never holds a filtered group, nor one whose uses it read before its shard: each is
    counted and dropped as it arrives. A refresh that missed a listed file (gone before it was read) sets no
    watermark, so it keeps the keys of what it dropped until one does: a merge that brings those groups back,
    in a c-file, does not count them twice."""
    import buffer.index as index_module

    monkeypatch.setattr(GroupIndex, "DROP_AT", 2)
    _fill(buf, 20, filtered_every=4, flush_groups=5)      # 4 shards of 5; groups 0, 4, 8, 12, 16 filtered
    assert sum(len(g) for g in _pull_steps(buf, 3)) == 15  # every other group consumed
    last = BufferDir(buf).live_shard_names()[-1]
    real = index_module.parquet_file
    monkeypatch.setattr(index_module, "parquet_file",
                        lambda path: (_ for _ in ()).throw(FileNotFoundError(path)) if path.name == last else real(path))
    watcher = GroupIndex(buf, retire=True)                # misses the last shard: its uses come first
    assert watcher.retired == 4 and len(watcher) == 11 and len(watcher._limbo) == 4
    assert len(watcher._early_uses) == 4
    compact(buf, target_groups=1000, **NOW)               # all 20 groups in one c-file
    watcher.refresh()
    full = GroupIndex(buf)
    assert watcher.counts(0, None) == full.counts(0, None)
    assert full.counts(0, None)["filtered"] == 5 and full.counts(0, None)["consumed"] == 15
    assert watcher.retired == 20 and len(watcher) == 0
    assert len(watcher._limbo) == 0 and watcher._early_uses == {}


def test_an_observer_counts_uses_once_across_a_resume_cut_and_reuse(buf):
    """Uses are read idempotently (use_index): records seen in a merged file, then again in the file a
    resume cut from it, count once, also with reuse 2."""
    _fill(buf, 60)
    with Sampler(buf, reuse=2) as s:
        for step in range(1, 16):      # 15 pulls of 5: 60 groups once, then 15 of them a second time
            assert s.pull(5, trainer_version=0, trainer_step=step, max_staleness=None) is not None
    compact_ledger(buf, **NOW)
    observer = GroupIndex(buf, retire=True, reuse=2)
    assert observer.counts(0, None, 2)["consumed"] == 15
    with Sampler(buf, reuse=2, as_of_step=13):     # cut at 13: 5 second uses undone
        pass
    observer.refresh()
    fresh = GroupIndex(buf, reuse=2)
    assert fresh.counts(0, None, 2)["consumed"] == 5
    # the observer cannot take uses back (it has no record of which were undone): it never adds any
    assert observer.counts(0, None, 2)["consumed"] == 15
    assert len(_consumed(buf)) == 65


def test_a_resume_frees_names_a_killed_deletion_left_in_the_manifest(buf):
    """kill -9 inside delete_expired leaves replaced names that are no longer on disk; a resume must drop
    them, or the new step's file of the same name would be invisible (and its groups trained again)."""
    _fill(buf, 100)
    first = _pull_steps(buf, 10)
    compact_ledger(buf, min_age_s=0.0, grace_s=3600.0)
    d = BufferDir(buf)
    for name in d.ledger_set.read_manifest().replaced:
        (d.ledger / name).unlink()                       # deleted, the manifest write never happened
    again = _pull_steps(buf, 5, first_step=6, as_of_step=5)
    assert again == first[5:]
    assert len(_consumed(buf)) == 50 and GroupIndex(buf).counts(0, None)["consumed"] == 50
    assert not [n for n in d.ledger_set.read_manifest().replaced if ledger_range(n)[1] > 5]
