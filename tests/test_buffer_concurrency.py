"""Several processes at once: writers, a reader, compaction, and kill -9."""

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq

from buffer import BufferDir, BufferSQL, compact
from conftest import run_helper


def test_three_writers_and_a_reader(tmp_path):
    buf = tmp_path / "buffer"
    BufferDir(buf, create=True)
    stop = tmp_path / "stop"
    reader = run_helper("reader_proc.py", str(buf), str(stop), "10")
    assert reader.stdout.readline().strip() == "ready"   # it queries from before the first write to after the last
    writers = [run_helper("writer_proc.py", str(buf), f"g{i}", "300", "5", str(tmp_path / f"log{i}"))
               for i in range(3)]
    for w in writers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
    stop.touch()
    out, err = reader.communicate(timeout=120)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["errors"] == 0 and r["wrong"] == 0, r
    assert r["queries"] >= 10, r                          # fewer: it stopped at its deadline
    (final,) = BufferSQL(buf).query("SELECT count(*) AS rows, count(DISTINCT group_id) AS groups, "
                                    "count(DISTINCT writer_id) AS writers FROM rollouts").to_pylist()
    assert final == {"rows": 900 * 8, "groups": 900, "writers": 3}


def test_kill_9_during_flushes_loses_no_flushed_group(tmp_path):
    buf = tmp_path / "buffer"
    log = tmp_path / "flushed.log"
    BufferDir(buf, create=True)
    env = dict(os.environ, PYTHONPATH=str(os.path.dirname(os.path.dirname(__file__))))
    helper = os.path.join(os.path.dirname(__file__), "helpers", "writer_proc.py")
    kills = 0
    for i in range(20):
        p = subprocess.Popen([sys.executable, helper, str(buf), f"k{i}", "100000", str(1 + i % 3), str(log)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # wait until this writer has flushed something, then kill it mid-stream
        start = time.time()
        while time.time() - start < 30:
            if any(n.startswith(f"w{i:06d}-") for n in os.listdir(buf / "shards")):
                break
            time.sleep(0.01)
        time.sleep(0.05 + 0.01 * (i % 5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += p.returncode == -signal.SIGKILL
        # no partial file is ever visible: every listed shard reads in full
        for shard in BufferDir(buf).live_shards():
            pq.read_table(shard)
    assert kills == 20
    flushed = log.read_text().split()
    rows = BufferSQL(buf).query("SELECT group_id, count(*) AS n FROM rollouts GROUP BY 1").to_pylist()
    counts = {r["group_id"]: r["n"] for r in rows}
    assert set(flushed) <= set(counts)  # every flushed (logged) group is there
    assert all(n == 8 for n in counts.values())  # exactly once, whole
    assert len(flushed) > 100
    # killed writers leave temp files behind at most; the next writer's open removes them
    from buffer import ShardWriter
    ShardWriter(buf).close()
    assert os.listdir(buf / "tmp") == []


def test_compaction_during_continuous_queries(tmp_path):
    buf = tmp_path / "buffer"
    BufferDir(buf, create=True)
    stop = tmp_path / "stop"
    reader = run_helper("reader_proc.py", str(buf), str(stop), "10")
    assert reader.stdout.readline().strip() == "ready"   # it queries during every compaction round below
    writer = run_helper("writer_proc.py", str(buf), "c", "600", "3", str(tmp_path / "log"))
    rounds = 0
    deadline = time.time() + 120
    while (writer.poll() is None or rounds < 10) and time.time() < deadline:   # while it writes, 10 rounds at least
        compact(buf, target_groups=64, min_age_s=0.0, grace_s=0.3)
        rounds += 1
        time.sleep(0.1)
    stop.touch()
    _, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    out, _ = reader.communicate(timeout=120)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["errors"] == 0 and r["wrong"] == 0, r
    assert rounds >= 10 and r["queries"] >= 10, (rounds, r)   # fewer: a deadline ended them
    time.sleep(0.4)
    report = compact(buf, target_groups=64, min_age_s=0.0, grace_s=0.3)
    (final,) = BufferSQL(buf).query("SELECT count(*) AS rows, count(DISTINCT group_id) AS groups "
                                    "FROM rollouts").to_pylist()
    assert final == {"rows": 600 * 8, "groups": 600}
    names = os.listdir(buf / "shards")
    assert any(n.startswith("c-") for n in names), names
    assert len(BufferDir(buf).live_shards()) < 600 // 3, report
