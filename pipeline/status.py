"""`asyncgrpo status`: what is in a buffer, per state and per range of versions.

One DuckDB query reads the per-group columns of every live shard (version,
size, filter flag and reason, mean reward: no token or text columns) and joins
the ledger's use counts; the states come from the function the sampler uses
(`buffer.index.group_states`), so status and sampling cannot disagree.

The query checks that every group's `group_size` rows are contiguous in one
file, as the writer puts them; if one is not, or a file cannot be read, status falls back to a `GroupIndex`
(quarantine off), which names each bad shard and leaves it out.

Versions are summarised in at most `max_ranges` ranges of a round width
(1, 2, 5, 10, 20, 50, ... versions, aligned to multiples of it): counts are
summed, the mean reward is weighted by completions and the filtered share by
groups. `max_ranges=None` gives one row per version.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import buffer
from buffer.layout import BufferDir, find_buffer

if TYPE_CHECKING:
    import duckdb

DEFAULT_MAX_RANGES = 20

# One row per group: its version, the rows (completions) found of it, the columns its
# state needs, and its uses in the ledger. {uses_from}: the ledger files, or no rows.
_GROUPS_SQL = """
WITH uses AS (SELECT group_id, count(*) AS uses FROM {uses_from} GROUP BY group_id),
groups AS (
    SELECT group_id, any_value(version) AS version, count(*) AS num_rows, any_value(group_size) AS group_size,
           any_value(filtered) AS filtered, coalesce(any_value(filter_reason), '') AS filter_reason,
           any_value(group_reward_mean) AS reward_mean, count(DISTINCT filename) AS files,
           max(file_row_number) - min(file_row_number) + 1 AS row_span
    FROM read_parquet($shards, filename = true, file_row_number = true) GROUP BY group_id
)
SELECT g.version, g.num_rows, g.group_size, g.filtered, g.filter_reason, g.reward_mean, g.files, g.row_span,
       coalesce(u.uses, 0) AS uses
FROM groups g LEFT JOIN uses u USING (group_id)
"""
_NO_LEDGER = "(SELECT NULL::VARCHAR AS group_id WHERE false)"


@dataclass(frozen=True)
class _Groups:
    """Per-group arrays of a buffer, shape (N,) each, and the shards left out (name -> reason)."""

    version: np.ndarray
    reason: np.ndarray
    group_size: np.ndarray
    reward_mean: np.ndarray
    use_count: np.ndarray
    available: np.ndarray
    unreadable: dict[str, str]


def _newest_trainer_version(con: duckdb.DuckDBPyConnection, ledger: list[Path]) -> int | None:
    """The newest trainer version in the newest ledger shard; None without a ledger."""
    if not ledger:
        return None
    newest = con.execute("SELECT max(trainer_version) FROM read_parquet(?)", [str(ledger[-1])]).fetchone()[0]
    return int(newest)


def _read_sql(shards: list[Path], ledger: list[Path]) -> tuple[_Groups, int | None] | None:
    """Groups and the newest trainer version, read by DuckDB; None if a file fails or a group is partial."""
    import duckdb

    con = buffer.offline_connection()
    try:
        newest = _newest_trainer_version(con, ledger)
        if not shards:
            none = np.zeros(0, np.int64)
            return _Groups(none, none.astype(np.int8), none, none.astype(np.float64), none,
                           none.astype(np.bool_), {}), newest
        sql = _GROUPS_SQL.format(uses_from="read_parquet($ledger)" if ledger else _NO_LEDGER)
        params = {"shards": [str(p) for p in shards]}
        if ledger:
            params["ledger"] = [str(p) for p in ledger]
        cols = con.execute(sql, params).fetchnumpy()
    except duckdb.Error:
        return None
    finally:
        con.close()
    whole = (cols["num_rows"] == cols["group_size"]) & (cols["files"] == 1) & (cols["row_span"] == cols["num_rows"])
    if not whole.all():  # a group partial, split over files or not contiguous: the index decides
        return None
    groups = _Groups(cols["version"], buffer.reason_codes(cols["filter_reason"].tolist(), cols["filtered"]),
                     cols["group_size"], cols["reward_mean"], cols["uses"],
                     np.ones(len(cols["version"]), np.bool_), {})
    return groups, newest


def _read_index(root: Path, ledger: list[Path]) -> tuple[_Groups, int | None]:
    """The careful path: a buffer.GroupIndex checks every shard and skips (does not move) bad ones."""
    index = buffer.GroupIndex(root, quarantine=False)
    groups = _Groups(index.version.view, index.reason.view, index.group_size.view, index.reward_mean.view,
                     index.use_count.view, index.available.view, dict(index.unreadable))
    con = buffer.offline_connection()
    try:
        return groups, _newest_trainer_version(con, ledger)
    finally:
        con.close()


def range_width(versions: np.ndarray, max_rows: int) -> int:
    """Smallest round width w (1, 2, 5, 10, 20, 50, ...) such that at most `max_rows` of the
    ranges [k*w, (k+1)*w) hold one of `versions`."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    present = np.unique(versions)
    for power in itertools.count():
        for mantissa in (1, 2, 5):
            width = mantissa * 10 ** power
            if len(np.unique(present // width)) <= max_rows:
                return width


def version_ranges(g: _Groups, states: np.ndarray, width: int) -> list[dict]:
    """One row per range of `width` versions holding a group, lowest first.

    first/last: lowest and highest version present in the range; groups, completions and
    each state: summed over the range; reward_mean: sum of rewards / completions over every
    completion of the range (groups weighted by their size); filtered_share: filtered / groups.
    """
    keys, at = np.unique(g.version // width, return_inverse=True)                        # (R,), (N,)
    n = len(keys)
    groups = np.bincount(at, minlength=n)
    completions = np.bincount(at, weights=g.group_size, minlength=n)
    reward_sum = np.bincount(at, weights=g.reward_mean * g.group_size, minlength=n)
    first = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(first, at, g.version)
    last = np.full(n, np.iinfo(np.int64).min)
    np.maximum.at(last, at, g.version)
    per_state = np.bincount(at * len(buffer.STATE_NAMES) + states, minlength=n * len(buffer.STATE_NAMES))
    per_state = per_state.reshape(n, len(buffer.STATE_NAMES))                                    # (R, states)
    filtered = buffer.STATE_NAMES.index("filtered")
    return [{"first": int(first[r]), "last": int(last[r]), "groups": int(groups[r]),
             "completions": int(completions[r]), "reward_mean": float(reward_sum[r] / completions[r]),
             "filtered_share": float(per_state[r, filtered] / groups[r]),
             **{name: int(per_state[r, i]) for i, name in enumerate(buffer.STATE_NAMES)}}
            for r in range(n)]


def buffer_status(path: str | os.PathLike, *, trainer_version: int | None = None,
                  max_staleness: int | None = None, reuse: int = 1,
                  max_ranges: int | None = DEFAULT_MAX_RANGES) -> dict:
    """Counts per state, per version and per range of versions, and the buffer's files.

    max_ranges: most rows of `version_ranges` (None: one row per version).
    trainer_version: None means the newest in the ledger, else the newest group version, else 0.
    """
    root = find_buffer(path)
    d = BufferDir(root)
    shards = d.live_shards()
    ledger = d.ledger_shards()
    g, newest = _read_sql(shards, ledger) or _read_index(root, ledger)
    t = trainer_version
    if t is None:
        t = newest if newest is not None else int(g.version.max()) if len(g.version) else 0
    states = buffer.group_states(g.version, g.reason, g.use_count, g.available, t, max_staleness, reuse)
    counts = buffer.state_counts(states, g.reason, g.version)
    width = 1 if max_ranges is None else range_width(g.version, max_ranges)

    def size(paths):
        total = 0
        for p in paths:
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    quarantined = d.quarantined()
    return {
        "buffer": str(root),
        "trainer_version": t,
        "max_staleness": max_staleness,
        "reuse": reuse,
        **counts,
        "completions": int(g.group_size.sum()),
        "version_range_width": width,
        "version_ranges": version_ranges(g, states, width),
        "files": {"shards": len(shards), "shard_bytes": size(shards),
                  "ledger": len(ledger), "ledger_bytes": size(ledger),
                  "quarantined": len(quarantined), "unreadable_now": len(g.unreadable)},
        "unreadable": g.unreadable,
        "quarantined": quarantined,
    }


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def print_status(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    limit = "unlimited" if r["max_staleness"] is None else r["max_staleness"]
    c.print(f"[bold]{r['buffer']}[/bold]  trainer version {r['trainer_version']}, "
            f"max staleness {limit}, reuse {r['reuse']}")
    f = r["files"]
    c.print(f"{r['groups']} groups, {r['completions']} completions in {f['shards']} shards "
            f"({_human_bytes(f['shard_bytes'])}); ledger {f['ledger']} files "
            f"({_human_bytes(f['ledger_bytes'])}); quarantined {f['quarantined']}")
    t = Table("state", "groups", title="groups per state")
    for s in buffer.STATE_NAMES:
        t.add_row(s, str(r[s]))
    for reason, n in r["filtered_by_reason"].items():
        t.add_row(f"  filtered: {reason}", str(n))
    c.print(t)
    rows = r["version_ranges"]
    if rows:
        t = _versions_table(rows, r["version_range_width"])
        if not c.is_terminal:  # a pipe or a file: whole rows, not cells cut to 80 columns
            c.width = max(c.width, c.measure(t, options=c.options.update(max_width=1 << 16)).maximum)
        c.print(t)
    for name, reason in r["unreadable"].items():
        c.print(f"[red]unreadable[/red] {name}: {reason}")
    for q in r["quarantined"]:
        c.print(f"[yellow]quarantined[/yellow] {q.get('file')}: {q.get('reason')}")


def _versions_table(rows: list[dict], width: int):
    """One row per range; all-zero states are left out (the state table has them), so that the
    usual four (eligible, consumed, filtered, expired) fit 80 columns."""
    from rich import box
    from rich.table import Table

    shown = [s for s in buffer.STATE_NAMES if any(row[s] for row in rows)]
    title = ("groups per version" if width == 1 else
             f"groups per version, in ranges of {width} (--versions: every version)")
    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    t.add_column("version" if width == 1 else "versions", no_wrap=True)
    for header in ("groups", "completions", "mean\nreward", *(f"{s}\n(share)" if s == "filtered" else s
                                                             for s in shown)):
        t.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        span = str(row["first"]) if row["first"] == row["last"] else f"{row['first']}-{row['last']}"
        cells = [f"{row[s]} ({row['filtered_share']:.0%})" if s == "filtered" else str(row[s]) for s in shown]
        t.add_row(span, str(row["groups"]), str(row["completions"]), f"{row['reward_mean']:.3f}", *cells)
    return t
