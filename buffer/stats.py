"""Sums of a buffer's groups per (version, filter flag and reason), mostly without reading a row.

Every shard's footer carries these sums (the writer's shards as a few JSON cells, compaction's
c-files as a packed table; `buffer.fileset.read_summary`): groups, completions and the sum of their
rewards. A shard without one (written before summaries existed), or whose sums do not add up to its
rows, is read instead: one DuckDB scan of each group's first row, summed the same way. `asyncgrpo
status` counts states from these cells, and SQL's `version_stats` view sums them, so both
cost a footer read per file rather than a scan of every row.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from buffer.fileset import (LEDGER_BLOCKS, LEDGER_SUMMARY, SHARD_BLOCKS, SHARD_SUMMARY, SUMMARY_BLOCK,
                            read_summary, summary_columns, summary_table)
from buffer.store import StoreError, read_metadata

FOOTER_THREADS = 8
SHARD_DTYPES = dict(zip(SHARD_SUMMARY, (np.int64, np.bool_, object, np.int64, np.int64, np.float64)))

# Groups summed per (file, version, filter flag and reason), from each group's first row, with the
# file's rows: a file whose rows do not add up to its groups' sizes is refused (None).
CELLS_SQL = """
SELECT filename, version, coalesce(filtered, false) AS filtered, coalesce(filter_reason, '') AS filter_reason,
       count(*) FILTER (WHERE sample_index = 0) AS groups,
       coalesce(sum(group_size) FILTER (WHERE sample_index = 0), 0) AS completions,
       coalesce(sum(group_reward_mean * group_size) FILTER (WHERE sample_index = 0), 0) AS reward_sum,
       count(*) AS num_rows
FROM read_parquet($shards, filename = true) GROUP BY 1, 2, 3, 4
"""


class Unreadable(Exception):
    """A footer could not be read: the file is gone (merged meanwhile) or damaged."""


_BLOCKS = {SHARD_SUMMARY: SHARD_BLOCKS, LEDGER_SUMMARY: LEDGER_BLOCKS}


@dataclass(frozen=True)
class Blocks:
    """A merged file's cells summed per block of SUMMARY_BLOCK versions (fileset.read_summary), taken in place
    of its per-version cells: `table`, its block cells (SHARD_BLOCKS or LEDGER_BLOCKS columns); `summary`,
    the footer's summary, whose per-version cells `cells` decodes when a reader needs them after all."""

    table: "pa.Table"
    summary: dict

    def cells(self, names: tuple[str, ...]) -> "pa.Table":
        return summary_table(self.summary, names)


def footer_cells(p: Path, names: tuple[str, ...], count: str, *, arrow: bool = False,
                 blocks_below: int | None = None):
    """The columns of p's footer summary (a dict of numpy arrays; with `arrow`, a pyarrow Table for a merged
    file's packed summary) when its `count` column adds up to the file's rows, else None (the caller reads
    the rows); Unreadable when the footer cannot be read. A writer's shard has a few cells as JSON: a
    Table of its own, cast and summed in Arrow, cost more than its cells (shard_table joins them).
    blocks_below: a merged file whose versions are all below it gives its cells per block instead (Blocks),
    when its footer has them (their counts checked against the rows the same way)."""
    try:
        meta = read_metadata(p)
    except StoreError:   # the store unreachable: not a damaged file
        raise
    except Exception as e:  # noqa: BLE001 - gone or damaged: the careful path
        raise Unreadable(str(p)) from e
    summary = read_summary(meta)
    if summary is None or summary["rows"] != meta.num_rows:
        return None
    if blocks_below is not None and summary.get("block") == SUMMARY_BLOCK and "blocks" in summary \
            and summary.get("last") is not None and summary["last"] < blocks_below:
        import pyarrow.compute as pc

        t = summary_table(summary, _BLOCKS[names], "blocks")
        return Blocks(t, summary) if (pc.sum(t.column(count)).as_py() or 0) == meta.num_rows else None
    if arrow and "columns" in summary:
        import pyarrow.compute as pc

        t = summary_table(summary, names)
        total = pc.sum(t.column(count)).as_py() or 0
    else:
        t = summary_columns(summary, names)
        total = int(t[count].sum())
    return t if total == meta.num_rows else None


def concat(parts: list[dict[str, np.ndarray]], dtypes: dict) -> dict[str, np.ndarray]:
    return {k: np.concatenate([np.zeros(0, t)] + [p[k].astype(t) for p in parts]) for k, t in dtypes.items()}


def shard_summaries(shards: list[Path]) -> tuple[dict[str, np.ndarray], list[Path]] | None:
    """The cells (SHARD_SUMMARY columns, each of shape (C,)) of the summaries `shards` carry in their
    footers, and the shards without one, to scan; None: a footer failed to read."""
    try:
        found = read_footers(shards, SHARD_SUMMARY, "completions")
    except Unreadable:
        return None
    parts = [cols for cols in found if cols is not None]
    scan = [p for p, cols in zip(shards, found) if cols is None]   # older, or not adding up: read the rows
    return concat(parts, SHARD_DTYPES), scan


def read_footers(files: list[Path], names: tuple[str, ...], count: str, *, arrow: bool = False,
                 blocks_below: int | None = None) -> list:
    """footer_cells of each file, in order. On an object store by a few threads (each read is a request's
    round trip); local files one by one, since a local footer read is CPU work under the GIL: 8 threads
    took 1.1 s for 837 footers where one thread takes ~0.4 s (2 cores, a soak running beside it)."""
    from buffer.store import RemotePath

    def cells(p: Path):
        return footer_cells(p, names, count, arrow=arrow, blocks_below=blocks_below)

    if len(files) < 16 or not isinstance(files[0], RemotePath):
        return [cells(p) for p in files]
    with ThreadPoolExecutor(FOOTER_THREADS) as pool:
        return list(pool.map(cells, files))


def _scanned(scan: list[Path], con) -> dict[str, np.ndarray] | None:
    """The cells of shards without a usable footer summary, read by rows (CELLS_SQL); None when that
    fails or a file's rows do not add up to its groups."""
    import duckdb

    try:
        read = con.execute(CELLS_SQL, {"shards": [str(p) for p in scan]}).fetchnumpy()
    except duckdb.Error:
        return None
    _, file_at = np.unique(read["filename"], return_inverse=True)
    if not np.array_equal(np.bincount(file_at, weights=read["num_rows"]),
                          np.bincount(file_at, weights=read["completions"])):
        return None
    return {k: np.asarray(read[k]).astype(t) for k, t in SHARD_DTYPES.items()}


def shard_table(shards: list[Path], con) -> "pa.Table | None":
    """Every shard's cells as one Arrow table (SHARD_SUMMARY columns, a row per file and cell), kept in Arrow
    throughout: from its footer, or by a scan on the DuckDB connection `con` (which must be able to read
    the shards); None when a footer or a file cannot be read or a file's rows do not add up to its groups
    (status's careful path then names the bad file). SQL's version_stats aggregates it with DuckDB."""
    found = shard_tables(shards, con)
    return None if found is None else found[0]


def shard_tables(shards: list[Path], con, blocks_below: int | None = None) -> "tuple[pa.Table, list[Blocks]] | None":
    """shard_table's cells, and with `blocks_below`, the Blocks of the merged shards whose versions are all
    below it (their cells are then not in the table): `asyncgrpo status` sums the cells per version and the
    blocks per block (its filter reasons stay Arrow strings, never Python ones)."""
    import pyarrow as pa

    types = shard_types()

    try:
        found = read_footers(shards, SHARD_SUMMARY, "completions", arrow=True, blocks_below=blocks_below)
    except Unreadable:
        return None
    parts, small = [], []   # small: consecutive writers' shards' cells, one table each run (file order kept)
    blocks = [t for t in found if isinstance(t, Blocks)]
    for t in [t for t in found if not isinstance(t, Blocks)] + [None]:
        if isinstance(t, dict):
            small.append(t)
            continue
        if small:
            parts.append(pa.table(concat(small, SHARD_DTYPES), schema=types))
            small = []
        if t is not None:
            parts.append(t.cast(types))
    scan = [p for p, t in zip(shards, found) if t is None]
    if scan:
        read = _scanned(scan, con)
        if read is None:
            return None
        parts.append(pa.table(read).cast(types))
    return (pa.concat_tables(parts) if parts else types.empty_table()), blocks


def version_index(version: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The versions to sum cells over, ascending, and each cell's place among them (`at`, shape (C,)).

    Versions run nearly without gaps (one per trainer step), so a version's place is its offset from the
    lowest, over every version of that span; a `version` array sparser than that is indexed by unique()
    instead (only the versions present)."""
    lo = int(version.min()) if len(version) else 0
    span = int(version.max()) - lo + 1 if len(version) else 0
    if span <= 2 * len(version) + 1024:
        return lo + np.arange(span, dtype=np.int64), version - lo
    return np.unique(version, return_inverse=True)


def version_sums(cells: "pa.Table") -> "pa.Table":
    """shard_table's cells summed per version (version_sums_types' columns, a row per version with groups,
    in version order), for SQL's `versions` view: one row per version without a GROUP BY in the query.

    bincounts over version_index's places. Summing per version alone, with no flag or reason in the key, is what
    keeps it cheap: from the synthetic soak's first tenth's buffer (23,000 cells) to its final buffer
    (230,000 cells, 100,000 versions), this sum and "mean reward by version" over it grew by 8 ms, where
    the same question over version_stats (a GROUP BY over (version, flag, reason), then over version)
    grew by 35 ms (the cells given, medians of 9, at rest).
    """
    import pyarrow as pa

    if cells.num_rows == 0:
        return version_sums_types().empty_table()
    column = {n: cells.column(n).to_numpy() for n in ("version", "groups", "completions", "reward_sum")}
    groups = column["groups"]
    versions, at = version_index(column["version"])
    count = np.bincount(at, weights=groups, minlength=len(versions))
    present = np.flatnonzero(count)   # a cell without groups has no completions or reward either

    def summed(weights: np.ndarray) -> np.ndarray:
        return np.bincount(at, weights=weights, minlength=len(versions))[present]

    filtered = np.where(cells.column("filtered").to_numpy(zero_copy_only=False), groups, 0)
    completions, reward_sum = summed(column["completions"]), summed(column["reward_sum"])
    return pa.table([versions[present].astype(np.int64), count[present].astype(np.int64),
                     summed(filtered).astype(np.int64), completions.astype(np.int64), reward_sum,
                     reward_sum / completions], schema=version_sums_types())


def version_sums_types() -> "pa.Schema":
    """The Arrow types of the `versions` view's columns (version_sums)."""
    import pyarrow as pa

    return pa.schema([("version", pa.int64()), ("groups", pa.int64()), ("filtered_groups", pa.int64()),
                      ("completions", pa.int64()), ("reward_sum", pa.float64()), ("reward_mean", pa.float64())])


def shard_types() -> "pa.Schema":
    """The Arrow types of SHARD_SUMMARY's columns (pyarrow is imported on use: `--help` stays light)."""
    import pyarrow as pa

    return pa.schema([("version", pa.int64()), ("filtered", pa.bool_()), ("filter_reason", pa.string()),
                      ("groups", pa.int64()), ("completions", pa.int64()), ("reward_sum", pa.float64())])
