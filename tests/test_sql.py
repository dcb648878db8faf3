"""The SQL views, and that a user's query cannot change anything on disk."""

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from buffer import ROLLOUT_SCHEMA, BufferSQL, Sampler, ShardWriter, SqlError, check_read_only
from conftest import make_group


def _tree_digest(root):
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "buffer.lock":
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def filled(tmp_path):
    run = tmp_path / "run"
    buf = run / "buffer"
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:
        for i in range(5):
            rewards = [1, 1, 1, 1] if i == 0 else [1, 0, 0, 0]
            w.append(make_group(i % 2, rewards, prompt_id=f"p{i}", seed=i, correct=rewards))
    with Sampler(buf) as s:
        s.pull(2, trainer_version=1, trainer_step=1, max_staleness=None)
    (run / "metrics").mkdir()
    pq.write_table(pa.table({"step": [1], "loss": [0.5]}), run / "metrics" / "m-000001.parquet")
    return run


def test_views(filled):
    db = BufferSQL(filled)
    assert db.query("SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 20}]
    g = db.query("SELECT prompt_id, version, filtered, filter_reason, num_completions, reward_mean, "
                 "accuracy, times_consumed FROM groups ORDER BY prompt_id").to_pylist()
    assert g[0] == {"prompt_id": "p0", "version": 0, "filtered": True, "filter_reason": "all_correct",
                    "num_completions": 4, "reward_mean": 1.0, "accuracy": 1.0, "times_consumed": 0}
    # oldest-first: version 0 before 1, so p2 and p4 (p0 is filtered)
    assert [r["times_consumed"] for r in g] == [0, 0, 1, 0, 1]
    assert g[1]["reward_mean"] == 0.25
    assert db.query("SELECT CAST(sum(staleness) AS BIGINT) AS s, count(*) AS n FROM consumed").to_pylist() == [{"s": 2, "n": 2}]
    assert db.query("SELECT loss FROM metrics").to_pylist() == [{"loss": 0.5}]


def test_empty_buffer_gives_empty_views(buf):
    ShardWriter(buf).close()
    db = BufferSQL(buf)
    for view in ("rollouts", "groups", "consumed", "quarantined"):
        assert db.query(f"SELECT count(*) AS n FROM {view}").to_pylist() == [{"n": 0}]
    cols = db.query("SELECT * FROM rollouts").column_names
    assert cols == ROLLOUT_SCHEMA.names


@pytest.mark.parametrize("query", [
    "COPY rollouts TO '{run}/buffer/shards/evil.parquet'",
    "COPY (SELECT 1 AS a) TO '{shard}' (USE_TMP_FILE false)",
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{run}/x.csv'",
    "ATTACH '{run}/evil.duckdb' AS e",
    "EXPORT DATABASE '{run}/export'",
    "CREATE TABLE t AS SELECT 1",
    "INSERT INTO quarantined VALUES ('a', 'b', 0)",
    "DROP VIEW rollouts",
    "SET enable_external_access = true",
    "INSTALL httpfs",
    "LOAD parquet",
    "CALL pragma_version()",
    "SELECT 1; COPY rollouts TO '{run}/y.csv'",
    "PRAGMA enable_profiling",
])
def test_writes_are_rejected(filled, query):
    shard = next((filled / "buffer" / "shards").iterdir())
    before = _tree_digest(filled)
    with pytest.raises(SqlError, match="only SELECT queries are allowed"):
        BufferSQL(filled).query(query.format(run=filled, shard=shard))
    assert _tree_digest(filled) == before


@pytest.mark.parametrize("query", [
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM glob('{run}/*')",
    "SELECT * FROM read_parquet('/tmp/*.parquet')",
])
def test_other_paths_are_unreadable(filled, query):
    with pytest.raises(SqlError, match="disabled by configuration"):
        BufferSQL(filled).query(query.format(run=filled))


def test_explain_of_select_and_describe_are_allowed(filled):
    check_read_only("EXPLAIN SELECT 1")
    check_read_only("DESCRIBE rollouts; SHOW TABLES")
    names = BufferSQL(filled).query("SHOW TABLES").column("name").to_pylist()
    assert set(names) >= {"rollouts", "groups", "consumed", "metrics", "quarantined"}


def test_bad_sql_message(filled):
    with pytest.raises(SqlError, match="syntax error"):
        BufferSQL(filled).query("SELEC 1")
    with pytest.raises(SqlError, match="nosuchcol"):
        BufferSQL(filled).query("SELECT nosuchcol FROM rollouts")
