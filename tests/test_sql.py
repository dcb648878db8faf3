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
    pq.write_table(pa.table({"step": [1], "loss": [0.5]}), run / "metrics" / "steps-000000001-000000001.parquet")
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



@pytest.mark.parametrize("old_first", [True, False])
def test_shard_of_an_older_schema_is_read_not_quarantined(buf, old_first):
    """A shard lacking a column (an older writer) switches the views to union_by_name: its rows read
    with NULL there, nothing is quarantined, whether it comes first (bind) or later (scan)."""
    with ShardWriter(buf, flush_groups=1, flush_seconds=None) as w:
        for i in range(2):
            w.append(make_group(i, [1, 0], prompt_id=f"p{i}"))
    old = pq.read_table(w.shards_written[0]).drop(["top_k", "writer_id"])
    w.shards_written[0].unlink()
    pq.write_table(old, buf / "shards" / ("a-old.parquet" if old_first else "z-old.parquet"))
    db = BufferSQL(buf)
    rows = db.query("SELECT prompt_id, top_k IS NULL AS no_k, writer_id FROM rollouts "
                    "ORDER BY prompt_id").to_pylist()
    assert [r["prompt_id"] for r in rows] == ["p0", "p0", "p1", "p1"]
    assert [r["writer_id"] for r in rows] == [None, None, w.writer_id, w.writer_id]
    assert db.query("SELECT count(*) AS n FROM quarantined").to_pylist() == [{"n": 0}]
    assert not any((buf / "quarantine").iterdir())

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


def _listing(root):
    """Every file and folder under `root` with its size and modification time."""
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


# Through `asyncgrpo sql`, as a user would try: none may create, change or delete a file.
ATTACKS = [
    "COPY rollouts TO '{run}/buffer/shards/w999999-000000.parquet'",
    "COPY (SELECT 1 AS a) TO '{shard}' (FORMAT parquet, USE_TMP_FILE false)",
    "COPY consumed TO '{outside}/ledger.csv'",
    "COPY (SELECT 1) TO '{run}/metrics/steps-000000001-000000001.parquet'",
    "EXPORT DATABASE '{run}/export'",
    "IMPORT DATABASE '{run}'",
    "ATTACH '{run}/evil.duckdb' AS e",
    "ATTACH '{shard}' AS s",
    "DETACH memory",
    "CREATE TABLE t AS SELECT * FROM read_parquet('{shard}')",
    "CREATE TABLE t AS SELECT * FROM read_csv('{run}/config.toml')",
    "CREATE OR REPLACE VIEW rollouts AS SELECT 1",
    "INSERT INTO quarantined VALUES ('{shard}', 'x', 0)",
    "UPDATE quarantined SET reason = 'x'",
    "DELETE FROM quarantined",
    "DROP VIEW consumed",
    "INSTALL httpfs",
    "FORCE INSTALL httpfs",
    "LOAD '{outside}/evil.duckdb_extension'",
    "PRAGMA enable_profiling = 'json'",
    "SET profiling_output = '{run}/profile.json'",
    "SET enable_external_access = true",
    "RESET allowed_paths",
    "CHECKPOINT",
    "VACUUM",
    "BEGIN TRANSACTION",
    "CALL enable_logging()",
    "CREATE SECRET s (TYPE s3)",
    "SELECT 1; COPY rollouts TO '{run}/x.csv'",
    "SELECT 1 /* ; */; DROP VIEW rollouts",
    "SELECT * FROM query('COPY rollouts TO ''{outside}/q.csv''')",
    "SELECT * FROM read_text('{run}/config.toml')",
    "SELECT * FROM glob('{run}/**')",
    "SELECT * FROM read_parquet('{run}/buffer/ledger/abandoned/*.parquet')",
]


@pytest.mark.parametrize("query", ATTACKS)
def test_cli_queries_cannot_change_the_run(filled, tmp_path, query):
    from conftest import run_cli

    (filled / "config.toml").write_text("[run]\n")
    outside = tmp_path / "outside"
    shard = next((filled / "buffer" / "shards").iterdir())
    before = _listing(filled)
    r = run_cli("sql", str(filled), query.format(run=filled, shard=shard, outside=outside))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("asyncgrpo: error: ") and "Traceback" not in r.stderr
    assert ("only SELECT queries are allowed" in r.stderr or "disabled by configuration" in r.stderr
            or "Expected a single SELECT statement" in r.stderr), r.stderr
    assert _listing(filled) == before and not outside.exists()


def test_connection_refuses_new_files_and_settings_even_without_the_statement_check(filled, tmp_path):
    """The second guard: external access off (only the live files readable), configuration locked.
    DuckDB's allowed_paths also lets the listed files be written, so for those the statement check
    above is the guard (tested by test_writes_are_rejected and the CLI table)."""
    import duckdb

    con = BufferSQL(filled).connect()
    before = _listing(filled)
    for q in [f"COPY rollouts TO '{filled}/new.parquet'", f"COPY rollouts TO '{tmp_path}/out.csv'",
              f"ATTACH '{filled}/x.duckdb'", f"EXPORT DATABASE '{filled}/exp'", "INSTALL httpfs"]:
        with pytest.raises(duckdb.PermissionException, match="disabled by configuration"):
            con.execute(q)
    for q in ["SET enable_external_access = true", "SET lock_configuration = false",
              f"SET allowed_paths = ['{filled}']", f"SET allowed_directories = ['{filled}']"]:
        with pytest.raises(duckdb.InvalidInputException, match="the configuration has been locked"):
            con.execute(q)
    con.close()
    assert _listing(filled) == before and not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize("query", ["SELECT count(*) n FROM consumed", "SELECT count(*) n FROM groups"])
def test_a_ledger_shard_moved_after_listing_is_listed_again(filled, monkeypatch, query):
    """A trainer resume moves ledger shards to ledger/abandoned/ while a query binds: retry, not fail."""
    db = BufferSQL(filled)
    real = db._files
    calls = []

    def files_then_one_gone():
        shards, ledger, metrics = real()
        calls.append(1)
        if len(calls) == 1:   # the first listing still names a shard that is gone by the read
            ledger = ledger + [filled / "buffer" / "ledger" / "step-000000099-0000.parquet"]
        return shards, ledger, metrics

    monkeypatch.setattr(db, "_files", files_then_one_gone)
    expected = {"SELECT count(*) n FROM consumed": 2, "SELECT count(*) n FROM groups": 5}[query]
    assert db.query(query).to_pylist() == [{"n": expected}]
    assert len(calls) >= 2
