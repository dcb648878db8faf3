"""The compactor daemon: bounded live files while readers query, a clean stop, and how `run` starts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from buffer import BufferDir, BufferSQL, ShardWriter
from conftest import REPO, make_group, run_cli
from pipeline.config import load_config, save_config
from pipeline.run import Supervisor
from workers.compactor import CompactorConfig
from workers.proc import ARROW_POOL_ENV, rss_mb, use_system_allocator

FAST = ["--set", "compactor.every_s=0.2", "--set", "compactor.min_age_s=0", "--set", "compactor.grace_s=0"]


@pytest.fixture
def run_with_shards(tmp_path):
    """A run directory with 40 groups in 20 sealed two-group shards; returns (run, group ids)."""
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, []), run / "config.toml")
    with ShardWriter(run / "buffer", flush_groups=2, flush_seconds=None) as w:
        ids = [w.append(make_group(i // 4, [1, 0, 1, 0], prompt_id=f"p{i}", seed=i)) for i in range(40)]
    assert len(BufferDir(run / "buffer").live_shards()) == 20
    return run, ids


def _count(run) -> tuple[int, int]:
    row = BufferSQL(run).query("SELECT count(*) n, count(DISTINCT group_id) g FROM rollouts").to_pylist()[0]
    return row["n"], row["g"]


def test_compactor_merges_sealed_shards_while_readers_query_and_stops_on_sigterm(run_with_shards):
    run, ids = run_with_shards
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "compactor", "--run", str(run), *FAST],
                            cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        deadline = time.time() + 60
        while len(BufferDir(run / "buffer").live_shards()) > 1 and time.time() < deadline:
            seen.append(_count(run))       # a reader during compaction: never an error, never a double count
        while list((run / "buffer" / "shards").glob("w*.parquet")) and time.time() < deadline:
            time.sleep(0.1)                # a later pass deletes the replaced files (grace 0)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Arrow allocator system" in err    # malloc, which gives memory back between passes
    assert seen and set(seen) == {(160, 40)}
    live = BufferDir(run / "buffer").live_shards()
    assert len(live) == 1 and live[0].name.startswith("c")
    assert _count(run) == (160, 40)
    assert sorted(r["group_id"] for r in BufferSQL(run).query("SELECT DISTINCT group_id FROM groups").to_pylist()
                  ) == sorted(ids)
    totals = json.loads(out.strip().splitlines()[-1])
    merged = tuple(totals[k] for k in ("merged_files", "written_files", "groups", "deleted_files"))
    assert merged == (20, 1, 40, 20)
    assert list((run / "buffer" / "shards").glob("w*.parquet")) == []    # replaced files deleted after grace 0


def test_compactor_turned_off_is_a_user_error(run_with_shards):
    run, _ = run_with_shards
    r = run_cli("compactor", "--run", str(run), "--set", "compactor.every_s=none")
    assert r.returncode == 2 and "compactor.every_s is none" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("key, value, need", [("every_s", "0", "a number of seconds > 0, or none"),
                                              ("min_age_s", "-1", "a number of seconds >= 0"),
                                              ("target_groups", "1", "an integer >= 2"),
                                              ("fanout", "1", "an integer >= 2, or none"),
                                              ("max_groups", "100", "an integer >= compactor.target_groups (4096)"),
                                              ("max_file_mb", "0", "a number of MiB > 0, or none")])
def test_bad_compactor_settings_name_the_key(key, value, need):
    r = run_cli("config", "--set", f"compactor.{key}={value}")
    assert r.returncode == 2 and f"compactor.{key}" in r.stderr and need in r.stderr


def test_level_merges_stop_at_65536_groups_only_with_retention():
    assert (CompactorConfig().level_max_groups, CompactorConfig().level_max_bytes) == (None, 256 << 20)
    assert CompactorConfig(keep_versions=8).level_max_groups == 65_536
    assert CompactorConfig(keep_versions=8, target_groups=100_000, max_groups=None).level_max_groups == 100_000
    assert CompactorConfig(keep_versions=8, max_groups=8192).level_max_groups == 8192
    assert CompactorConfig(max_groups=8192, max_file_mb=None).level_max_bytes is None
    assert CompactorConfig(max_file_mb=0.5).level_max_bytes == 1 << 19


def test_run_starts_a_compactor_unless_it_is_off(tmp_path):
    on = Supervisor(tmp_path, load_config(None, []), resume=False)
    assert [c.name for c in on.children()] == ["trainer", "generator-0", "compactor"]
    assert on.helpers[0].argv[-3:] == ["compactor", "--run", str(tmp_path)]
    off = Supervisor(tmp_path, load_config(None, ["compactor.every_s=none"]), resume=False)
    assert [c.name for c in off.children()] == ["trainer", "generator-0"]


def test_daemons_allocate_with_malloc_unless_the_user_chose_a_pool(monkeypatch):
    monkeypatch.delenv(ARROW_POOL_ENV, raising=False)
    use_system_allocator()
    assert os.environ[ARROW_POOL_ENV] == "system"
    monkeypatch.setenv(ARROW_POOL_ENV, "mimalloc")
    use_system_allocator()
    assert os.environ[ARROW_POOL_ENV] == "mimalloc"


def test_rss_mb_is_this_process_resident_memory():
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    vm_rss_mb = int(status["VmRSS"].split()[0]) / 1024
    assert rss_mb() == pytest.approx(vm_rss_mb, abs=2.0)
    before = rss_mb()
    block = bytearray(b"\x01") * (64 * 2**20)     # 64 MiB, every byte written (so resident)
    assert rss_mb() - before == pytest.approx(64, abs=8)
    del block
