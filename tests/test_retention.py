"""Retention: shards too old to be pulled leave the hot buffer, exactly; disk warnings.

With compactor.keep_versions set, shards all of whose groups are older than
the trainer's version minus keep_versions move to <buffer>/archive/shards/
(or are deleted). `rollouts` must lose exactly their groups and
`archived_rollouts` hold exactly them, the sampler must still pull every
eligible group exactly once and count the archived groups in their real
state (expired, consumed, filtered: never unavailable), and a kill -9 at any
point must lose nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from types import SimpleNamespace

import pytest

import buffer.compaction as compaction
import buffer.retention as retention
import workers.compactor as compactor
from buffer import BufferDir, BufferSQL, GroupIndex, Sampler, ShardWriter, SqlError, compact
from buffer.retention import archive_shards_dir, archived_shards, read_floor, retire_old_shards
from conftest import REPO, kill_9_at_pause, make_group, run_cli
from pipeline.status import buffer_status, print_status
from workers.compactor import CompactorConfig, DiskWatch, compact_run, dir_bytes, run_compactor
from workers.stop import StopFlag

G = 4
VERSIONS = [i // 10 for i in range(100)]      # 10 groups of each version 0..9, one shard per version
KEEP = 3                                      # trainer at 9: shards of versions < 6 leave (60 groups)
LIMIT = 2                                     # the trainer's max_staleness (<= KEEP)
PULLS = [(2, 5), (5, 5), (9, 5)]              # (trainer version, groups): versions 0, 3 and 7 consumed


def _fill(buf, versions=VERSIONS, *, flush_groups=10) -> list[str]:
    """One group per entry of `versions`, in order; every 4th all equal (filtered). Their ids."""
    ids = []
    with ShardWriter(buf, flush_groups=flush_groups, flush_seconds=None) as w:
        for i, v in enumerate(versions):
            rewards = [1] * G if i % 4 == 0 else [1, 0, 0, 1]
            ids.append(w.append(make_group(v, rewards, prompt_id=f"p{i}", seed=i)))
    return ids


def _pull(sampler, pulls=PULLS, first_step=1) -> list[str]:
    out = []
    for step, (version, n) in enumerate(pulls, start=first_step):
        out += sampler.pull(n, trainer_version=version, trainer_step=step, max_staleness=LIMIT).group_ids
    return out


def _drain(sampler, version=9, first_step=100) -> list[str]:
    """Pull one group at a time at `version` until none is eligible; the ids pulled."""
    out = []
    for step in range(first_step, first_step + 1000):
        b = sampler.pull(1, trainer_version=version, trainer_step=step, max_staleness=LIMIT)
        if b is None:
            return out
        out += b.group_ids
    raise AssertionError("never ran dry")


def _ids(root, view: str) -> list[str] | None:
    """Sorted group ids of a view; None if the view does not exist (archived_rollouts without files)."""
    try:
        rows = BufferSQL(root).query(f"SELECT group_id, count(*) AS n FROM {view} GROUP BY 1").to_pylist()
    except SqlError as e:
        assert "archived_rollouts" in str(e)
        return None
    assert all(r["n"] == G for r in rows)           # every group whole, none twice
    return sorted(r["group_id"] for r in rows)


def _eligible_at_9(ids, consumed) -> list[str]:
    return sorted(g for i, g in enumerate(ids) if VERSIONS[i] >= 9 - LIMIT and i % 4 and g not in consumed)


def test_retention_is_off_by_default(tmp_path):
    run = tmp_path / "run"
    ids = _fill(run / "buffer")
    with Sampler(run / "buffer") as s:
        _pull(s)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step-000000009.pt").write_bytes(b"")
    reports = compact_run(run, CompactorConfig(min_age_s=0.0, grace_s=0.0))
    assert CompactorConfig().keep_versions is None and "retention" not in reports
    assert not (run / "buffer" / "archive").exists() and _ids(run, "rollouts") == sorted(ids)


def test_old_shards_move_to_the_archive_exactly(buf):
    ids = _fill(buf)
    with Sampler(buf) as s:
        consumed = _pull(s)
        before = s.counts(9, LIMIT)
        watcher = GroupIndex(buf)                     # a reader that indexed the shards before
        live = BufferDir(buf).live_shard_names()
        r = retire_old_shards(buf, keep_versions=KEEP, action="archive", grace_s=3600.0)
        assert (r.trainer_version, r.below_version, r.files, r.groups) == (9, 6, 6, 60)
        assert [p.name for p in archived_shards(buf)] == live[:6]
        assert BufferDir(buf).live_shard_names() == live[6:]
        assert read_floor(buf) == 6
        assert _ids(buf, "rollouts") == sorted(ids[60:])
        assert _ids(buf, "archived_rollouts") == sorted(ids[:60])
        # The sampler counts the archived groups as what they are, and still pulls every eligible group once.
        after = s.counts(9, LIMIT)
        assert after == before and after["unavailable"] == 0
        # 40 groups live, 10 of them filtered (dropped on arrival, as were the 15 of the 60 retired)
        assert len(s.index) == 30 and s.index.retired == 70
        assert after["consumed"] == 15 and after["by_version"][0]["consumed"] == 5
        assert after["by_version"][3] == {"consumed": 5, "filtered": 2, "expired": 3}
        pulled = _drain(s)
    assert sorted(pulled) == _eligible_at_9(ids, consumed) and len(set(pulled)) == len(pulled)
    watcher.refresh()                                 # an index that keeps every row (retire=False)
    full = watcher.counts(9, LIMIT)
    assert full["unavailable"] == 0 and full["groups"] == 100 and full["consumed"] == 15 + len(pulled)
    r2 = retire_old_shards(buf, keep_versions=KEEP, action="archive", grace_s=3600.0)
    assert (r2.files, r2.deleted_files) == (0, 0)     # nothing new; the replaced files wait for their grace
    assert len(list(BufferDir(buf).shards.glob("*.parquet"))) == 10
    r3 = retire_old_shards(buf, keep_versions=KEEP, action="archive", grace_s=0.0)
    assert r3.deleted_files == 6 and len(list(BufferDir(buf).shards.glob("*.parquet"))) == 4
    assert _ids(buf, "archived_rollouts") == sorted(ids[:60])   # the archive keeps its links


def test_an_archive_on_another_disk_gets_copies(tmp_path, monkeypatch):
    """archive/ a symlink to a bigger disk: links fail across filesystems, so each shard is copied (temp
    file beside the archive, then renamed); the archive is not counted against the run's disk budget."""
    run = tmp_path / "run"
    ids = _fill(run / "buffer")
    with Sampler(run / "buffer") as s:
        _pull(s)
    cold = tmp_path / "cold"
    cold.mkdir()
    (run / "buffer" / "archive").symlink_to(cold, target_is_directory=True)
    hot_bytes = dir_bytes(run)

    def no_links(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(dst))

    monkeypatch.setattr(retention.os, "link", no_links)
    r = retire_old_shards(run / "buffer", keep_versions=KEEP, grace_s=0.0)
    assert (r.files, r.deleted_files) == (6, 6)
    assert len(os.listdir(cold / "shards")) == 6 and os.listdir(cold / "tmp") == []
    assert _ids(run, "rollouts") == sorted(ids[60:]) and _ids(run, "archived_rollouts") == sorted(ids[:60])
    assert dir_bytes(run) < hot_bytes / 2                          # the copies are on the other disk


def test_a_trainer_opened_after_retention_pulls_every_eligible_group_once(buf):
    ids = _fill(buf)
    with Sampler(buf) as s:
        consumed = _pull(s)
    retire_old_shards(buf, keep_versions=KEEP, grace_s=0.0)
    with Sampler(buf) as s:
        c = s.counts(9, LIMIT)
        assert c["groups"] == 40 and c["unavailable"] == 0           # the hot buffer only
        assert c["eligible"] == len(_eligible_at_9(ids, consumed))
        pulled = _drain(s)
    assert sorted(pulled) == _eligible_at_9(ids, consumed)


def test_delete_removes_the_shards_after_the_grace_period(buf):
    ids = _fill(buf)
    with Sampler(buf) as s:
        _pull(s)
        before = s.counts(9, LIMIT)
        t0 = time.time()
        r = retire_old_shards(buf, keep_versions=KEEP, action="delete", grace_s=100.0, now=t0)
        assert (r.files, r.groups, r.deleted_files) == (6, 60, 0)
        assert s.counts(9, LIMIT) == before                       # retired, not unavailable
    d = BufferDir(buf)
    assert len(list(d.shards.glob("*.parquet"))) == 10            # still there for readers, in the grace
    assert archived_shards(buf) == [] and _ids(buf, "archived_rollouts") is None
    assert _ids(buf, "rollouts") == sorted(ids[60:])
    r = retire_old_shards(buf, keep_versions=KEEP, action="delete", grace_s=100.0, now=t0 + 101)
    assert (r.files, r.deleted_files) == (0, 6)
    assert sorted(p.name for p in d.shards.glob("*.parquet")) == d.live_shard_names()
    assert _ids(buf, "rollouts") == sorted(ids[60:])


def test_a_c_file_retired_before_an_index_saw_it_still_counts_its_groups(buf):
    """Compaction merges the shards an index read into a c-file, and retention retires that c-file, in one
    pass: the index never sees the c-file; the groups of the shards it read are retired, not unavailable."""
    _fill(buf, [v // 5 for v in range(60)], flush_groups=5)      # 12 shards: versions 0..11, 5 groups each
    with Sampler(buf) as s:
        s.pull(1, trainer_version=11, trainer_step=1, max_staleness=LIMIT)
        watcher = GroupIndex(buf, retire=True)
        before = watcher.counts(11, LIMIT)
        compact(buf, target_groups=30, min_age_s=0.0, grace_s=0.0)   # two c-files: versions 0..5 and 6..11
        r = retire_old_shards(buf, keep_versions=KEEP, grace_s=0.0)
    assert (r.files, r.groups) == (1, 30)
    watcher.refresh()
    after = watcher.counts(11, LIMIT)
    # 30 groups live, 7 of them filtered: never held
    assert after == before and after["unavailable"] == 0 and len(watcher) == 30 - 7


def test_a_shard_quarantined_elsewhere_stays_unavailable(buf):
    """Only retention's shards are retired: an old shard another process quarantined stays unavailable."""
    _fill(buf)
    with Sampler(buf) as s:
        _pull(s)
    d = BufferDir(buf)
    watcher = GroupIndex(buf)
    d.quarantine(d.live_shards()[2], "bad pages")                 # version 2: below the bound to come
    r = retire_old_shards(buf, keep_versions=KEEP, grace_s=0.0)
    assert (r.below_version, r.files) == (6, 5)
    watcher.refresh()
    c = watcher.counts(9, LIMIT)
    assert c["unavailable"] == 7 and c["by_version"][2] == {"unavailable": 7, "filtered": 3}
    assert c["groups"] == 100 and len(watcher) == 100 - 50


_PAUSE = """
import os, sys, time
from pathlib import Path
import buffer.fileset as fileset
from buffer.retention import retire_old_shards
root, point, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
def pause():
    marker.write_text(str(os.getpid()))
    while True:
        time.sleep(1)
swap = fileset.FileSet.swap
def paused_swap(self, *a, **k):
    if point == "linked":      # every old shard linked into the archive, the manifest not yet written
        pause()
    out = swap(self, *a, **k)
    if point == "swapped":     # the manifest written, nothing deleted
        pause()
    return out
fileset.FileSet.swap = paused_swap
retire_old_shards(root, keep_versions=int(sys.argv[4]), action="archive", grace_s=0.0)
print("no pause reached", file=sys.stderr)
sys.exit(3)
"""


@pytest.mark.parametrize("point", ["linked", "swapped"])
def test_kill_9_in_the_middle_of_retention_loses_nothing(buf, tmp_path, point):
    ids = _fill(buf)
    with Sampler(buf) as s:
        consumed = _pull(s)
    marker = tmp_path / "paused"
    kill_9_at_pause([sys.executable, "-c", _PAUSE, str(buf), point, str(marker), str(KEEP)], marker)
    assert len(os.listdir(archive_shards_dir(buf))) == 6
    hot, cold = _ids(buf, "rollouts"), _ids(buf, "archived_rollouts")
    if point == "linked":                      # linked but still live: in rollouts only
        assert hot == sorted(ids) and cold is None
    else:
        assert hot == sorted(ids[60:]) and cold == sorted(ids[:60])
    with Sampler(buf) as s:                    # the trainer: nothing eligible lost, nothing twice
        assert s.counts(9, LIMIT)["unavailable"] == 0
        pulled = _drain(s)
    assert sorted(pulled) == _eligible_at_9(ids, consumed)
    r = retire_old_shards(buf, keep_versions=KEEP, grace_s=0.0)   # the next pass finishes the work
    assert r.files == (6 if point == "linked" else 0)
    assert _ids(buf, "rollouts") == sorted(ids[60:]) and _ids(buf, "archived_rollouts") == sorted(ids[:60])
    assert len(list(BufferDir(buf).shards.glob("*.parquet"))) == 4
    BufferDir(buf).clean_tmp()
    assert os.listdir(BufferDir(buf).tmp) == []


def _run_with_checkpoint(tmp_path, steps=(9,)):
    run = tmp_path / "run"
    ids = _fill(run / "buffer", flush_groups=5)                    # 2 shards per version
    with Sampler(run / "buffer") as s:
        _pull(s)
    (run / "checkpoints").mkdir()
    for step in steps:
        (run / "checkpoints" / f"step-{step:09d}.pt").write_bytes(b"")
    return run, ids


def test_the_compactor_retires_old_shards_before_merging_them(tmp_path):
    """Shards old enough leave before the merges (a level merge would tie them to newer groups); the rest merge."""
    run, ids = _run_with_checkpoint(tmp_path)
    cfg = CompactorConfig(min_age_s=0.0, grace_s=0.0, target_groups=10, keep_versions=KEEP)
    reports = compact_run(run, cfg)
    assert reports["shards"].written_files == 4                    # versions 6..9: one c-file each
    r = reports["retention"]
    assert (r.trainer_version, r.files, r.groups, r.deleted_files) == (9, 12, 60, 12)   # 2 shards a version
    assert not any(p.name.startswith("c-") for p in archived_shards(run / "buffer"))
    assert _ids(run, "rollouts") == sorted(ids[60:]) and _ids(run, "archived_rollouts") == sorted(ids[:60])
    assert len(os.listdir(run / "buffer" / "shards")) == 4


def test_retention_waits_for_the_oldest_checkpoint(tmp_path):
    """A resumed trainer starts at a checkpoint: nothing it may pull leaves, whatever the ledger says."""
    run, ids = _run_with_checkpoint(tmp_path, steps=())
    cfg = CompactorConfig(min_age_s=0.0, grace_s=0.0, target_groups=10, keep_versions=KEEP)   # a c-file a version
    r = compact_run(run, cfg)["retention"]
    assert (r.trainer_version, r.files) == (None, 0)               # no checkpoint yet: nothing leaves
    for step in (5, 9):
        (run / "checkpoints" / f"step-{step:09d}.pt").write_bytes(b"")
    r = compact_run(run, cfg)["retention"]
    assert (r.trainer_version, r.below_version, r.groups) == (5, 2, 20)
    (run / "checkpoints" / "step-000000005.pt").unlink()
    r = compact_run(run, cfg)["retention"]
    assert (r.trainer_version, r.below_version, r.groups) == (9, 6, 40)
    assert _ids(run, "archived_rollouts") == sorted(ids[:60])


def test_the_daemon_logs_retention_and_counts_it(tmp_path, caplog):
    run, _ = _run_with_checkpoint(tmp_path)
    stop = StopFlag(install_signals=False)
    stop.wait = lambda _s: stop.set()                              # one pass
    cfg = CompactorConfig(every_s=1.0, min_age_s=0.0, grace_s=0.0, target_groups=10, keep_versions=KEEP,
                          retention="delete", min_free_gb=None)
    with caplog.at_level(logging.INFO, logger="asyncgrpo.compactor"):
        totals = run_compactor(run, cfg, stop)
    assert (totals["passes"], totals["retired_files"], totals["retired_groups"]) == (1, 12, 60)
    assert any("retention deleted 12 shards (60 groups, all older than version 6" in r.getMessage()
               for r in caplog.records)
    assert archived_shards(run / "buffer") == [] and _ids(run, "archived_rollouts") is None


def test_status_counts_the_archive_from_a_listing(buf, capsys):
    _fill(buf)
    with Sampler(buf) as s:
        _pull(s)
    assert buffer_status(buf)["archive"] == {"files": 0, "bytes": 0}
    retire_old_shards(buf, keep_versions=KEEP, grace_s=0.0)
    r = buffer_status(buf)
    assert r["groups"] == 40
    assert r["archive"] == {"files": 6, "bytes": sum(p.stat().st_size for p in archived_shards(buf))}
    print_status(r)
    assert "archive: 6 shards" in capsys.readouterr().out


@pytest.mark.parametrize("sets, names", [
    (["compactor.keep_versions=4", "trainer.max_staleness=none"],
     ["compactor.keep_versions (4)", "trainer.max_staleness", "none"]),
    (["compactor.keep_versions=1", "trainer.max_staleness=2"],
     ["compactor.keep_versions (1)", "trainer.max_staleness (2)"]),
    (["compactor.retention=trash"], ["compactor.retention", "'trash'", "'archive', 'delete'"]),
    (["compactor.disk_budget_gb=0"], ["compactor.disk_budget_gb", "0"]),
])
def test_bad_retention_settings_name_the_keys(sets, names):
    r = run_cli("config", *[x for s in sets for x in ("--set", s)])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert all(n in r.stderr for n in names), r.stderr


def test_good_retention_settings_load():
    from pipeline.config import load_config
    cfg = load_config(None, ["compactor.keep_versions=2", "compactor.retention=delete"])
    assert (cfg.compactor.keep_versions, cfg.compactor.retention) == (2, "delete")
    with pytest.raises(ValueError, match="CompactorConfig.retention must be 'archive' or 'delete'"):
        CompactorConfig(retention="trash")


def test_disk_warnings_fire_and_are_rate_limited(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "a.bin").write_bytes(b"\0" * 2000)
    os.link(run / "a.bin", run / "b.bin")                           # one file, counted once
    assert dir_bytes(run) == 2000
    budget = CompactorConfig(disk_budget_gb=2000 / 0.9 / 1e9 * 0.99, min_free_gb=None)   # 2000 B > 90%
    watch = DiskWatch()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.compactor"):
        first = watch.check(run, budget, now=1000.0)
        again = watch.check(run, budget, now=1000.0 + 599)
        later = watch.check(run, budget, now=1000.0 + 600)
    assert len(first) == 1 and "compactor.disk_budget_gb" in first[0] and again == [] and len(later) == 1
    assert [r.getMessage() for r in caplog.records] == first + later
    roomy = CompactorConfig(disk_budget_gb=2000 / 0.9 / 1e9 * 1.01, min_free_gb=None)
    assert DiskWatch().check(run, roomy, now=0.0) == []
    monkeypatch.setattr(compactor.shutil, "disk_usage",
                        lambda p: SimpleNamespace(total=100e9, used=99.5e9, free=0.5e9))
    watch = DiskWatch()
    low = CompactorConfig(min_free_gb=1.0)
    first = watch.check(run, low, now=0.0)
    assert len(first) == 1 and "0.50 GB free" in first[0] and "compactor.min_free_gb" in first[0]
    assert watch.check(run, low, now=300.0) == [] and len(watch.check(run, low, now=601.0)) == 1
    assert DiskWatch().check(run, CompactorConfig(min_free_gb=0.4), now=0.0) == []


def test_compaction_reads_each_footer_once(buf, monkeypatch):
    """compact() keeps each shard's group count (files never change): a pass over unchanged files reads no footer."""
    _fill(buf, [0] * 100)                                            # 10 shards of 10 groups
    assert compact(buf, target_groups=5, min_age_s=0.0, grace_s=0.0).merged_files == 0   # none small: all read
    calls = []
    real = compaction.pq.read_metadata
    monkeypatch.setattr(compaction.pq, "read_metadata", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    assert compact(buf, target_groups=5, min_age_s=0.0, grace_s=0.0).merged_files == 0
    assert calls == []
    r = compact(buf, target_groups=1000, min_age_s=0.0, grace_s=0.0)     # the cached counts choose the same
    assert (r.merged_files, r.written_files, r.groups) == (10, 1, 100) and calls == []
    assert compact(buf, target_groups=1000, min_age_s=0.0, grace_s=0.0).merged_files == 0
    assert [p.name for p in calls] == BufferDir(buf).live_shard_names()   # the new c-file, once


def test_status_counts_only_live_consumed_groups_of_a_version_split_by_retention(buf):
    """Version 5 lies in an archived shard and in a live one: status's consumed count for it is that of
    the live groups (by id), not the ledger's count for the whole version."""
    _fill(buf, [5] * 10 + [5] * 5 + [9] * 5)          # shard 0: ten of v5; shard 1: five of v5, five of v9
    with Sampler(buf) as s:
        b = s.pull(9, trainer_version=7, trainer_step=1, max_staleness=LIMIT)   # 7 of shard 0, 2 of shard 1
    assert b is not None
    r = retire_old_shards(buf, keep_versions=KEEP, action="archive", grace_s=0.0, trainer_version=9)
    assert (r.files, r.below_version) == (1, 6)
    s = buffer_status(buf, trainer_version=9, max_staleness=LIMIT)
    assert (s["groups"], s["consumed"], s["filtered"], s["expired"], s["eligible"]) == (10, 2, 2, 2, 4)
