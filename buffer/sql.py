"""SQL over a buffer (or a run directory) with DuckDB, read-only.

Views, rebuilt from the manifest on every query so they follow the daemons:

    rollouts     one row per completion (every column of the rollout schema)
    groups       one row per group, with how often and when it was consumed
    consumed     the ledger: one row per (group, pull) by the trainer
    metrics      the trainer's per-step metrics (only when the run has written some)
    generator_metrics  one row per generator batch: wait_s, seconds, ... (idle share =
                 sum(wait_s) / sum(seconds); only when the run's generators have written some)
    quarantined  shards moved aside, with the reason
    archived_rollouts  the columns of rollouts, over the shards retention moved to
                 <buffer>/archive/shards/ (only when there are some; buffer/retention.py):
                 a shard is in exactly one of rollouts and archived_rollouts
    version_stats  one row per (version, filtered, filter_reason) of rollouts: groups,
                 completions, reward_sum; built from the shards' footer sums (buffer/stats.py),
                 so it costs a footer read per file instead of a scan of every row
    versions     one row per version of rollouts: groups, filtered_groups, completions,
                 reward_sum, reward_mean (= avg(reward) over the version's completions), the
                 same footer sums summed per version: "mean reward by version" is
                 `SELECT version, reward_mean FROM versions`, and its cost follows the live
                 files and the versions, not the rows.
                 Both are made only for a query that names one; where a footer cannot be used
                 they are the same sums over `rollouts`.

An empty buffer gives empty views, not an error. A user's query cannot change
anything on disk, by two guards: only SELECT statements (and EXPLAIN of one)
are accepted, and DuckDB's external access is switched off with only the live
files (and the archived shards) allowed and the configuration locked, so COPY,
ATTACH, EXPORT, INSTALL and table functions over any other path fail. DuckDB's
`allowed_paths` lets the listed files be written as well as read (COPY ... TO
a live shard with USE_TMP_FILE false succeeds on a bare connection), so for
those files the statement check is the one guard.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from buffer.layout import BufferDir, BufferError, find_buffer, run_file_set
from buffer.store import StoreError, read_table
from buffer.retention import archived_shards
from buffer.schema import LEDGER_SCHEMA, ROLLOUT_SCHEMA


class SqlError(BufferError):
    """A query was rejected or failed; the message is DuckDB's or ours."""


_DUCK_TYPES = {pa.string(): "VARCHAR", pa.int32(): "INTEGER", pa.int64(): "BIGINT",
               pa.float32(): "FLOAT", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN",
               pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ"}


def _duck_type(t: pa.DataType) -> str:
    if pa.types.is_map(t):
        return f"MAP({_duck_type(t.key_type)}, {_duck_type(t.item_type)})"
    if pa.types.is_list(t):
        return f"{_duck_type(t.value_type)}[]"
    return _DUCK_TYPES[t]


def _empty_select(schema: pa.Schema) -> str:
    cols = ", ".join(f"CAST(NULL AS {_duck_type(f.type)}) AS {f.name}" for f in schema)
    return f"SELECT {cols} WHERE false"


def _files_sql(files: list[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in files) + "]"


def _scan_sql(files: list[Path], schema: pa.Schema, union: bool) -> str:
    """The columns of `schema` from `files`.

    Every file the buffer writes has the full schema, so the files are read
    with the first file's layout: binding reads one footer, not all of them
    (union_by_name reads every footer at bind time and again at scan time:
    2.0 s against 0.6 s for an aggregate over 1,563 shards).
    A file of another schema (an older writer) makes DuckDB report a schema
    mismatch; the views are then rebuilt with union_by_name, where a column a
    file lacks reads as NULL.
    """
    cols = ", ".join(f'"{f.name}"' for f in schema)
    return f"SELECT {cols} FROM read_parquet({_files_sql(files)}{', union_by_name = true' if union else ''})"


_GROUPS_SQL = """
WITH uses AS (
    SELECT group_id, count(*) AS times_consumed, min(trainer_step) AS first_consumed_step,
           min(staleness) AS min_staleness_consumed, max(staleness) AS max_staleness_consumed
    FROM consumed GROUP BY group_id
)
SELECT r.group_id, any_value(r.task) AS task, any_value(r.prompt_id) AS prompt_id,
       any_value(r.prompt) AS prompt, any_value(r.version) AS version,
       any_value(r.generator_id) AS generator_id, min(r.created_at) AS created_at,
       any_value(r.group_size) AS group_size, count(*) AS num_completions,
       avg(r.reward) AS reward_mean, any_value(r.group_reward_std) AS reward_std,
       min(r.reward) AS reward_min, max(r.reward) AS reward_max,
       avg(CAST(r.correct AS DOUBLE)) AS accuracy, avg(r.num_tokens) AS mean_tokens,
       sum(r.num_tokens) AS total_tokens,
       avg(CAST(r.finish_reason = 'length' AS DOUBLE)) AS truncated_share,
       any_value(r.filtered) AS filtered, any_value(r.filter_reason) AS filter_reason,
       any_value(r.temperature) AS temperature,
       coalesce(any_value(u.times_consumed), 0) AS times_consumed,
       any_value(u.first_consumed_step) AS first_consumed_step,
       any_value(u.max_staleness_consumed) AS max_staleness_consumed
FROM rollouts r LEFT JOIN uses u USING (group_id)
GROUP BY r.group_id
"""

_ALLOWED = {duckdb.StatementType.SELECT}


def check_read_only(sql: str) -> None:
    """Raise SqlError unless every statement in `sql` is a SELECT (or EXPLAIN of one)."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise SqlError(_clean(e)) from None
    if not statements:
        raise SqlError("empty query")
    for st in statements:
        if st.type == duckdb.StatementType.EXPLAIN:
            inner = re.sub(r"^\s*explain\s+(analyze\s+)?", "", st.query, flags=re.IGNORECASE)
            check_read_only(inner)
            continue
        if st.type not in _ALLOWED:
            kind = str(st.type).rsplit(".", 1)[-1]
            raise SqlError(f"only SELECT queries are allowed on a buffer (got a {kind} statement: "
                           f"{st.query.strip()[:80]!r}); the buffer is read-only from SQL")


def _clean(e: Exception) -> str:
    """The error's first line; for an error that carries a Python traceback (a read through the object
    store's filesystem failed), its last line, which says what failed."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return lines[-1].strip() if "Traceback" in lines[0] or lines[0].rstrip().endswith("Traceback (most recent call last):") \
        else lines[0]


def offline_connection() -> duckdb.DuckDBPyConnection:
    """A fresh in-memory DuckDB connection that never installs or loads an extension (no network)."""
    return duckdb.connect(":memory:", config={"autoinstall_known_extensions": False,
                                              "autoload_known_extensions": False})


_STATS_NAME = re.compile(r"\b(version_stats|versions)\b", re.IGNORECASE)
# The same sums from the rows, where a footer cannot be used (the query then meets the bad file, which
# is quarantined and left out, as for any query).
_STATS_SCAN_SQL = """
SELECT version, coalesce(filtered, false) AS filtered, filter_reason,
       count(*) FILTER (WHERE sample_index = 0) AS groups,
       coalesce(sum(group_size) FILTER (WHERE sample_index = 0), 0) AS completions,
       coalesce(sum(group_reward_mean * group_size) FILTER (WHERE sample_index = 0), 0) AS reward_sum
FROM rollouts GROUP BY ALL
"""
# versions from version_stats, where the footers cannot be used (the fast path sums them in numpy instead).
_VERSIONS_SCAN_SQL = """
SELECT version, sum(groups)::BIGINT AS groups,
       coalesce(sum(groups) FILTER (WHERE filtered), 0)::BIGINT AS filtered_groups,
       sum(completions)::BIGINT AS completions, sum(reward_sum) AS reward_sum,
       sum(reward_sum) / sum(completions) AS reward_mean
FROM version_stats GROUP BY version
"""


def _version_stats(con: duckdb.DuckDBPyConnection, shards: list, versions: bool = True) -> None:
    """The version_stats view on `con` (whose rollouts view reads `shards`), over the footers' sums, and with
    `versions`, the versions view (its per-version sums are computed only for a query that names it)."""
    from buffer.stats import shard_table, shard_types, version_sums

    cells = shard_table(shards, con) if shards else shard_types().empty_table()
    if cells is None:
        con.execute(f"CREATE VIEW version_stats AS {_STATS_SCAN_SQL}")
        if versions:
            con.execute(f"CREATE VIEW versions AS {_VERSIONS_SCAN_SQL}")
        return
    if versions:   # a row per version, summed before the query: "mean reward by version" is then a projection
        con.register("_versions_cells", version_sums(cells))   # (over version_stats: a GROUP BY of a GROUP BY)
        con.execute("CREATE VIEW versions AS SELECT * FROM _versions_cells")
    # A view over the cells (an Arrow table held by the connection), not a table filled from them: a query
    # sums the cells itself, where an INSERT ... ORDER BY copied them into DuckDB's storage first (on the
    # synthetic soak's final buffer, 230,000 cells: "mean reward by version" 138-173 ms against 178-216).
    con.register("_version_stats_cells", cells)
    con.execute("CREATE VIEW version_stats AS SELECT version, filtered, nullif(filter_reason, '') AS filter_reason, "
                "sum(groups)::BIGINT AS groups, sum(completions)::BIGINT AS completions, sum(reward_sum) AS reward_sum "
                "FROM _version_stats_cells WHERE groups > 0 GROUP BY 1, 2, 3")


class BufferSQL:
    """Read-only DuckDB views over a buffer or run directory; see module doc."""

    def __init__(self, path: str | os.PathLike, *, quarantine: bool = True):
        self.buffer_root = find_buffer(path)
        self.dir = BufferDir(self.buffer_root)
        run = self.buffer_root.parent if self.buffer_root.name == "buffer" else None
        self.metrics_dir = run / "metrics" if run is not None and (run / "metrics").is_dir() else None
        gen = run / "generator_metrics" if run is not None else None
        self.generator_metrics_dir = gen if gen is not None and gen.is_dir() else None
        self.quarantine = quarantine
        self.skipped: dict[str, str] = {}  # unreadable files left out: name -> reason
        self._listed: list[Path] = []       # the files of the last connection's views
        self._union = False                 # shards of differing schemas seen: read them by name

    def _files(self) -> tuple[list[Path], list[Path], list[Path]]:
        """Rollout shards, ledger shards, and metrics files (the trainer's, then the generators')."""
        shards = [p for p in self.dir.live_shards() if p.name not in self.skipped]
        ledger = [p for p in self.dir.ledger_shards() if p.name not in self.skipped]
        metrics = run_file_set(self.metrics_dir, "metrics").live() if self.metrics_dir else []
        metrics += self._generator_metrics()
        metrics = [p for p in metrics if p.name not in self.skipped]
        return shards, ledger, metrics

    def _archived(self, shards: list[Path]) -> list[Path]:
        """Archived shards (buffer/retention.py) that are not among the live `shards`.

        Retention links a shard into the archive before its manifest write, and the
        live shards are listed first, so each shard is in exactly one of the two lists.
        """
        live = {p.name for p in shards}
        return [p for p in archived_shards(self.buffer_root) if p.name not in live and p.name not in self.skipped]

    def _generator_metrics(self) -> list[Path]:
        d = self.generator_metrics_dir
        return run_file_set(d, "generator_metrics").live() if d is not None else []

    def connect(self, *, stats: bool = False, versions: bool = True) -> duckdb.DuckDBPyConnection:
        """A fresh in-memory connection with the views over the current files, locked down; with
        `stats`, also the version_stats view and, with `versions`, the versions view (a footer read per
        shard)."""
        shards, ledger, metrics = self._files()
        archived = self._archived(shards)
        self._listed = shards + ledger + metrics + archived
        gen_metrics = [p for p in metrics if self.generator_metrics_dir is not None
                       and p.parent == self.generator_metrics_dir]
        metrics = [p for p in metrics if p not in gen_metrics]
        con = offline_connection()
        if self.dir.remote:   # read through fsspec: no httpfs extension to download
            self.dir.root.store.register(con)
        con.execute("SET allowed_paths = ?", [[str(p) for p in shards + ledger + metrics + gen_metrics + archived]])
        for name, files, schema in (("rollouts", shards, ROLLOUT_SCHEMA), ("consumed", ledger, LEDGER_SCHEMA),
                                    ("archived_rollouts", archived, ROLLOUT_SCHEMA)):
            if not files:
                if name != "archived_rollouts":   # like metrics: only when there are files
                    con.execute(f"CREATE VIEW {name} AS {_empty_select(schema)}")
                continue
            try:
                con.execute(f"CREATE VIEW {name} AS {_scan_sql(files, schema, self._union)}")
            except duckdb.BinderException:  # the first file lacks a column of the schema
                self._union = True
                con.execute(f"CREATE VIEW {name} AS {_scan_sql(files, schema, True)}")
        con.execute(f"CREATE VIEW groups AS {_GROUPS_SQL}")
        if metrics:
            con.execute(f"CREATE VIEW metrics AS SELECT * FROM read_parquet({_files_sql(metrics)}, "
                        "union_by_name = true)")
        if gen_metrics:
            con.execute("CREATE VIEW generator_metrics AS SELECT * FROM "
                        f"read_parquet({_files_sql(gen_metrics)}, union_by_name = true)")
        if stats:
            _version_stats(con, shards, versions)
        con.execute("CREATE TABLE quarantined (file VARCHAR, reason VARCHAR, quarantined_at DOUBLE)")
        q = self.dir.quarantined()
        if q:
            con.executemany("INSERT INTO quarantined VALUES (?, ?, ?)",
                            [(r.get("file"), r.get("reason"), r.get("quarantined_at")) for r in q])
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        return con

    def query(self, sql: str) -> pa.Table:
        """Run a read-only query on fresh views; unreadable shards are quarantined and left out."""
        with self.result(sql) as rows:
            return rows.to_arrow_table()

    @contextlib.contextmanager
    def result(self, sql: str) -> Iterator[duckdb.DuckDBPyRelation]:
        """The rows of a read-only query as a DuckDB relation, with DuckDB's own types, for the with-block.

        The query runs once, on fresh views, before the block (unreadable shards
        are quarantined and left out, as in `query`); the rows are held in memory,
        so reading the relation again reads no file. The connection closes after
        the block; a DuckDB error inside it becomes an SqlError.
        """
        check_read_only(sql)
        for _ in range(1000):
            con = None
            try:
                named = {m.lower() for m in _STATS_NAME.findall(sql)}   # binding reads every footer
                con = self.connect(stats=bool(named), versions="versions" in named)
                rel = con.sql(sql)
                if rel is None:
                    raise SqlError(f"the query returned nothing to show: {sql.strip()[:80]!r}")
                rows = rel.materialize()
            except BaseException as e:
                if con is not None:
                    con.close()
                if not isinstance(e, duckdb.Error):
                    raise
                if not self._union and "schema mismatch" in str(e):
                    self._union = True  # a shard of another schema: a whole file, not a bad one
                    continue
                if not self._handle_bad_file(e):
                    raise SqlError(_clean(e)) from None
                continue
            try:
                yield rows
            except duckdb.Error as e:
                raise SqlError(_clean(e)) from None
            finally:
                con.close()
            return
        raise SqlError("too many unreadable files")

    def _handle_bad_file(self, e: duckdb.Error) -> bool:
        """If the error is about one of our files, set it aside and return True (retry)."""
        msg = str(e)
        if any(str(p) in msg and not p.exists() for p in self._listed):
            return True  # moved after the listing (a trainer resume abandons ledger shards): list again
        if isinstance(e, (duckdb.PermissionException,)):
            return False
        shards, ledger, metrics = self._files()
        files = shards + ledger + metrics + self._archived(shards)
        named = [p for p in files if str(p) in msg]
        if not named and isinstance(e, (duckdb.IOException, duckdb.InvalidInputException)):
            named = [p for p in files if not _readable(p)]
            if not named and any(not p.exists() for p in files):
                return True  # a compacted-away file vanished: the next listing is current
        if not named:
            return False
        for p in named:
            if not p.exists():
                continue  # compaction deleted it after its grace period; relisting drops it
            if self.dir.remote and _readable(p):
                continue  # on an object store the error was the store's (a dropped connection): try again
            reason = f"unreadable in SQL: {_clean(e)}"
            moved = None
            if self.quarantine and p.parent == self.dir.shards:
                try:
                    moved = self.dir.quarantine(p, reason)
                except OSError:
                    moved = None
            if moved is None:
                self.skipped[p.name] = reason
                warnings.warn(f"left out unreadable file {p}: {reason}", stacklevel=3)
        return True


def _readable(p: Path) -> bool:
    try:
        read_table(p)
        return True
    except FileNotFoundError:
        return True
    except StoreError:   # the store unreachable: not a damaged file
        raise
    except Exception:  # noqa: BLE001
        return False
