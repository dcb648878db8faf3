"""Early merges: a set with more than `max_unmerged // 2` unmerged files merges its young ones too,
and the daemon starts a pass at once when one holds more than `max_unmerged`.

Without them, the unmerged files a run holds number the writers' output over min_age_s +
every_s, so the live file count grows with the output; with them it stays under about
max_unmerged a set. What is merged early is chosen by age (mtime), never by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from buffer import BufferDir, BufferSQL, ShardWriter, compact, compact_ledger, compact_small
from buffer.compaction import early_merges, unmerged_count
from buffer.layout import run_file_set
from conftest import REPO, make_group, run_cli
from pipeline.config import load_config, save_config
from workers.compactor import CompactorConfig, EarlyTrigger, unmerged_files
from workers.trainer.metrics import MetricsWriter
from test_compaction_sets import _consumed, _fill, _pull_steps

YOUNG = dict(min_age_s=3600.0, grace_s=3600.0)   # every file is young: only early merges happen


def _age_reversed(folder, names: list[str]) -> list[str]:
    """Give `names` mtimes 10 s apart in reverse name order (the first name the newest, 1,000 - 10 *
    len(names) s old, the last 990 s old); the names, oldest first."""
    now = time.time()
    for i, n in enumerate(names):
        t = now - 1000 + 10 * (len(names) - i)
        os.utime(folder / n, (t, t))
    return names[::-1]


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "buffer").mkdir(parents=True)
    return run


def _rollouts(root) -> tuple[int, int]:
    row = BufferSQL(root).query("SELECT count(*) n, count(DISTINCT group_id) g FROM rollouts").to_pylist()[0]
    return row["n"], row["g"]


def test_too_many_unmerged_shards_merge_young_all_but_the_newest_by_age(buf):
    ids = _fill(buf, 40, flush_groups=2)
    d = BufferDir(buf)
    oldest_first = _age_reversed(d.shards, d.live_shard_names())
    assert len(oldest_first) == 20
    for limit in (None, 40):     # not over half the limit: young shards stay
        r = compact(buf, max_unmerged=limit, **YOUNG)
        assert (r.merged_files, r.written_files) == (0, 0)
    r = compact(buf, max_unmerged=8, **YOUNG)
    assert (r.merged_files, r.written_files, r.groups) == (16, 1, 32)
    live = d.live_shard_names()
    assert sorted(n for n in live if not n.startswith("c-")) == sorted(oldest_first[-4:])   # the newest 8 // 2
    assert len(live) == 5 and unmerged_count(d.shard_set) == 4
    assert _rollouts(buf) == (160, 40)
    assert sorted(r["group_id"] for r in BufferSQL(buf).query("SELECT DISTINCT group_id FROM groups")
                  .to_pylist()) == sorted(ids)
    r = compact(buf, max_unmerged=8, **YOUNG)      # 4 unmerged: under the limit again, nothing to do
    assert (r.merged_files, r.written_files) == (0, 0)


def test_a_pass_leaves_at_most_half_the_limit_unmerged_so_the_next_early_pass_comes_at_the_limit(buf):
    """Not only an early pass: any pass over max_unmerged // 2 merges young files down to that many, so
    the trigger (over max_unmerged, and max_unmerged // 2 more than the pass left) does not move up with
    the writers' rate."""
    _fill(buf, 40, flush_groups=2)
    d = BufferDir(buf)
    oldest_first = _age_reversed(d.shards, d.live_shard_names())
    r = compact(buf, max_unmerged=40, **YOUNG)                 # 20: not over 20
    assert (r.merged_files, r.written_files) == (0, 0)
    r = compact(buf, max_unmerged=36, **YOUNG)                 # 20 over 18: the oldest two go
    assert (r.merged_files, r.written_files, r.groups) == (2, 1, 4)
    assert sorted(n for n in d.live_shard_names() if not n.startswith("c-")) == sorted(oldest_first[2:])
    assert unmerged_count(d.shard_set) == 18
    r = compact(buf, max_unmerged=36, **YOUNG)
    assert (r.merged_files, r.written_files) == (0, 0)
    assert _rollouts(buf) == (160, 40)


def test_old_files_merge_as_before_and_count_against_the_limit(buf):
    _fill(buf, 20, flush_groups=2)
    d = BufferDir(buf)
    oldest_first = _age_reversed(d.shards, d.live_shard_names())
    listed = [(p, p.stat()) for p in d.shard_set.live()]
    now = time.time()
    # 10 unmerged, 900-990 s old: 5 older than 945 s. Over half a limit of 8, all but the newest 4 go: one young
    assert early_merges(d.shard_set, listed, now, 945.0, 8) == set(oldest_first[5:6])
    assert early_merges(d.shard_set, listed, now, 945.0, 6) == set(oldest_first[5:7])
    assert early_merges(d.shard_set, listed, now, 945.0, 10) == set()   # all but the newest 5: the old ones
    assert early_merges(d.shard_set, listed, now, 945.0, 20) == set()   # 10: not over 10
    assert early_merges(d.shard_set, listed, now, 3600.0, 6) == set(oldest_first[:7])
    r = compact(buf, min_age_s=945.0, grace_s=3600.0, max_unmerged=6)
    assert (r.merged_files, r.written_files, r.groups) == (7, 1, 14)
    assert sorted(n for n in d.live_shard_names() if not n.startswith("c-")) == sorted(oldest_first[7:])


def test_ledger_files_merge_early_in_step_order_and_keep_exactly_once(buf):
    _fill(buf, 100)
    pulled = _pull_steps(buf, 12)
    d = BufferDir(buf)
    names = d.ledger_shard_names()
    assert len(names) == 12
    r = compact_ledger(buf, max_unmerged=10, **YOUNG)       # keep the newest 5 (the last steps)
    assert (r.merged_files, r.written_files, r.groups) == (7, 1, 35)
    assert unmerged_count(d.ledger_set) == 5
    assert _consumed(buf) == [(g, step) for step, ids in enumerate(pulled, 1) for g in sorted(ids)]
    more = _pull_steps(buf, 3, first_step=13)                # a new trainer after the merge: never a group twice
    assert not set(sum(more, [])) & set(sum(pulled, []))


def test_metrics_files_merge_early(run_dir):
    _fill(run_dir / "buffer", 4)     # SQL reads a run with a buffer
    m = MetricsWriter(run_dir / "metrics", flush_seconds=0.0)
    for step in range(1, 13):
        m.add({"step": step, "loss": 1.0 / step})
    fs = run_file_set(run_dir / "metrics", "metrics")
    r = compact_small(fs, target_rows=1000, sort_by="step", max_unmerged=4, **YOUNG)
    assert (r.merged_files, r.written_files, r.groups) == (10, 1, 10)
    assert len(fs.live_names()) == 3 and unmerged_count(fs) == 2
    got = BufferSQL(run_dir).query("SELECT step FROM metrics ORDER BY step").to_pylist()
    assert [row["step"] for row in got] == list(range(1, 13))


def test_the_trigger_waits_for_half_the_limit_more_than_the_last_pass_left(run_dir):
    cfg = CompactorConfig(max_unmerged=6)
    with ShardWriter(run_dir / "buffer", flush_groups=1, flush_seconds=None) as w:
        for i in range(9):
            w.append(make_group(0, [1, 0, 1, 0], prompt_id=f"p{i}", seed=i))
    t = EarlyTrigger(run_dir, cfg)
    assert unmerged_files(run_dir)["shards"] == 9 and t.over() == ["shards"]
    t.passed()                   # say a pass could merge none of them (e.g. shards of target_groups or more)
    assert t.over() == []        # 9 is over 6, but not 9 + 3: no pass after pass
    with ShardWriter(run_dir / "buffer", generator_id="other", flush_groups=1, flush_seconds=None,
                     background=False) as w:     # each append's shard is on disk when it returns
        for i in range(3):
            w.append(make_group(0, [1, 0, 1, 0], prompt_id=f"q{i}", seed=i))
            assert t.over() == ([] if i < 2 else ["shards"])
    assert EarlyTrigger(run_dir, CompactorConfig(max_unmerged=None)).over() == []


def test_the_trigger_looks_ahead_by_the_arrival_rate_and_counts_only_what_the_pass_saw(run_dir):
    """A pass that takes a while: the files that come meanwhile do not raise the next trigger, and the
    trigger fires early enough that the files arriving during a pass as long as the last keep the set
    at max_unmerged."""
    clock = [100.0]
    t = EarlyTrigger(run_dir, CompactorConfig(max_unmerged=6), clock=lambda: clock[0])

    def write(n, start, gen="g"):
        with ShardWriter(run_dir / "buffer", generator_id=gen, flush_groups=1, flush_seconds=None,
                         background=False) as w:
            for i in range(start, start + n):
                w.append(make_group(0, [1, 0, 1, 0], prompt_id=f"p{i}", seed=i))

    write(9, 0)
    t.starting()
    r = compact(run_dir / "buffer", max_unmerged=6, **YOUNG)          # the pass: all but the newest 3
    assert r.merged_files == 6
    write(2, 9, gen="h")                                               # 2 more while it ran
    t.passed(took=3.0)
    assert unmerged_files(run_dir)["shards"] == 5 and t.after_pass["shards"] == 3   # saw 9, left 3
    assert t.over() == []                                              # 5: under 6, no rate yet
    clock[0] += 10.0
    write(1, 11, gen="i")                                              # 6 unmerged, 1 in 10 s
    assert t.over() == ["shards"]      # 6 + 0.1 a second * (3 s + 1 s) = 6.4 > 6 and >= 3 + 3
    t2 = EarlyTrigger(run_dir, CompactorConfig(max_unmerged=6), clock=lambda: clock[0])
    t2.passed()                        # without starting() and a pass's length: all 6 left, no look-ahead
    clock[0] += 10.0
    write(2, 12, gen="j")
    assert t2.over() == []             # 8: over 6 but not 6 + 3
    write(1, 14, gen="k")
    assert t2.over() == ["shards"]


def _unmerged_shards(run) -> int:
    return unmerged_count(BufferDir(run / "buffer").shard_set)


def test_the_daemon_merges_early_when_too_many_are_unmerged_long_before_every_s(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, []), run / "config.toml")

    def write(n, start):
        with ShardWriter(run / "buffer", generator_id="gen", flush_groups=1, flush_seconds=None) as w:
            for i in range(start, start + n):
                w.append(make_group(0, [1, 0, 1, 0], prompt_id=f"p{i}", seed=i))

    write(10, 0)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "compactor", "--run", str(run),
                             "--set", "compactor.every_s=3600", "--set", "compactor.min_age_s=3600",
                             "--set", "compactor.grace_s=0", "--set", "compactor.max_unmerged=6"],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while _unmerged_shards(run) != 3 and time.time() < deadline:   # the first pass: all but the newest 3
            time.sleep(0.1)
        assert _unmerged_shards(run) == 3
        write(1, 10)                # 4 unmerged: not over 6, even looking ahead (at most 6 // 4 files)
        time.sleep(2.5)             # two and more counts (one a second)
        assert _unmerged_shards(run) == 4
        write(3, 11)                # 7: over 6, and 3 more than the first pass left (looking ahead by a
        c_files = lambda: sum(n.startswith("c-") for n in BufferDir(run / "buffer").live_shard_names())
        while c_files() < 2 and time.time() < deadline:   # file, the pass may start at 6, before the last)
            time.sleep(0.1)
        assert c_files() == 2
        time.sleep(2.5)
        left = _unmerged_shards(run)
        assert left in (3, 4)       # all but the newest 3 of the 6 or 7 it saw
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    totals = json.loads(out.strip().splitlines()[-1])
    assert (totals["passes"], totals["early_passes"], totals["merged_files"], totals["groups"]) == (
        2, 1, 14 - left, 14 - left)
    assert "early: shards over 6 unmerged" in err
    assert _rollouts(run / "buffer") == (56, 14)


@pytest.mark.parametrize("value, need", [("1", "an integer >= 2, or none"), ("0", "an integer >= 2, or none"),
                                         ("-3", "an integer >= 2, or none"), ("2.5", "an integer or 'none', got 2.5")])
def test_a_bad_max_unmerged_names_the_key(value, need):
    r = run_cli("config", "--set", f"compactor.max_unmerged={value}")
    assert r.returncode == 2 and "compactor.max_unmerged" in r.stderr and need in r.stderr
