"""The buffer on a real S3 API server (moto's, on 127.0.0.1): the same tests as on a local disk, run
again with the buffer at s3://<bucket>/run/buffer (`buf` below replaces conftest's), and what only an
object store has (no folders, no rename, no lock files)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from buffer import BufferError, BufferSQL, Sampler, ShardWriter
from buffer.compaction import compact
from buffer.layout import BufferDir, find_buffer
from buffer.sql import SqlError
from conftest import make_group

from buffer.store import store_path
from tests.test_buffer_sampler import (  # noqa: F401 - collected again, here on S3
    test_filtered_and_future_groups_never_pulled,
    test_newest_and_uniform_orders,
    test_oldest_first_and_staleness_limit_exact,
    test_reopen_replays_ledger_nothing_twice_nothing_skipped,
    test_reuse_makes_passes,
)


@pytest.fixture
def buf(s3env):
    bucket = s3env.create_bucket(f"buf-{uuid.uuid4().hex[:8]}")
    return store_path(f"s3://{bucket}/run") / "buffer"


def _fill_s3(buf, n, *, flush_groups=2):
    with ShardWriter(buf, flush_groups=flush_groups, flush_seconds=None) as w:
        return [w.append(make_group(i % 3, [1, 0, 0, 1], prompt_id=f"p{i}", seed=i, correct=[1, 0, 0, 1]))
                for i in range(n)]


def test_an_s3_buffer_has_no_folders_and_is_found_by_its_marker(buf):
    _fill_s3(buf, 4)
    assert BufferDir.is_buffer(buf) and find_buffer(str(buf)) == buf
    assert find_buffer(str(buf.parent)) == buf                       # the run: buffer/ is under it
    names = sorted(e.name for e in buf.store.list(buf.key))
    assert names == ["buffer.json"]                                   # no lock files, no tmp files
    assert [e.name for e in buf.store.list(buf.key + "/writers")] == ["w000000.json"]
    with pytest.raises(BufferError, match=r"path not found: s3://buf-\w+/run/elsewhere"):
        find_buffer(str(buf.parent / "elsewhere"))


def test_one_trainer_per_s3_buffer(buf):
    _fill_s3(buf, 2)
    with Sampler(buf):
        with pytest.raises(BufferError, match="another trainer"):
            Sampler(buf)
    with Sampler(buf):     # released on close
        pass


def test_resume_as_of_a_step_moves_the_undone_records_aside(buf):
    ids = _fill_s3(buf, 12)
    with Sampler(buf) as s:
        per_step = {k: s.pull(2, trainer_version=2, trainer_step=k, max_staleness=None).group_ids
                    for k in range(1, 6)}
    with Sampler(buf, as_of_step=2) as s:
        redo = {k: s.pull(2, trainer_version=2, trainer_step=k, max_staleness=None).group_ids for k in range(3, 6)}
    assert redo == {k: per_step[k] for k in range(3, 6)}
    abandoned = sorted(p.name.split("-", 2)[2] for p in (buf / "ledger" / "abandoned").iterdir())
    assert abandoned == [f"step-{k:09d}-0000.parquet" for k in (3, 4, 5)]
    rows = BufferSQL(buf).query("SELECT count(*) AS n, count(DISTINCT group_id) AS d FROM consumed").to_pylist()
    assert rows == [{"n": 10, "d": 10}] and len(ids) == 12


def test_compaction_on_s3_during_continuous_queries(buf):
    """40 shards of 2 groups merged (twice, then their sources deleted after the grace) while a reader
    queries without pause: every query counts exactly the 80 groups, none fails, and a trainer pulls
    each group exactly once across the merges."""
    _fill_s3(buf, 80)
    counts, errors, stop = [], [], threading.Event()

    def reader():
        sql = BufferSQL(buf)
        while not stop.is_set():
            try:
                counts.append(sql.query("SELECT count(DISTINCT group_id) AS g, count(*) AS r FROM rollouts")
                              .to_pylist()[0])
            except Exception as e:  # noqa: BLE001 - counted, and the test fails on any
                errors.append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        pulled = []
        with Sampler(buf) as s:
            pulled += s.pull(10, trainer_version=2, trainer_step=1, max_staleness=None).group_ids
            first = compact(buf, target_groups=16, min_age_s=0, grace_s=0.5)
            pulled += s.pull(10, trainer_version=2, trainer_step=2, max_staleness=None).group_ids
            time.sleep(0.6)
            second = compact(buf, target_groups=128, min_age_s=0, grace_s=0.5)
            while (b := s.pull(12, trainer_version=2, trainer_step=len(pulled), max_staleness=None)) is not None:
                pulled += b.group_ids
        time.sleep(0.6)
        compact(buf, target_groups=128, min_age_s=0, grace_s=0.5)     # deletes the expired sources
    finally:
        stop.set()
        t.join()
    assert errors == [] and len(counts) >= 3
    assert all(c == {"g": 80, "r": 320} for c in counts), counts
    assert first.merged_files == 40 and first.written_files == 5
    assert second.written_files == 1
    assert len(pulled) == 80 == len(set(pulled))
    live = BufferDir(buf).live_shard_names()
    assert len(live) == 1 and live[0].startswith("c-")
    assert sorted(p.name for p in (buf / "shards").iterdir()) == live   # the sources are gone from the bucket
    rows = BufferSQL(buf).query("SELECT count(*) AS n, count(DISTINCT group_id) AS d FROM consumed").to_pylist()
    assert rows == [{"n": 80, "d": 80}]


def test_sql_on_s3_reads_nothing_but_the_buffer(buf):
    _fill_s3(buf, 2)
    with pytest.raises(SqlError):
        BufferSQL(buf).query(f"SELECT * FROM read_parquet('{buf.store.url('buffer.json')}')")
    with pytest.raises(SqlError, match="only SELECT"):
        BufferSQL(buf).query(f"COPY rollouts TO '{buf.store.url('x.parquet')}'")


def _cli_env(server):
    import os
    return dict(os.environ, **server.env)


def test_status_and_sql_commands_on_an_s3_run(buf, s3server):
    import json
    import subprocess
    import sys

    from conftest import REPO

    _fill_s3(buf, 6)
    with Sampler(buf) as s:
        s.pull(2, trainer_version=2, trainer_step=1, max_staleness=None)
    run = str(buf.parent)
    env = dict(_cli_env(s3server), PYTHONPATH=str(REPO))
    st = subprocess.run([sys.executable, "-m", "pipeline", "status", run, "--json"], capture_output=True,
                        text=True, env=env, timeout=120)
    assert st.returncode == 0, st.stderr
    counts = json.loads(st.stdout)
    assert (counts["groups"], counts["consumed"], counts["eligible"]) == (6, 2, 4)
    q = subprocess.run([sys.executable, "-m", "pipeline", "sql", run, "--format", "json",
                        "SELECT count(*) AS n FROM rollouts"], capture_output=True, text=True, env=env, timeout=120)
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout) == [{"n": 24}]
    bad = subprocess.run([sys.executable, "-m", "pipeline", "status", "s3://no-such-bucket/run"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2
    assert "the bucket 'no-such-bucket' does not exist at http://127.0.0.1:" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_manifest_write_after_someone_elses_fails_instead_of_overwriting_it(buf):
    """If-Match on the manifest: a lock holder whose lease lapsed (paused) and who then writes what it
    read before is refused, and the newer manifest stays."""
    _fill_s3(buf, 2)
    paused, current = BufferDir(buf).shard_set, BufferDir(buf).shard_set
    old = paused.read_manifest()
    m = current.read_manifest()
    current.swap(m, [], ["gone.parquet"], now=1.0)                     # the next holder's write
    with pytest.raises(BufferError, match=r"manifest\.json was changed by another process"):
        paused.swap(old, [], ["other.parquet"], now=2.0)
    assert BufferDir(buf).read_manifest().replaced == {"gone.parquet": 1.0}
    current.swap(current.read_manifest(), [], ["third.parquet"], now=3.0)   # after a fresh read: fine
    assert set(BufferDir(buf).read_manifest().replaced) == {"gone.parquet", "third.parquet"}
