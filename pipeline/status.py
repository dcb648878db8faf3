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
from buffer.stats import Unreadable, concat, footer_cells, shard_table
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
        table = shard_table(shards, con)
        if table is None:
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
    reason = buffer.reason_codes(table.column("filter_reason"), table.column("filtered").to_numpy())
    version, reason, (weight, completions, reward_sum) = _per_version_and_reason(
        table.column("version").to_numpy(), reason,   # int64: shard_table casts to shard_types()
        [table.column(k).to_numpy() for k in ("groups", "completions", "reward_sum")])
    keep = weight > 0
    if not keep.all():
        version, reason, weight, completions, reward_sum = (a[keep] for a in (version, reason, weight,
                                                                              completions, reward_sum))
    if len(used_v):
        uv, _, (un,) = _per_version_and_reason(used_v, np.zeros(len(used_v), np.int8), [used_n])
        at = np.minimum(np.searchsorted(uv, version), len(uv) - 1)
        used = np.where(uv[at] == version, un[at], 0)
    else:
        used = 0
    consumed = np.where(reason == 0, np.minimum(used, weight), 0)   # one learnable cell per version
    # Each cell's groups not used up, with its completions and rewards, then (where some are) those used up
    # (consumed): rows in version order, no row of zeros.
    twice = consumed > 0
    at = np.repeat(np.arange(len(version)), 1 + twice)
    second = np.zeros(len(at), np.bool_)
    second[1:] = at[1:] == at[:-1]
    first = ~second
    rest = weight - consumed
    return _Rows(version[at], reason[at], np.where(second, reuse, 0), np.ones(len(at), np.bool_),
                 np.where(second, consumed[at], rest[at]), np.where(first, completions[at], 0),
                 np.where(first, reward_sum[at], 0.0), {})


def _per_version_and_reason(version: np.ndarray, reason: np.ndarray, sums: list[np.ndarray]):
    """Cells summed per (version, reason code): (versions, reasons, [sum of each of `sums`, in its dtype]),
    each of shape (K,), ascending by version then reason.

    The cells come from the files nearly in version order, so a stable argsort of their keys is cheap
    (1.2 ms for the 226,000 cells of the synthetic soak's final buffer, 100,000 versions; the whole sum
    12 ms) and leaves the rows sorted, which spares range_width and version_ranges a sort each.
    """
    codes = len(buffer.FILTER_REASONS) + 1
    if not len(version):
        return version, reason.astype(np.int8), [w[:0] for w in sums]
    lo = int(version.min())
    key = (version - lo) * codes + reason
    order = np.argsort(key, kind="stable")
    key = key[order]
    starts = np.flatnonzero(_run_starts(key))
    key = key[starts]
    return lo + key // codes, (key % codes).astype(np.int8), [np.add.reduceat(w[order], starts) for w in sums]


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
    present, _ = _runs(versions)   # sorted, so each width's ranges are counted by its steps, not a sort
    for power in itertools.count():
        for mantissa in (1, 2, 5):
            width = mantissa * 10 ** power
            keys = present // width
            if len(keys) <= max_rows or 1 + int(np.count_nonzero(keys[1:] != keys[:-1])) <= max_rows:
                return width


def _runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct keys, ascending; each key's index among them), shapes (K,) and (N,), of keys of shape
    (N,): from where they change when they ascend, as the fast path's rows do, else by unique() (which
    took 17 ms on 452,000 sorted rows of a 100,000-version buffer, this about 3 ms)."""
    if len(keys) > 1 and not (keys[1:] >= keys[:-1]).all():
        return np.unique(keys, return_inverse=True)
    new = _run_starts(keys)
    return keys[new], np.cumsum(new) - 1


def _run_starts(keys: np.ndarray) -> np.ndarray:
    """Whether each of `keys` (ascending, shape (N,)) starts a run of equal keys, shape (N,)."""
    new = np.ones(len(keys), np.bool_)
    np.not_equal(keys[1:], keys[:-1], out=new[1:])
    return new


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
        versions, at = _runs(g.version)
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
    version, weight, completions, reward_sum = g.version, g.weight, g.completions, g.reward_sum
    if not present.all():
        version, weight, completions, reward_sum, states = (a[present] for a in (version, weight, completions,
                                                                                 reward_sum, states))
    keys, at = _runs(version // width)                                                    # (R,), (N,)
    n = len(keys)
    groups = _sums(at, weight, n)
    completions = _sums(at, completions, n)
    reward_sum = np.bincount(at, weights=reward_sum, minlength=n)
    first = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(first, at, version)
    last = np.full(n, np.iinfo(np.int64).min)
    np.maximum.at(last, at, version)
    names = buffer.STATE_NAMES
    per_state = _sums(at * len(names) + states, weight, n * len(names)).reshape(n, len(names))
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
