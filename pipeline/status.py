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
function the sampler uses (`buffer.index.group_states`), applied per version
to each kind of group (not filtered and not used up, used up, filtered), so
status and sampling cannot disagree.

Old versions are summed per block instead: every merged file's footer also
sums its cells per block of SUMMARY_BLOCK (1,000) versions, and below the
versions whose state can still change (`_uniform_below`: the staleness
window's start, or without a limit the trainer's version) every version's
groups of one kind share a state, so a file whose versions all lie below it
is read by its blocks: what status decodes and sums stays about the same
however many versions a long run piles up. A block is one row, at its lowest
version present (with its highest); range widths from a block up are
multiples of it. Where ranges must be narrower (at most `max_ranges` blocks
hold a group), or one row per version is asked for, or a retention bound or a
quarantined shard means groups of a consumed version may be gone, everything
is summed per version.

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
from buffer.fileset import LEDGER_SUMMARY, SHARD_SUMMARY, SUMMARY_BLOCK
from buffer.layout import BufferDir, find_buffer, ledger_is_merged
from buffer.retention import archived_shards, newest_in_ledger, read_floor
from buffer.stats import Blocks, Unreadable, concat, footer_cells, shard_tables, version_index
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
class _Sums:
    """The fast path's sums per version, for the V versions that hold a group (ascending), each of shape
    (V,): groups, those of them not filtered (learnable) and of those the ones used up (consumed: used
    reuse times), completions and reward_sum of all the version's groups; and reasons: groups per filter
    reason code (0: not filtered), shape (len(FILTER_REASONS) + 1,)."""

    version: np.ndarray
    groups: np.ndarray
    learnable: np.ndarray
    consumed: np.ndarray
    completions: np.ndarray
    reward_sum: np.ndarray
    reasons: np.ndarray
    last: np.ndarray | None = None   # a row of a block of versions: its highest version (None: version)

    def __post_init__(self) -> None:
        if self.last is None:
            object.__setattr__(self, "last", self.version)


@dataclass(frozen=True)
class _Footers:
    """What _read_sql reads: the shards' cells per version (SHARD_SUMMARY columns) and the merged shards' Blocks
    (versions all below the bound asked for), the ledger's records that used a group up per group version
    (used_v, used_n, shapes (U,)) and the merged ledger files' Blocks."""

    cells: "pa.Table"
    blocks: list[Blocks]
    used_v: np.ndarray
    used_n: np.ndarray
    ledger_blocks: list[Blocks]


@dataclass(frozen=True)
class _Groups:
    """The careful path's groups (a GroupIndex's), each array of shape (N,), with the shards left out
    (name -> reason)."""

    version: np.ndarray
    reason: np.ndarray
    use_count: np.ndarray
    available: np.ndarray
    size: np.ndarray
    reward_sum: np.ndarray
    unreadable: dict[str, str]


@dataclass(frozen=True)
class _Tally:
    """A buffer's groups per version and state, for the V versions that hold a group (ascending), as
    layers: each (at, state, groups), shapes (M,), of M rows of groups in one state at version index `at`
    (None: M = V, row i at version i; groups None: one each); completions (V,) and reward_sum (V,);
    reasons: groups per filter reason code, shape (len(FILTER_REASONS) + 1,)."""

    version: np.ndarray
    layers: list[tuple[np.ndarray | None, np.ndarray, np.ndarray | None]]
    completions: np.ndarray
    reward_sum: np.ndarray
    reasons: np.ndarray
    last: np.ndarray | None = None   # (V,): each row's highest version (a block of versions); None: version

    def per_state(self, key: np.ndarray | None = None, n: int = 1) -> np.ndarray:
        """Groups per (key of the version, state), shape (n, len(STATE_NAMES)); key: shape (V,) in [0, n),
        None: all in one."""
        names = len(buffer.STATE_NAMES)
        out = np.zeros(n * names, np.int64)
        for at, state, groups in self.layers:
            k = state if key is None else (key if at is None else key[at]) * names + state
            out += _sums(k, groups, n * names)
        return out.reshape(n, names)


def _ledger_summaries(ledger: list[Path], blocks_below: int | None = None) \
        -> tuple[dict[str, np.ndarray], list[Path], list[Blocks]] | None:
    """The cells (LEDGER_SUMMARY columns: records per group version and use index) of the summaries merged
    ledger files carry in their footers (buffer.compaction.ledger_summary), the files without one, to
    scan (each pull's own small file, a resume's cut, an older merged file), and the Blocks of the merged
    files whose group versions are all below `blocks_below`; None: a footer failed to read."""
    parts, plain, blocks = [], [], []
    try:
        for p in ledger:
            cols = footer_cells(p, LEDGER_SUMMARY, "records", blocks_below=blocks_below) \
                if ledger_is_merged(p.name) else None
            if cols is None:
                plain.append(p)
            elif isinstance(cols, Blocks):
                blocks.append(cols)
            else:
                parts.append(cols)
    except Unreadable:
        return None
    return concat(parts, _LEDGER_DTYPES), plain, blocks


_LEDGER_DTYPES = dict(zip(LEDGER_SUMMARY, (np.int64, np.int64, np.int64)))


def _read_sql(shards: list[Path], ledger: list[Path], reuse: int, floor: int | None = None,
              blocks_below: int | None = None) -> _Footers | None:
    """The footers' cells and the ledger's records that used a group up; None if a file fails or a group is
    partial.

    floor: the retention bound (buffer.retention.read_floor): versions below it are counted by id.
    blocks_below: merged files whose versions are all below it give their sums per block (Blocks).
    """
    import duckdb

    con = buffer.offline_connection()
    remote = next((p for p in shards + ledger if isinstance(p, RemotePath)), None)
    if remote is not None:
        remote.store.register(con)
    try:
        found = shard_tables(shards, con, blocks_below)
        if found is None:
            return None
        table, blocks = found
        used_v, used_n = np.zeros(0, np.int64), np.zeros(0, np.int64)   # records that used a group up, per version
        ledger_blocks: list[Blocks] = []
        if ledger:
            low = -(2 ** 62) if floor is None else floor
            read = _ledger_summaries(ledger, blocks_below)
            if read is None:
                return None
            lc, plain, ledger_blocks = read
            used_v, used_n = _used_up(lc["use_index"], lc["group_version"], lc["records"], reuse, low)
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
    return _Footers(table, blocks, used_v, used_n, ledger_blocks)


def _summed(f: _Footers, reuse: int, blocks_below: int | None, max_ranges: int | None) -> _Sums:
    """The footers' sums per version, and below `blocks_below` (a multiple of SUMMARY_BLOCK) per block of
    versions: a row of a block stands at its lowest version present (`last`: its highest). Every version
    below the bound is in the same state, for each kind of group, so a block's sums give its states; and
    range widths from SUMMARY_BLOCK up are multiples of it, so a block falls in one range. When the
    versions present fill at most `max_ranges` blocks, ranges may be narrower than a block: then the
    blocks' own per-version cells are decoded and everything is summed per version."""
    table, blocks, used_v, used_n = f.cells, f.blocks, f.used_v, f.used_n
    if not blocks and not f.ledger_blocks:
        blocks_below = None      # every cell is per version anyway (a buffer written before blocks)
    elif max_ranges is None or _blocks_held(table, blocks) <= max_ranges:   # taken as blocks, needed per version
        import pyarrow as pa

        table = pa.concat_tables([table] + [b.cells(SHARD_SUMMARY).cast(table.schema) for b in blocks])
        for b in f.ledger_blocks:
            lc = b.cells(LEDGER_SUMMARY)
            v, n = _used_up(*(lc.column(k).to_numpy() for k in ("use_index", "group_version", "records")), reuse)
            used_v, used_n = np.concatenate([used_v, v]), np.concatenate([used_n, n])
        blocks, blocks_below = [], None
    version = table.column("version").to_numpy()   # int64: shard_table casts it
    reason = buffer.reason_codes(table.column("filter_reason"), table.column("filtered").to_numpy())
    sums = [table.column(k).to_numpy() for k in ("groups", "completions", "reward_sum")]
    if blocks_below is None:
        return _per_version(version, reason, *sums, used_v, used_n)
    old, old_used = version < blocks_below, used_v < blocks_below
    fine = _per_version(version[~old], reason[~old], *(a[~old] for a in sums), used_v[~old_used],
                        used_n[~old_used])
    coarse = _per_block(blocks, version[old], reason[old], [a[old] for a in sums], used_v[old_used],
                        used_n[old_used], f.ledger_blocks, reuse)
    return _Sums(*(np.concatenate([getattr(coarse, k), getattr(fine, k)])
                   for k in ("version", "groups", "learnable", "consumed", "completions", "reward_sum")),
                 coarse.reasons + fine.reasons, np.concatenate([coarse.last, fine.last]))


def _used_up(use_index: np.ndarray, version: np.ndarray, records: np.ndarray, reuse: int,
             low: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Of ledger cells (records per version or block and use index, shapes (L,)), those that used a group up
    for good (use index reuse - 1; with `low`, at versions from it): their versions (or blocks) and records."""
    keep = use_index == reuse - 1
    if low is not None:
        keep &= version >= low
    return version[keep].astype(np.int64), records[keep].astype(np.int64)


def _blocks_held(cells: "pa.Table", blocks: list[Blocks]) -> int:
    """How many blocks of versions hold a group, over the per-version cells and the Blocks."""
    held = [cells.column("version").to_numpy()[cells.column("groups").to_numpy() > 0] // SUMMARY_BLOCK]
    held += [b.table.column("block").to_numpy()[b.table.column("groups").to_numpy() > 0] for b in blocks]
    return len(np.unique(np.concatenate(held)))


def _per_block(blocks: list[Blocks], version: np.ndarray, reason: np.ndarray, sums: list[np.ndarray],
               used_v: np.ndarray, used_n: np.ndarray, ledger_blocks: list[Blocks], reuse: int) -> _Sums:
    """Sums per block of versions (see _summed) of the shards' Blocks and of the per-version cells (`version`
    and the rest, shapes (C,)) and records (used_v, used_n) below the bound, with the ledger's Blocks.
    A block's consumed groups are its records, at most its learnable groups."""
    import pyarrow as pa

    first, last = [version], [version]
    block, codes, parts = [version // SUMMARY_BLOCK], [reason], [[a] for a in sums]
    if blocks:
        t = pa.concat_tables([b.table for b in blocks])
        block.append(t.column("block").to_numpy().astype(np.int64))
        codes.append(buffer.reason_codes(t.column("filter_reason"), t.column("filtered").to_numpy()))
        for part, k in zip(parts, ("groups", "completions", "reward_sum")):
            part.append(t.column(k).to_numpy())
        first.append(t.column("first").to_numpy().astype(np.int64))
        last.append(t.column("last").to_numpy().astype(np.int64))
    used_b, used_k = [used_v // SUMMARY_BLOCK], [used_n]
    for b in ledger_blocks:
        v, n = _used_up(*(b.table.column(k).to_numpy() for k in ("use_index", "block", "records")), reuse)
        used_b.append(v)
        used_k.append(n)
    block, first, last = np.concatenate(block), np.concatenate(first), np.concatenate(last)
    sums_b = _per_version(block, np.concatenate(codes), *(np.concatenate(p) for p in parts),
                          np.concatenate(used_b), np.concatenate(used_k))
    n = len(sums_b.version)
    at = np.minimum(np.searchsorted(sums_b.version, block), max(n - 1, 0))
    held = sums_b.version[at] == block if n else np.zeros(len(block), np.bool_)   # not a block of empty cells
    lowest, highest = np.full(n, np.iinfo(np.int64).max), np.full(n, np.iinfo(np.int64).min)
    np.minimum.at(lowest, at[held], first[held])
    np.maximum.at(highest, at[held], last[held])
    return _Sums(lowest, *(getattr(sums_b, k) for k in ("groups", "learnable", "consumed", "completions",
                                                         "reward_sum", "reasons")), highest)


def _per_version(version: np.ndarray, reason: np.ndarray, groups: np.ndarray, completions: np.ndarray,
                 reward_sum: np.ndarray, used_v: np.ndarray, used_n: np.ndarray) -> _Sums:
    """The cells (each of shape (C,): per file, version and filter reason code) summed per version, with
    the ledger's records that used a group up (used_n of shape (U,), per group version used_v): a version's
    consumed groups are its records, at most its learnable groups (fewer only where groups are gone).

    The sums are bincounts over version_index's places (the 231,000 cells of a 100,000-version soak buffer
    in ~12 ms, where sorting them and doubling them into rows cost ~50 ms)."""
    codes = len(buffer.FILTER_REASONS) + 1
    versions, at = version_index(version)
    span = len(versions)
    if span and span == int(versions[-1]) - int(versions[0]) + 1:   # every version of the span
        known = (used_v >= versions[0]) & (used_v <= versions[-1])
        used = _sums(used_v[known] - versions[0], used_n[known], span)
    elif span:
        where = np.minimum(np.searchsorted(versions, used_v), span - 1)
        known = versions[where] == used_v
        used = _sums(where[known], used_n[known], span)
    else:
        used = np.zeros(0, np.int64)
    total = _sums(at, groups, span)
    learnable = _sums(at, np.where(reason == 0, groups, 0), span)
    np.minimum(used, learnable, out=used)
    present = total > 0
    sums = _Sums(versions, total, learnable, used, _sums(at, completions, span),
                 np.bincount(at, weights=reward_sum, minlength=span),
                 _sums(reason.astype(np.intp), groups, codes))
    if present.all():
        return sums
    return _Sums(*(a[present] for a in (versions, total, learnable, used, sums.completions, sums.reward_sum)),
                 sums.reasons)


def _read_index(root: Path) -> _Groups:
    """The careful path: a buffer.GroupIndex checks every shard and skips (does not move) bad ones."""
    index = buffer.GroupIndex(root, quarantine=False)
    size = index.group_size.view.astype(np.int64)
    return _Groups(index.version.view, index.reason.view, index.use_count.view, index.available.view, size,
                   index.reward_mean.view * size, dict(index.unreadable))


def _tally(g: _Sums | _Groups, trainer_version: int, max_staleness: int | None, reuse: int) -> _Tally:
    """Groups per version and state. The states come from the function the sampler uses
    (`buffer.group_states`): per group on the careful path; on the fast path per version for each of its
    three kinds of groups (learnable and not used up, used up, filtered), whose states differ only by
    version."""
    codes = len(buffer.FILTER_REASONS) + 1
    if isinstance(g, _Groups):
        versions, at = np.unique(g.version, return_inverse=True)
        states = buffer.group_states(g.version, g.reason, g.use_count, g.available, trainer_version,
                                     max_staleness, reuse)
        n = len(versions)
        return _Tally(versions, [(at, states, None)], _sums(at, g.size, n),
                      np.bincount(at, weights=g.reward_sum, minlength=n), _sums(g.reason.astype(np.intp), None, codes))
    v, n = g.version, len(g.version)
    zero, one = np.zeros(n, np.int8), np.ones(n, np.bool_)
    layers = []
    for reason, used, groups in ((zero, 0, g.learnable - g.consumed), (zero, reuse, g.consumed),
                                 (np.ones(n, np.int8), 0, g.groups - g.learnable)):
        state = buffer.group_states(v, reason, np.full(n, used), one, trainer_version, max_staleness, reuse)
        layers.append((None, state, groups))
    return _Tally(v, layers, g.completions, g.reward_sum, g.reasons, g.last)


def _uniform_below(trainer_version: int | None, max_staleness: int | None) -> int | None:
    """A multiple of SUMMARY_BLOCK below which every version's groups of one kind (learnable and not used up,
    used up, filtered) are in one state: expired (older than the staleness limit allows) or, without a
    limit, eligible (no newer than the trainer); None: the trainer's version is not known yet.

    The blocks below it are summed per block (status then does not grow with the versions of a long run),
    where a version's consumed groups, its records at most its learnable groups, become a block's: the
    two differ only where groups of a consumed version are gone, which is why a buffer with a retention
    bound or with quarantined shards is summed per version throughout."""
    if trainer_version is None:
        return None
    window = trainer_version + 1 if max_staleness is None else trainer_version - max_staleness
    return window // SUMMARY_BLOCK * SUMMARY_BLOCK


def range_width(versions: np.ndarray, max_rows: int) -> int:
    """Smallest round width w (1, 2, 5, 10, 20, 50, ...) such that at most `max_rows` of the
    ranges [k*w, (k+1)*w) hold one of `versions`."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    present = versions if _ascending(versions) else np.unique(versions)   # each width's ranges: its steps
    for power in itertools.count():
        for mantissa in (1, 2, 5):
            width = mantissa * 10 ** power
            keys = present // width
            if len(keys) <= max_rows or 1 + int(np.count_nonzero(keys[1:] != keys[:-1])) <= max_rows:
                return width


def _ascending(keys: np.ndarray) -> bool:
    return len(keys) < 2 or bool((keys[1:] >= keys[:-1]).all())


def _sums(at: np.ndarray, weights: np.ndarray | None, n: int) -> np.ndarray:
    """Sums of integer `weights` (None: ones) per key `at` in [0, n), shape (n,), int64 (bincount sums in
    float64: exact below 2**53)."""
    return np.bincount(at, weights=weights, minlength=n).astype(np.int64)


def weighted_counts(t: _Tally, *, by_version: bool) -> dict:
    """Groups per state, filtered per reason, admitted, and (by_version) states per version (nonzero only)."""
    names = buffer.STATE_NAMES
    per_state = t.per_state()[0]
    out = {"groups": int(per_state.sum()), **{name: int(per_state[i]) for i, name in enumerate(names)}}
    out["filtered_by_reason"] = {r: int(t.reasons[i + 1]) for i, r in enumerate(buffer.FILTER_REASONS)}
    out["admitted"] = out["groups"] - out["filtered"]
    if by_version:
        table = t.per_state(np.arange(len(t.version)), len(t.version))
        out["by_version"] = {int(v): {name: int(row[i]) for i, name in enumerate(names) if row[i]}
                             for v, row in zip(t.version, table)}
    return out


def version_ranges(t: _Tally, width: int) -> list[dict]:
    """One row per range of `width` versions holding a group, lowest first.

    first/last: lowest and highest version present in the range; groups, completions and
    each state: summed over the range; reward_mean: sum of rewards / completions over every
    completion of the range (groups weighted by their size); filtered_share: filtered / groups.
    """
    if not len(t.version):
        return []
    keys = t.version // width
    new = np.r_[True, keys[1:] != keys[:-1]]
    first = np.flatnonzero(new)                                                # (R,): each range's first
    last = np.r_[first[1:] - 1, len(keys) - 1]
    per_state = t.per_state(np.cumsum(new) - 1, len(first))                    # (R, states)
    completions = np.add.reduceat(t.completions, first)
    reward_sum = np.add.reduceat(t.reward_sum, first)
    names = buffer.STATE_NAMES
    filtered = names.index("filtered")
    groups = per_state.sum(axis=1)
    highest = t.version if t.last is None else t.last
    return [{"first": int(t.version[first[r]]), "last": int(highest[last[r]]), "groups": int(groups[r]),
             "completions": int(completions[r]), "reward_mean": float(reward_sum[r] / completions[r]),
             "filtered_share": float(per_state[r, filtered] / groups[r]),
             **{name: int(per_state[r, i]) for i, name in enumerate(names)}}
            for r in range(len(first))]


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
    quarantined = d.quarantined()
    floor = read_floor(root)
    t = trainer_version if trainer_version is not None else newest_in_ledger(ledger)
    below = _uniform_below(t, max_staleness) if floor is None and not quarantined \
        and max_ranges is not None else None
    read = _read_sql(shards, ledger, reuse, floor, below)
    g = _summed(read, reuse, below, max_ranges) if read is not None else _read_index(root)
    if t is None:
        t = int(g.version.max()) if len(g.version) else 0
    tally = _tally(g, t, max_staleness, reuse)
    counts = weighted_counts(tally, by_version=max_ranges is None)
    width = 1 if max_ranges is None else range_width(tally.version, max_ranges)

    def size(paths):
        total = 0
        for p in paths:
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    archived = archived_shards(root)   # a listing and a stat each: the archive is not read
    unreadable = g.unreadable if isinstance(g, _Groups) else {}
    return {
        "buffer": str(root),
        "trainer_version": t,
        "max_staleness": max_staleness,
        "reuse": reuse,
        **counts,
        "completions": int(tally.completions.sum()),
        "version_range_width": width,
        "version_ranges": version_ranges(tally, width),
        "files": {"shards": len(shards), "shard_bytes": size(shards),
                  "ledger": len(ledger), "ledger_bytes": size(ledger),
                  "quarantined": len(quarantined), "unreadable_now": len(unreadable)},
        "archive": {"files": len(archived), "bytes": size(archived)},
        "unreadable": unreadable,
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
