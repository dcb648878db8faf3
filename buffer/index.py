"""An in-memory index of every group in a buffer and how often it was consumed.

The index reads only small scalar columns of each shard, once (shards never
change), and each ledger file once; `refresh` picks up what appeared since the
last call and follows compaction (a group that moved to a c-file keeps its
state, and is found there from the c-file's footer when the index read its
source; a merged ledger file counts only the records of sources not read
before). It gives group states and counts without scanning token columns, so a
pull costs the same at 10,000 groups as at 100,000.

Uses are read idempotently: a ledger record carries the number of earlier
uses of its group (`use_index`), and a group's use count is the largest
`use_index + 1` seen, so a record read twice (a merged ledger file that
holds records this index read in their first file) changes nothing.

Bounded memory (`retire=True`, what the daemons use): filtered groups and
groups consumed `reuse` times can never be pulled again, so their rows are
dropped from the arrays and only counted (per version and state, and per
filter reason). A group id is '<writer id>-<sequence>', and a writer's shards
become visible in sequence, so after a refresh that read every file it listed,
and whose listing held each writer's new sequences without a gap, the index has
seen each writer's groups up to the highest sequence it read (a watermark per
writer, bounded by the number of writers). A directory listing is no snapshot:
one that runs while two shards of a writer are renamed into place can return
the later and miss the earlier, which a watermark past both would then count as
seen and never index (the synthetic soak lost a 32-group shard so, once in
100,000 steps). A refresh whose new sequences skip some lists again: the missed
shard was in place before the first listing ended, so the next one sees it (or
the c-file it went into); a gap that two listings in a row show is a real hole
(a quarantined shard) and no longer holds the watermark back. Only groups under
their writer's watermark are dropped, and a group under it that turns up in a
c-file without being held was dropped, not new, however many merges it went
through. The index then holds the groups that may still be pulled, whatever
the length of the run; files no group refers to are forgotten too.

Groups that are dead when their shard is read (filtered, or used `reuse` times
by ledger records read before it) are counted and never held, so a cold start
on a long run's buffer does not first hold every group it will drop: on the
buffer of a 60-minute soak (710,602 groups, 72% filtered) the first refresh's
peak RSS went +317-365 -> +244-263 MiB and its time 2.8-3.4 -> 2.4-2.5 s. No group is
in two files of one listing (buffer/fileset.py), so within a refresh nothing
comes back; a refresh that sets no watermark keeps the keys of what it dropped
(`_limbo`, 8 bytes a group) until one covers them.

Retention (buffer/retention.py) removes whole shards whose groups are all too
old to be pulled; when such a shard leaves the live list without its groups
moving to a c-file, `refresh` retires its groups (in any index, retire=True or
not): counted as filtered, consumed or expired (their real state), never as
unavailable, and dropped from the arrays. It knows such a shard by the bound
retention records before removing anything (all the shard's groups are older)
and by its absence from quarantine/.

States of a group for a trainer at version t with limit max_staleness (None =
unlimited) and a reuse count R (times a group may be trained on):

    filtered     all rewards equal: never sampled
    consumed     trained on R times
    unavailable  its shard was quarantined (or went away, not by compaction or retention) after it was indexed
    future       version > t (sampled by weights of an undone timeline, after a resume)
    expired      staleness(t, version) > max_staleness
    eligible     everything else: may be pulled
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from buffer.fileset import read_sources
from buffer.layout import BufferDir, BufferError, ledger_range
from buffer.store import StoreError, parquet_file, read_table
from buffer.retention import read_floor
from buffer.schema import FILTER_REASONS, INDEX_COLUMNS, staleness

ELIGIBLE, CONSUMED, FILTERED, EXPIRED, FUTURE, UNAVAILABLE = range(6)
STATE_NAMES = ("eligible", "consumed", "filtered", "expired", "future", "unavailable")
_REASON_CODE = {r: i + 1 for i, r in enumerate(FILTER_REASONS)}  # 0: not filtered


def admission_limit(trainer_version: int, max_staleness: int | None, groups_per_step: int) -> int | None:
    """Most non-filtered groups that may have been admitted at trainer version t.

    limit(t) = (max_staleness + t + 1) * groups_per_step (AReaL's rule): a
    generator that has seen `admitted >= limit(t)` waits for the trainer, so in
    steady state almost nothing expires. None when staleness is unlimited.
    """
    if max_staleness is None:
        return None
    return (max_staleness + trainer_version + 1) * groups_per_step


@dataclass
class _MergePlan:
    """How to index a c-file mostly from its footer (GroupIndex._merge_plan)."""

    held: np.ndarray        # (H,) positions in the arrays of the held groups of sources read before
    row_group: np.ndarray   # (H,) each one's row group in the c-file
    row_start: np.ndarray   # (H,) and its first row there
    read: list[int]         # the c-file's row groups to read: those with rows of sources not read before


@dataclass
class _Grow:
    """A numpy column that grows by appending (amortised doubling)."""

    data: np.ndarray
    n: int = 0

    @classmethod
    def of(cls, dtype) -> "_Grow":
        return cls(np.zeros(1024, dtype=dtype))

    def extend(self, values: np.ndarray) -> None:
        need = self.n + len(values)
        if need > len(self.data):
            grown = np.zeros(max(need, 2 * len(self.data)), dtype=self.data.dtype)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n: need] = values
        self.n = need

    @property
    def view(self) -> np.ndarray:
        return self.data[: self.n]

    def keep(self, mask: np.ndarray) -> None:
        """Drop the rows where `mask` (shape (n,)) is False, shrinking the storage with them."""
        kept = self.view[mask]
        self.data = np.zeros(max(1024, 2 * len(kept)), dtype=self.data.dtype)
        self.data[: len(kept)] = kept
        self.n = len(kept)


class GroupIndex:
    """Groups, their location and consumption; refreshed incrementally from the files."""

    DROP_AT = 4096   # retire=True: drop retired rows once at least this many (and half the rows) are retired
    RELISTS = 4      # listings more a refresh takes while its writers' sequences show new gaps (module doc)

    def __init__(self, root: str | os.PathLike, *, as_of_step: int | None = None, quarantine: bool = True,
                 retire: bool = False, reuse: int = 1):
        self.dir = BufferDir(root)
        self.as_of_step = as_of_step
        self.quarantine = quarantine
        self.retire, self.reuse = retire, reuse
        self.retired = 0                      # groups dropped from the arrays (retire=True)
        self._retired_states = np.zeros((0, len(STATE_NAMES)), np.int64)   # (max version + 1, states)
        self._retired_reasons = np.zeros(len(FILTER_REASONS) + 1, np.int64)
        self._refreshes = 0
        self.group_ids: list[str] = []
        self.id_to_idx: dict[str, int] = {}
        self.version = _Grow.of(np.int64)
        self.reason = _Grow.of(np.int8)
        self.created_us = _Grow.of(np.int64)
        self.group_size = _Grow.of(np.int32)
        self.reward_mean = _Grow.of(np.float64)
        self.use_count = _Grow.of(np.int32)
        self.available = _Grow.of(np.bool_)
        self.file_idx = _Grow.of(np.int32)
        self.row_group = _Grow.of(np.int32)
        self.row_start = _Grow.of(np.int32)   # first row of the group within its row group
        self.files: list[Path] = []           # file_idx -> path
        self._file_rows: list[np.ndarray] = []  # file_idx -> its row groups' first rows, then its row count
        self._file_of: dict[str, int] = {}    # live file name -> file_idx
        self._ledger_seen: set[str] = set()
        self._early_uses: dict[str, list[int]] = {}  # ledger ids whose shard is not indexed: [uses, refresh]
        self.writer_no = _Grow.of(np.int32)   # per group: writer number of its id ('w000007-...' -> 7), -1: other
        self.seq = _Grow.of(np.int64)         # per group: sequence number within its writer
        self._upto = np.full(0, -1, np.int64)  # writer number -> highest sequence read in a complete refresh
        self._pass_upto: dict[int, int] = {}   # this refresh's highest sequences, kept if it read every file
        self._pass_complete = True
        self._pass_seqs: list[tuple[np.ndarray, np.ndarray]] = []   # (writers, sequences) this refresh read
        self.relists = 0                      # listings taken again because one skipped a writer's sequence
        self._pass_dropped: list[np.ndarray] = []   # keys (see _keys) of the groups this refresh dropped on arrival
        self._limbo = np.zeros(0, np.int64)   # sorted keys dropped by refreshes that missed a file, not yet covered
        self.unreadable: dict[str, str] = {}  # shards skipped (quarantine=False): name -> reason
        self.quarantined_now: list[tuple[str, str]] = []
        self.refresh()

    def __len__(self) -> int:
        """Groups held in the arrays (with retire=True, not those dropped: see `retired`)."""
        return len(self.group_ids)

    # -- refresh -----------------------------------------------------------------
    def refresh(self) -> None:
        """Index shards and ledger records that appeared; follow files that went away."""
        self._refreshes += 1
        self._pass_upto, self._pass_complete, self._pass_dropped, self._pass_seqs = {}, True, [], []
        live_names = self._index_listing()
        gaps: dict[int, int] = {}
        relists = 0
        while self._pass_complete:
            found = self._gaps()
            if found.items() <= gaps.items():   # none, or only what the last listing showed too: holes
                break
            if relists == self.RELISTS:        # still racing the writers: no watermark from this refresh
                self._pass_complete = False
                break
            gaps, relists = found, relists + 1  # a listing that raced a writer's renames (module doc)
            self.relists += 1
            live_names = self._index_listing()
        if self._pass_complete:   # every listed file read: each writer's groups up to its maximum are seen
            for w, top in self._pass_upto.items():
                if w >= len(self._upto):
                    grown = np.full(max(w + 1, 2 * len(self._upto)), -1, np.int64)
                    grown[: len(self._upto)] = self._upto
                    self._upto = grown
                self._upto[w] = max(self._upto[w], top)
        elif self._pass_dropped:   # no watermark from this refresh: remember what it dropped by key
            self._limbo = np.union1d(self._limbo, np.concatenate(self._pass_dropped))
        if len(self._limbo):       # keys a complete refresh's watermark now covers need no remembering
            self._limbo = self._limbo[~self._seen_complete(self._limbo >> _SEQ_BITS, self._limbo & _SEQ_MASK)]
        ledger_names = self.dir.ledger_shard_names()
        for name in ledger_names:
            if name not in self._ledger_seen:
                self._read_ledger(name)
        # Sources of merged ledger files are never listed again: forget them (bounded).
        self._ledger_seen.intersection_update(ledger_names)
        # Files that went away (after the ledger: every use of a retired group is counted by now).
        live_set = set(live_names)
        gone = [name for name in self._file_of if name not in live_set]
        if gone:
            self._follow_gone(gone)
        if self.retire:
            self._drop_retired()
            old = self._refreshes - 3   # a record that raced its shard's listing is matched by now
            for gid in [g for g, (_, r) in self._early_uses.items() if r < old]:
                del self._early_uses[gid]

    def _index_listing(self) -> list[str]:
        """List the live shards and index those not indexed yet; the names listed."""
        live_names = self.dir.live_shard_names()
        for name in live_names:
            if name not in self._file_of and name not in self.unreadable:
                self._index_shard(self.dir.shards / name)
        return live_names

    def _gaps(self) -> dict[int, int]:
        """Writer number -> first missing sequence, for each writer whose sequences this refresh read
        above its watermark do not run on from it without a gap."""
        if not self._pass_seqs:
            return {}
        keys, ok = _keys(np.concatenate([a for a, _ in self._pass_seqs]),
                         np.concatenate([b for _, b in self._pass_seqs]))
        keys = np.unique(keys[ok])   # by writer, then sequence; a group read twice counts once
        w, q = keys >> _SEQ_BITS, keys & _SEQ_MASK
        upto = self._upto
        below = np.full(len(w), -1, np.int64)
        known = w < len(upto)
        below[known] = upto[w[known]]
        above = q > below
        w, q, below = w[above], q[above], below[above]
        if not len(w):
            return {}
        pos = np.arange(len(w))
        start = np.maximum.accumulate(np.where(np.r_[True, w[1:] != w[:-1]], pos, 0))
        expected = below + (pos - start) + 1   # the sequence each row would have without a gap
        bad = q != expected
        writers, at = np.unique(w[bad], return_index=True)   # rows are sorted: each writer's first gap
        return dict(zip(writers.tolist(), expected[bad][at].tolist()))

    def last_tops(self) -> dict[int, int]:
        """Writer number -> highest sequence among the groups the last refresh read (new shards and c-files)."""
        return dict(self._pass_upto)

    def _follow_gone(self, names: list[str]) -> None:
        """Groups of shards that left the live list without moving to a c-file: retired or unavailable.

        A shard retention removed (buffer/retention.py: not quarantined, and all its
        remaining groups below the bound retention recorded) has its groups retired:
        counted as filtered, consumed or expired, and dropped. Any other (quarantined
        by another process, or lost) leaves them unavailable.
        """
        floor = None
        retired = np.zeros(len(self.group_ids), dtype=np.bool_)
        for name in names:
            fidx = self._file_of.pop(name)
            lost = self.file_idx.view == fidx
            if not lost.any():
                continue   # every group moved to a c-file
            if floor is None:
                try:
                    floor = read_floor(self.dir.root)
                except BufferError:   # unreadable record: the groups stay unavailable, as without retention
                    floor = None
                floor = np.iinfo(np.int64).min if floor is None else floor
            if self.version.view[lost].max() < floor and not (self.dir.quarantine_dir / name).exists():
                retired |= lost
            else:
                self.available.view[lost] = False
        if retired.any() and not self._retire_rows(retired):
            self.available.view[retired] = False

    def _read_ledger(self, name: str) -> None:
        """Count the uses in one ledger file (as of `as_of_step`); reading a record twice changes nothing."""
        first, last = ledger_range(name)
        if self.as_of_step is not None and first > self.as_of_step:
            return
        cut = self.as_of_step is not None and last > self.as_of_step
        try:
            t = read_table(self.dir.ledger / name,
                              columns=["group_id", "use_index"] + (["trainer_step"] if cut else []))
        except FileNotFoundError:
            return   # merged meanwhile: the merged file is listed next time
        if cut:
            t = t.filter(pc.less_equal(t.column("trainer_step"), self.as_of_step))
        self._ledger_seen.add(name)
        self.add_uses(t.column("group_id"), t.column("use_index").to_numpy())

    def mark_ledger_seen(self, name: str) -> None:
        """A ledger shard whose uses the caller has already counted (the sampler's own)."""
        self._ledger_seen.add(name)

    def add_uses(self, group_ids: pa.Array | pa.ChunkedArray | list[str], use_index: np.ndarray) -> None:
        """Ledger records: group i has been used at least use_index[i] + 1 times (shape (N,)).

        Vectorised: a merged ledger file repeats every record of its sources (201,088 after
        one compactor pass late in a 60-minute run), nearly all of groups already dropped,
        and a loop over them stalled each daemon's refresh for 0.4 s (2 cores). Records of
        held groups raise their counts; records of groups that a complete refresh has seen
        but no longer holds (dropped) change nothing; the rest wait in `_early_uses` for
        their shard.
        """
        ids = _as_string_array(group_ids)
        uses = np.asarray(use_index, dtype=np.int64) + 1
        if len(ids) == 0:
            return
        pos = self._held_positions(ids)
        held = pos >= 0
        if held.any():
            count = self.use_count.view
            np.maximum.at(count, pos[held], uses[held].astype(count.dtype))
        rest = ~held
        if rest.any():
            rest_idx = np.flatnonzero(rest)[~self._seen(*writer_seqs(ids.filter(pa.array(rest))))]
            for gid, n in zip(ids.take(pa.array(rest_idx)).to_pylist(), uses[rest_idx].tolist()):
                early = self._early_uses.setdefault(gid, [0, self._refreshes])
                early[0] = max(early[0], n)

    def _seen_complete(self, w: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Per group (w, q: writer numbers and sequences, shape (N,)): read by a complete refresh, so
        indexed then; one the index no longer holds was dropped. False for ids of no writer (-1)."""
        upto = self._upto
        seen = (w >= 0) & (w < len(upto))
        seen[seen] = q[seen] <= upto[w[seen]]
        return seen

    def _seen(self, w: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Per group (shape (N,)): covered by the watermark, or dropped on arrival by a refresh that was not."""
        seen = self._seen_complete(w, q)
        if len(self._limbo):
            keys, ok = _keys(w, q)
            at = np.minimum(np.searchsorted(self._limbo, keys), len(self._limbo) - 1)
            seen |= ok & (self._limbo[at] == keys)
        return seen

    def _held_positions(self, ids: pa.Array) -> np.ndarray:
        """Position in the arrays of each id (shape (N,)), -1 where the index does not hold it."""
        if not self.group_ids:
            return np.full(len(ids), -1, np.int64)
        if 2 * len(ids) < len(self.group_ids):   # a small file: dict lookups beat building the held set
            get = self.id_to_idx.get
            return np.array([get(g, -1) for g in ids.to_pylist()], np.int64)
        found = pc.index_in(ids, value_set=pa.array(self.group_ids, pa.string()))
        return pc.fill_null(found, -1).to_numpy().astype(np.int64)

    def _add_file(self, path: Path, rg_rows: np.ndarray) -> int:
        """Number a newly indexed live file (`rg_rows`: see _row_group_starts); its file_idx."""
        fidx = len(self.files)
        self.files.append(path)
        self._file_rows.append(rg_rows)
        self._file_of[path.name] = fidx
        return fidx

    def _merge_plan(self, meta: pq.FileMetaData, rg_rows: np.ndarray) -> _MergePlan | None:
        """How to index a c-file without reading the rows of sources this index has read; None: read it all.

        A c-file's rows are its sources' rows in order, their row groups whole (its footer
        names them and their row counts: buffer/compaction.py). A source still in `_file_of`
        was read before (or followed so), so the index has seen each of its groups: those it
        holds move to the c-file, at rows computed from the source's row groups, and the rest
        need nothing. Only the row groups that hold rows of other sources (shards merged before
        this index listed them) are read. Reading the whole c-file instead decodes every row's
        ids, in every daemon: after level merges of 445,704 groups (75 MiB, the synthetic soak's
        buffer) the next refresh took 0.59 s and +217 MiB at its peak (94 MiB kept) reading
        them, 0.012 s and +0 MiB from their footers (bench/index_merge.py, medians of 3). None
        for a file without sources, or whose footer disagrees with what was recorded of them.
        """
        sources = read_sources(meta)
        if not sources:
            return None
        src = [self._file_of.get(name, -1) for name, _ in sources]
        offsets = np.cumsum([0] + [rows for _, rows in sources], dtype=np.int64)
        if offsets[-1] != rg_rows[-1] or any(f >= 0 and self._file_rows[f][-1] != rows
                                             for f, (_, rows) in zip(src, sources)):
            return None
        of_source = np.full(len(self.files), -1, np.int64)
        known = [j for j, f in enumerate(src) if f >= 0]
        of_source[[src[j] for j in known]] = known
        held = np.flatnonzero(of_source[self.file_idx.view] >= 0)
        k = of_source[self.file_idx.view[held]]
        row = np.empty(len(held), np.int64)     # each held group's first row in the c-file
        for j in np.unique(k).tolist():
            here = k == j
            row[here] = (offsets[j] + self._file_rows[src[j]][self.row_group.view[held[here]]]
                         + self.row_start.view[held[here]])
        rgs = np.minimum(np.searchsorted(rg_rows, row, side="right") - 1, len(rg_rows) - 2)
        if (row + self.group_size.view[held] > rg_rows[rgs + 1]).any():
            return None   # a group past the end or across row groups: not a merge of whole row groups
        read: set[int] = set()
        for j, f in enumerate(src):
            if f < 0 and offsets[j + 1] > offsets[j]:
                lo, hi = np.searchsorted(rg_rows, [offsets[j], offsets[j + 1] - 1], side="right") - 1
                read.update(range(int(lo), int(hi) + 1))
        return _MergePlan(held, rgs.astype(np.int32), (row - rg_rows[rgs]).astype(np.int32), sorted(read))

    def _follow(self, fidx: int, plan: _MergePlan) -> None:
        """Move the held groups of a c-file's known sources to it (file `fidx`), as `plan` computed."""
        self.file_idx.view[plan.held] = fidx
        self.row_group.view[plan.held] = plan.row_group
        self.row_start.view[plan.held] = plan.row_start
        self.available.view[plan.held] = True

    def mark_unreadable(self, path: Path, reason: str) -> None:
        """Quarantine (or, read-only, skip) a shard; its groups become unavailable."""
        if self.quarantine:
            if self.dir.quarantine(path, reason) is not None:
                self.quarantined_now.append((path.name, reason))
        else:
            warnings.warn(f"skipping unreadable shard {path}: {reason}", stacklevel=2)
        self.unreadable[path.name] = reason
        fidx = self._file_of.pop(path.name, None)
        if fidx is not None:
            self.available.view[self.file_idx.view == fidx] = False

    def _index_shard(self, path: Path) -> None:
        try:
            pf = parquet_file(path)
            rg_rows = _row_group_starts(pf.metadata)
            plan = self._merge_plan(pf.metadata, rg_rows)
            if plan is None:
                table, part = pf.read(columns=INDEX_COLUMNS), list(range(len(rg_rows) - 1))
            else:
                part = plan.read
                table = pf.read_row_groups(part, columns=INDEX_COLUMNS) if part else None
        except FileNotFoundError:
            self._pass_complete = False   # this listing missed where its groups went: no watermark from it
            return  # compacted away between listing and reading; the c-file has its groups
        except StoreError:   # the store unreachable: not a damaged file
            raise
        except Exception as e:  # noqa: BLE001 - any decode error means the file is unusable
            self.mark_unreadable(path, f"unreadable: {type(e).__name__}: {e}")
            return
        if table is None:   # a c-file of sources all read before: its footer was enough
            self._follow(self._add_file(path, rg_rows), plan)
            return
        enc = pc.dictionary_encode(table.column("group_id")).combine_chunks()
        codes = enc.indices.to_numpy()
        num = len(enc.dictionary)
        counts = np.bincount(codes, minlength=num)
        first = np.full(num, len(codes), dtype=np.int64)
        np.minimum.at(first, codes, np.arange(len(codes)))
        sizes = table.column("group_size").to_numpy()[first]
        last = np.zeros(num, dtype=np.int64)
        np.maximum.at(last, codes, np.arange(len(codes)))
        bad = (counts != sizes) | (last - first + 1 != counts)
        if len(codes) == 0 or bad.any():
            gid = enc.dictionary[int(np.argmax(bad))].as_py() if bad.any() else None
            self.mark_unreadable(path, f"partial group {gid!r}: rows do not match group_size"
                                 if gid else "shard has no rows")
            return
        in_table = np.concatenate([[0], np.cumsum(np.diff(rg_rows)[part])])[:-1]   # the table: row groups `part`
        j = np.searchsorted(in_table, first, side="right") - 1
        if (j != np.searchsorted(in_table, last, side="right") - 1).any():
            self.mark_unreadable(path, "a group spans two row groups")
            return
        rgs = np.asarray(part, np.int32)[j]
        starts = (first - in_table[j]).astype(np.int32)
        fidx = self._add_file(path, rg_rows)
        if plan is not None:
            self._follow(fidx, plan)
        col = {c: table.column(c) for c in INDEX_COLUMNS}
        reasons = reason_codes(col["filter_reason"].take(first),
                               col["filtered"].to_numpy(zero_copy_only=False)[first])
        versions = col["version"].to_numpy()[first]
        created = col["created_at"].cast(pa.int64()).to_numpy()[first]
        means = col["group_reward_mean"].to_numpy()[first]
        # Per group, vectorised: a merged file repeats groups the index has long dropped (26,942
        # after one pass, 3,094 of them held), and Python loops over them cost 0.2 s a refresh.
        w, q = writer_seqs(enc.dictionary)
        ours = w >= 0
        self._pass_seqs.append((w[ours], q[ours]))
        for wn, qn in zip(*_max_per_writer(w[ours], q[ours])):
            if qn > self._pass_upto.get(wn, -1):
                self._pass_upto[wn] = qn
        pos = self._held_positions(enc.dictionary)
        moved = pos >= 0                                   # compaction: same group, new home
        seen = self._seen(w, q)                            # else dropped before
        if moved.any():
            idx = pos[moved]
            self.file_idx.view[idx] = fidx
            self.row_group.view[idx] = rgs[moved]
            self.row_start.view[idx] = starts[moved]
            self.available.view[idx] = True
        new = np.flatnonzero(~moved & ~seen)
        if not len(new):
            return
        if self._early_uses:   # ledger records that came before their shard
            uses = np.array([self._early_uses.pop(g, (0,))[0] for g in enc.dictionary.take(new).to_pylist()],
                            np.int32)
        else:
            uses = np.zeros(len(new), np.int32)
        if self.retire:   # dead on arrival (filtered, or used `reuse` times): counted, never held
            keys, ok = _keys(w[new], q[new])
            dead = ok & (versions[new] >= 0) & ((reasons[new] > 0) | (uses >= self.reuse))
            if dead.any():
                self._count_retired(versions[new[dead]], reasons[new[dead]], uses[dead])
                self._pass_dropped.append(keys[dead])
                new, uses = new[~dead], uses[~dead]
        base = len(self.group_ids)
        for j, g in enumerate(enc.dictionary.take(new).to_pylist()):
            self.id_to_idx[g] = base + j
            self.group_ids.append(g)
        self.version.extend(versions[new])
        self.reason.extend(reasons[new])
        self.created_us.extend(created[new])
        self.group_size.extend(sizes[new])
        self.reward_mean.extend(means[new])
        self.use_count.extend(uses)
        self.writer_no.extend(w[new].astype(np.int32))
        self.seq.extend(q[new])
        self.available.extend(np.ones(len(new), np.bool_))
        self.file_idx.extend(np.full(len(new), fidx, np.int32))
        self.row_group.extend(rgs[new])
        self.row_start.extend(starts[new])

    # -- bounded memory ------------------------------------------------------------
    def _drop_retired(self) -> None:
        """Drop filtered groups and those consumed `reuse` times, counting them, once they are many."""
        covered = self._seen_complete(self.writer_no.view, self.seq.view)
        dead = ((self.reason.view > 0) | (self.use_count.view >= self.reuse)) & covered
        n_dead = int(dead.sum())
        if n_dead < max(self.DROP_AT, len(self.group_ids) // 2):
            return   # amortised: each drop costs O(groups held)
        self._retire_rows(dead)

    def _retire_rows(self, mask: np.ndarray) -> bool:
        """Count the groups where `mask` (shape (n,)) is True as retired, at their version, then drop them.

        Each counts as filtered (a filter reason), else consumed (used `reuse` times), else
        expired (a shard retention removed). False, and nothing done, if a version is
        negative (versions are >= 0; never drop what could not be counted).
        """
        version = self.version.view[mask]
        if len(version) and version.min() < 0:
            return False
        self._count_retired(version, self.reason.view[mask], self.use_count.view[mask])
        keep = ~mask
        for col in (self.version, self.reason, self.created_us, self.group_size, self.reward_mean, self.use_count,
                    self.available, self.file_idx, self.row_group, self.row_start, self.writer_no, self.seq):
            col.keep(keep)
        self.group_ids = [g for g, k in zip(self.group_ids, keep.tolist()) if k]
        self.id_to_idx = {g: i for i, g in enumerate(self.group_ids)}
        self._forget_files()
        return True

    def _count_retired(self, version: np.ndarray, reason: np.ndarray, use_count: np.ndarray) -> None:
        """Count groups (per group, shape (N,); versions >= 0) as retired at their version: filtered (a
        filter reason), else consumed (used `reuse` times), else expired (a shard retention removed)."""
        state = np.where(reason > 0, FILTERED, np.where(use_count >= self.reuse, CONSUMED, EXPIRED))
        top = int(version.max(initial=-1)) + 1
        if top > len(self._retired_states):
            grown = np.zeros((max(top, 2 * len(self._retired_states)), len(STATE_NAMES)), np.int64)
            grown[: len(self._retired_states)] = self._retired_states
            self._retired_states = grown
        np.add.at(self._retired_states, (version, state), 1)
        self._retired_reasons += np.bincount(reason, minlength=len(self._retired_reasons))
        self.retired += len(version)

    def _forget_files(self) -> None:
        """Renumber `files` to those a held group or the live listing refers to (the rest are gone for good)."""
        used = np.union1d(np.unique(self.file_idx.view), np.fromiter(self._file_of.values(), np.int64))
        if len(used) == len(self.files):
            return
        remap = np.full(len(self.files), -1, np.int64)
        remap[used] = np.arange(len(used))
        self.files = [self.files[i] for i in used.tolist()]
        self._file_rows = [self._file_rows[i] for i in used.tolist()]
        self.file_idx.view[:] = remap[self.file_idx.view]
        self._file_of = {name: int(remap[i]) for name, i in self._file_of.items()}

    # -- states and counts -------------------------------------------------------
    def states(self, trainer_version: int, max_staleness: int | None, reuse: int = 1) -> np.ndarray:
        """State code per group (see module doc), shape (num_groups,)."""
        return group_states(self.version.view, self.reason.view, self.use_count.view, self.available.view,
                            trainer_version, max_staleness, reuse)

    def counts(self, trainer_version: int, max_staleness: int | None, reuse: int = 1, *,
               by_version: bool = True) -> dict:
        """Groups per state, filtered per reason, and (with `by_version`) states per version.

        Retired groups (retire=True) count too: as filtered or consumed, at their version.
        """
        out = state_counts(self.states(trainer_version, max_staleness, reuse), self.reason.view,
                           self.version.view, by_version=by_version)
        if not self.retired:
            return out
        per_state = self._retired_states.sum(axis=0)
        out["groups"] += self.retired
        for i, name in enumerate(STATE_NAMES):
            out[name] += int(per_state[i])
        for r, c in _REASON_CODE.items():
            out["filtered_by_reason"][r] += int(self._retired_reasons[c])
        out["admitted"] = out["groups"] - out["filtered"]
        if by_version:
            bv = out["by_version"]
            for v in np.flatnonzero(self._retired_states.any(axis=1)).tolist():
                row = bv.setdefault(v, {})
                for i, name in enumerate(STATE_NAMES):
                    if self._retired_states[v, i]:
                        row[name] = row.get(name, 0) + int(self._retired_states[v, i])
            out["by_version"] = dict(sorted(bv.items()))
        return out


def _row_group_starts(meta: pq.FileMetaData) -> np.ndarray:
    """Each row group's first row in the file, then the file's row count: shape (row groups + 1,)."""
    return np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)], dtype=np.int64)


_WRITER_SEQ = r"^w(?P<w>[0-9]{1,18})-(?P<q>[0-9]{1,18})$"


def _as_string_array(ids: pa.Array | pa.ChunkedArray | list[str]) -> pa.Array:
    """One string array (dictionary-encoded or chunked input decoded and combined)."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
    if not isinstance(ids, pa.Array):
        ids = pa.array(ids, pa.string())
    if pa.types.is_dictionary(ids.type):
        ids = ids.dictionary_decode()
    return ids.cast(pa.string()) if ids.type != pa.string() else ids


def writer_seqs(group_ids: pa.Array | list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(writer numbers, sequences), each shape (N,), of writers' group ids 'w000007-00000012';
    -1 and -1 for any other id (a user's own ids). Arrow's regex kernel, not a Python loop."""
    ids = _as_string_array(group_ids)
    m = pc.extract_regex(ids, _WRITER_SEQ)
    ok = pc.fill_null(pc.is_valid(m), False).to_numpy(zero_copy_only=False)
    w = np.full(len(ids), -1, np.int64)
    q = np.full(len(ids), -1, np.int64)
    if ok.any():
        parts = m.filter(pa.array(ok))
        w[ok] = pc.struct_field(parts, "w").cast(pa.int64()).to_numpy()
        q[ok] = pc.struct_field(parts, "q").cast(pa.int64()).to_numpy()
    return w, q


_SEQ_BITS = 40
_SEQ_MASK = (1 << _SEQ_BITS) - 1


def _keys(w: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One int64 per group (writer number and sequence, shape (N,)), and whether it fits (writer < 2**23,
    sequence < 2**40; ids of no writer (-1) do not): the key of a group dropped on arrival."""
    ok = (w >= 0) & (w < 1 << (63 - _SEQ_BITS)) & (q >= 0) & (q <= _SEQ_MASK)
    return np.where(ok, (w << _SEQ_BITS) | q, -1), ok


def _max_per_writer(w: np.ndarray, q: np.ndarray) -> tuple[list[int], list[int]]:
    """The writers present in w (shape (N,), all >= 0) and the highest sequence of each."""
    if len(w) == 0:
        return [], []
    writers, inv = np.unique(w, return_inverse=True)
    top = np.full(len(writers), -1, np.int64)
    np.maximum.at(top, inv, q)
    return writers.tolist(), top.tolist()


def reason_codes(filter_reasons, filtered: np.ndarray) -> np.ndarray:
    """Filter reason code per group, shape (N,): 1 + position in FILTER_REASONS, 0 when not filtered.

    filter_reasons: shape (N,), a pyarrow string array or a list / numpy array of str or None.
    A group flagged `filtered` without a reason counts as all_equal. Vectorised through Arrow's
    dictionary encoding: `asyncgrpo status` passes a cell per (file, version, reason), about 226,000
    of them on the synthetic soak's final buffer, where a Python loop took 90 ms.
    """
    arr = filter_reasons if isinstance(filter_reasons, (pa.Array, pa.ChunkedArray)) \
        else pa.array(filter_reasons, pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    enc = arr.dictionary_encode()
    lut = np.array([_REASON_CODE.get(r, 0) for r in enc.dictionary.to_pylist()] + [0], dtype=np.int8)
    codes = lut[enc.indices.fill_null(len(lut) - 1).to_numpy(zero_copy_only=False)]
    codes[np.asarray(filtered, dtype=np.bool_) & (codes == 0)] = _REASON_CODE["all_equal"]
    return codes


def group_states(version: np.ndarray, reason: np.ndarray, use_count: np.ndarray, available: np.ndarray,
                 trainer_version: int, max_staleness: int | None, reuse: int = 1) -> np.ndarray:
    """State code per group (see module doc), shape (N,), from per-group arrays of shape (N,).

    Later rules win: filtered over consumed over unavailable over future/expired.
    """
    stale = staleness(trainer_version, version)
    s = np.full(len(version), ELIGIBLE, dtype=np.int8)
    if max_staleness is not None:
        s[stale > max_staleness] = EXPIRED
    s[stale < 0] = FUTURE
    s[~available] = UNAVAILABLE
    s[use_count >= reuse] = CONSUMED
    s[reason > 0] = FILTERED
    return s


def state_counts(states: np.ndarray, reason: np.ndarray, version: np.ndarray, *, by_version: bool = True) -> dict:
    """Groups per state, filtered per reason, admitted, and states per version (nonzero ones only).

    states, reason, version: per group, shape (N,).
    """
    per_state = np.bincount(states, minlength=len(STATE_NAMES))
    reasons = np.bincount(reason, minlength=len(FILTER_REASONS) + 1)
    out = {"groups": len(states), **{name: int(per_state[i]) for i, name in enumerate(STATE_NAMES)}}
    out["filtered_by_reason"] = {r: int(reasons[c]) for r, c in _REASON_CODE.items()}
    out["admitted"] = int(len(states) - per_state[FILTERED])
    if not by_version:
        return out
    versions, at = np.unique(version, return_inverse=True)
    table = np.bincount(at * len(STATE_NAMES) + states, minlength=len(versions) * len(STATE_NAMES))
    table = table.reshape(len(versions), len(STATE_NAMES))  # (versions, states)
    out["by_version"] = {int(v): {name: int(row[i]) for i, name in enumerate(STATE_NAMES) if row[i]}
                         for v, row in zip(versions, table)}
    return out
