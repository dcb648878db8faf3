"""`asyncgrpo status`: what is in a buffer, per state and per range of versions.

The fast path reads no row of the shards: every shard's footer sums its
groups per (version, filter flag and reason): groups, completions, sum of
rewards (the writer and compaction put it there). Shards without one (written
before) are read by one DuckDB scan of each group's first row (sample_index =
0), summed the same way. The ledger's records that used a group up for good
(use_index = reuse - 1) are counted per group version: from the counts per
(group version, use index) in merged ledger files' footers, and by one scan of
the rest (each pull's own small file, a resume's cut file). Every group of a version has the same state but for filtered
and consumed, so these sums give every state: the states come from the
function the sampler uses (`buffer.index.group_states`), applied to the
summed rows, so status and sampling cannot disagree.

Each file's rows must add up to its groups' sizes; if they do not (a partial
group, or one split over files), or a file cannot be read, status falls back
to a `GroupIndex` (quarantine off), which names each bad shard and leaves it
out.

Versions are summarised in at most `max_ranges` ranges of a round width
(1, 2, 5, 10, 20, 50, ... versions, aligned to multiples of it): counts are
summed, the mean reward is weighted by completions and the filtered share by
groups. `max_ranges=None` gives one row per version (and `by_version`).

Status counts the hot buffer: shards that retention moved to
<buffer>/archive/shards/ (buffer/retention.py) are not in the counts; `archive`
gives their number and bytes, from a listing and a stat each (none is read).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import buffer
from buffer.fileset import LEDGER_SUMMARY
from buffer.layout import BufferDir, find_buffer, ledger_is_merged
from buffer.retention import archived_shards, newest_in_ledger, read_floor
from buffer.stats import Unreadable, concat, footer_cells, shard_cells
from buffer.store import RemotePath

DEFAULT_MAX_RANGES = 20

# Groups used for the reuse-th time (so consumed for good), per group version.
_CONSUMED_SQL = ("SELECT group_version, count(*) AS n FROM read_parquet($ledger) "
                 "WHERE use_index = $last AND group_version >= $floor GROUP BY 1")
# Below the retention bound a version's groups may be partly archived, partly live: count the live
# consumed ones by id (few: only shards that straddle the bound hold such groups; the version's
# row-group statistics skip the rest).
_CONSUMED_BELOW_SQL = """
SELECT s.version, count(*) AS n
FROM (SELECT group_id, version FROM read_parquet($shards) WHERE sample_index = 0 AND version < $floor) s
JOIN (SELECT DISTINCT group_id FROM read_parquet($ledger) WHERE use_index = $last AND group_version < $floor) l
USING (group_id) GROUP BY 1
"""


@dataclass(frozen=True)
class _Rows:
    """Groups of a buffer as rows of shape (N,) each: one group per row (the careful path) or a sum of
    groups of one version and state (the fast path), with the shards left out (name -> reason).

    weight: groups in the row; completions, reward_sum: their completions and the sum of their rewards.
    """

    version: np.ndarray
    reason: np.ndarray
    use_count: np.ndarray
    available: np.ndarray
    weight: np.ndarray
    completions: np.ndarray
    reward_sum: np.ndarray
    unreadable: dict[str, str]


def _ledger_summaries(ledger: list[Path]) -> tuple[dict[str, np.ndarray], list[Path]] | None:
    """The cells (LEDGER_SUMMARY columns: records per group version and use index) of the summaries merged
    ledger files carry in their footers (buffer.compaction.ledger_summary), and the files without one, to
    scan: each pull's own small file, a resume's cut, an older merged file; None: a footer failed to read."""
    parts, plain = [], []
    try:
        for p in ledger:
            cols = footer_cells(p, LEDGER_SUMMARY, "records") if ledger_is_merged(p.name) else None
            if cols is None:
                plain.append(p)
            else:
                parts.append(cols)
    except Unreadable:
        return None
    return concat(parts, _LEDGER_DTYPES), plain


_LEDGER_DTYPES = dict(zip(LEDGER_SUMMARY, (np.int64, np.int64, np.int64)))


def _read_sql(shards: list[Path], ledger: list[Path], reuse: int,
              floor: int | None = None) -> _Rows | None:
    """Summed rows; None if a file fails or a group is partial.

    floor: the retention bound (buffer.retention.read_floor): versions below it are counted by id.
    """
    import duckdb

    con = buffer.offline_connection()
    remote = next((p for p in shards + ledger if isinstance(p, RemotePath)), None)
    if remote is not None:
        remote.store.register(con)
    try:
        cells = shard_cells(shards, con)
        if cells is None:
            return None
        used_v, used_n = np.zeros(0, np.int64), np.zeros(0, np.int64)   # records that used a group up, per version
        if ledger:
            low = -(2 ** 62) if floor is None else floor
            found = _ledger_summaries(ledger)
            if found is None:
                return None
            lc, plain = found
            last = (lc["use_index"] == reuse - 1) & (lc["group_version"] >= low)
            used_v, used_n = lc["group_version"][last], lc["records"][last]
            queries = [(_CONSUMED_SQL, {"ledger": [str(p) for p in plain], "last": reuse - 1, "floor": low})] \
                if plain else []
            if floor is not None and shards:   # versions below the bound: by id (none of them counted above)
                queries.append((_CONSUMED_BELOW_SQL, {"shards": [str(p) for p in shards],
                                                      "ledger": [str(p) for p in ledger],
                                                      "last": reuse - 1, "floor": floor}))
            for sql, params in queries:
                got = con.execute(sql, params).fetchnumpy()
                used_v = np.concatenate([used_v, np.asarray(got[list(got)[0]], np.int64)])
                used_n = np.concatenate([used_n, np.asarray(got["n"], np.int64)])
    except duckdb.Error:
        return None
    finally:
        con.close()
    used_v, at = np.unique(used_v, return_inverse=True)
    used_n = np.bincount(at, weights=used_n, minlength=len(used_v)).astype(np.int64)
    keep = cells["groups"] > 0
    version = cells["version"][keep].astype(np.int64)
    reason = buffer.reason_codes(cells["filter_reason"][keep], cells["filtered"][keep])
    weight, completions = cells["groups"][keep].astype(np.int64), cells["completions"][keep].astype(np.int64)
    reward_sum = cells["reward_sum"][keep].astype(np.float64)
    consumed = _split_consumed(version, np.where(reason == 0, weight, 0), used_v, used_n)
    zero = np.zeros(len(version), np.int64)
    rows = _Rows(np.concatenate([version, version]), np.concatenate([reason, reason]),
                 np.concatenate([zero, zero + reuse]), np.ones(2 * len(version), np.bool_),
                 np.concatenate([weight - consumed, consumed]), np.concatenate([completions, zero]),
                 np.concatenate([reward_sum, zero.astype(np.float64)]), {})
    return rows


def _split_consumed(version: np.ndarray, learnable: np.ndarray, uv: np.ndarray, un: np.ndarray) -> np.ndarray:
    """Consumed groups per cell, shape (C,): each version uv[i]'s un[i] consumed groups (uv unique and
    ascending, shape (U,)) spread over its cells' learnable groups (`learnable`, shape (C,)) in order, none
    over a cell's count (all groups of a version share a state)."""
    if not len(uv) or not len(version):
        return np.zeros(len(version), np.int64)
    order = np.argsort(version, kind="stable")
    v, w = version[order], learnable[order]
    cum = np.cumsum(w)
    start = np.searchsorted(v, v, side="left")                 # first cell of each cell's version
    before = cum - w - np.where(start > 0, cum[start - 1], 0)  # learnable groups of earlier cells, same version
    at = np.clip(np.searchsorted(uv, v), 0, len(uv) - 1)
    n = np.where(uv[at] == v, un[at], 0)
    out = np.zeros(len(version), np.int64)
    out[order] = np.clip(n - before, 0, w)
    return out


def _read_index(root: Path) -> _Rows:
    """The careful path: a buffer.GroupIndex checks every shard and skips (does not move) bad ones."""
    index = buffer.GroupIndex(root, quarantine=False)
    size = index.group_size.view.astype(np.int64)
    rows = _Rows(index.version.view, index.reason.view, index.use_count.view, index.available.view,
                 np.ones(len(size), np.int64), size, index.reward_mean.view * size, dict(index.unreadable))
    return rows


def range_width(versions: np.ndarray, max_rows: int) -> int:
    """Smallest round width w (1, 2, 5, 10, 20, 50, ...) such that at most `max_rows` of the
    ranges [k*w, (k+1)*w) hold one of `versions`."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    present = np.unique(versions)   # sorted, so each width's ranges are counted by its steps, not a sort
    for power in itertools.count():
        for mantissa in (1, 2, 5):
            width = mantissa * 10 ** power
            keys = present // width
            if len(keys) <= max_rows or 1 + int(np.count_nonzero(keys[1:] != keys[:-1])) <= max_rows:
                return width


def _sums(at: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """Integer sums of `weights` per key `at` in [0, n)."""
    return np.rint(np.bincount(at, weights=weights, minlength=n)).astype(np.int64)


def weighted_counts(g: _Rows, states: np.ndarray, *, by_version: bool) -> dict:
    """Groups per state, filtered per reason, admitted, and (by_version) states per version (nonzero only)."""
    names = buffer.STATE_NAMES
    per_state = _sums(states, g.weight, len(names))
    reasons = _sums(g.reason.astype(np.int64), g.weight, len(buffer.FILTER_REASONS) + 1)
    out = {"groups": int(g.weight.sum()), **{name: int(per_state[i]) for i, name in enumerate(names)}}
    out["filtered_by_reason"] = {r: int(reasons[i + 1]) for i, r in enumerate(buffer.FILTER_REASONS)}
    out["admitted"] = out["groups"] - out["filtered"]
    if by_version:
        versions, at = np.unique(g.version, return_inverse=True)
        table = _sums(at * len(names) + states, g.weight, len(versions) * len(names)).reshape(len(versions), -1)
        out["by_version"] = {int(v): {name: int(row[i]) for i, name in enumerate(names) if row[i]}
                             for v, row in zip(versions, table)}
    return out


def version_ranges(g: _Rows, states: np.ndarray, width: int) -> list[dict]:
    """One row per range of `width` versions holding a group, lowest first.

    first/last: lowest and highest version present in the range; groups, completions and
    each state: summed over the range; reward_mean: sum of rewards / completions over every
    completion of the range (groups weighted by their size); filtered_share: filtered / groups.
    """
    present = (g.weight > 0) | (g.completions > 0)   # a row of consumed groups has weight, its twin the sums
    version, states = g.version[present], states[present]
    keys, at = np.unique(version // width, return_inverse=True)                          # (R,), (N,)
    n = len(keys)
    groups = _sums(at, g.weight[present], n)
    completions = _sums(at, g.completions[present], n)
    reward_sum = np.bincount(at, weights=g.reward_sum[present], minlength=n)
    first = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(first, at, version)
    last = np.full(n, np.iinfo(np.int64).min)
    np.maximum.at(last, at, version)
    names = buffer.STATE_NAMES
    per_state = _sums(at * len(names) + states, g.weight[present], n * len(names)).reshape(n, len(names))
    filtered = names.index("filtered")
    return [{"first": int(first[r]), "last": int(last[r]), "groups": int(groups[r]),
             "completions": int(completions[r]), "reward_mean": float(reward_sum[r] / completions[r]),
             "filtered_share": float(per_state[r, filtered] / groups[r]),
             **{name: int(per_state[r, i]) for i, name in enumerate(names)}}
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
    g = _read_sql(shards, ledger, reuse, read_floor(root)) or _read_index(root)
    newest = newest_in_ledger(ledger)
    t = trainer_version
    if t is None:
        t = newest if newest is not None else int(g.version.max()) if len(g.version) else 0
    states = buffer.group_states(g.version, g.reason, g.use_count, g.available, t, max_staleness, reuse)
    counts = weighted_counts(g, states, by_version=max_ranges is None)
    width = 1 if max_ranges is None else range_width(g.version[g.weight > 0], max_ranges)

    def size(paths):
        total = 0
        for p in paths:
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    quarantined = d.quarantined()
    archived = archived_shards(root)   # a listing and a stat each: the archive is not read
    return {
        "buffer": str(root),
        "trainer_version": t,
        "max_staleness": max_staleness,
        "reuse": reuse,
        **counts,
        "completions": int(g.completions.sum()),
        "version_range_width": width,
        "version_ranges": version_ranges(g, states, width),
        "files": {"shards": len(shards), "shard_bytes": size(shards),
                  "ledger": len(ledger), "ledger_bytes": size(ledger),
                  "quarantined": len(quarantined), "unreadable_now": len(g.unreadable)},
        "archive": {"files": len(archived), "bytes": size(archived)},
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
    a = r["archive"]
    if a["files"]:   # retention (compactor.keep_versions) moved shards there: not in the counts below
        c.print(f"archive: {a['files']} shards ({_human_bytes(a['bytes'])}) in archive/shards/, not counted "
                "here (SQL: archived_rollouts)")
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
