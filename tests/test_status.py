"""`asyncgrpo status` on a buffer of many versions: ranges, exact sums, the full table, the careful path."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from buffer import GroupIndex, Sampler, ShardWriter
from conftest import make_group, run_cli
from pipeline.commands.data import status as status_command
from pipeline.status import DEFAULT_MAX_RANGES, buffer_status, range_width

VERSIONS = list(range(0, 500, 2))      # 250 versions, every other one: ranges must skip the gaps
TRAINER_VERSION, MAX_STALENESS = 450, 100


def _rewards(i: int) -> list[float]:
    """Group i: G = 2..5; every 5th all correct, every 7th all wrong (filtered), else mixed."""
    g = 2 + i % 4
    if i % 5 == 0:
        return [1.0] * g
    if i % 7 == 0:
        return [0.0] * g
    return [(i + k) % 3 / 2 for k in range(g)] if i % 3 else [1.0] + [0.25] * (g - 1)


@pytest.fixture(scope="module")
def many_versions(tmp_path_factory):
    """A buffer of 500 groups over 250 versions, 70 of them pulled; returns (buffer, groups by id)."""
    buf = tmp_path_factory.mktemp("status") / "buffer"
    groups = {}
    with ShardWriter(buf, flush_groups=16, flush_seconds=None) as w:
        for i in range(2 * len(VERSIONS)):
            v, rewards = VERSIONS[i // 2], _rewards(i)
            gid = w.append(make_group(v, rewards, prompt_id=f"p{i}", seed=i, tokens=2,
                                      correct=[r == 1.0 for r in rewards]))
            groups[gid] = {"version": v, "size": len(rewards), "reward_sum": sum(rewards),
                           "filtered": max(rewards) == min(rewards), "consumed": False}
    with Sampler(buf) as s:
        for step, n in ((1, 40), (2, 30)):
            b = s.pull(n, trainer_version=TRAINER_VERSION, trainer_step=step, max_staleness=None)
            for gid in b.group_ids:
                groups[gid]["consumed"] = True
    return buf, groups


def _expected_state(g: dict) -> str:
    if g["filtered"]:
        return "filtered"
    if g["consumed"]:
        return "consumed"
    if g["version"] > TRAINER_VERSION:
        return "future"
    return "expired" if TRAINER_VERSION - g["version"] > MAX_STALENESS else "eligible"


def _status_json(buf, *args) -> dict:
    r = run_cli("status", str(buf), "--json", "--trainer-version", str(TRAINER_VERSION),
                "--max-staleness", str(MAX_STALENESS), *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _check_rows(rows: list[dict], groups: dict) -> None:
    """Each version in exactly one row; every count of a row equals the sum over its groups."""
    owner = {}
    for n, row in enumerate(rows):
        for v in VERSIONS:
            if row["first"] <= v <= row["last"]:
                assert v not in owner, f"version {v} in rows {owner[v]} and {n}"
                owner[v] = n
    assert sorted(owner) == VERSIONS
    assert [r["first"] for r in rows] == sorted(r["first"] for r in rows)
    for row in rows:
        mine = [g for g in groups.values() if row["first"] <= g["version"] <= row["last"]]
        assert {row["first"], row["last"]} <= {g["version"] for g in mine}
        completions = sum(g["size"] for g in mine)
        assert row["groups"] == len(mine) and row["completions"] == completions
        for state in ("eligible", "consumed", "filtered", "expired", "future"):
            assert row[state] == sum(_expected_state(g) == state for g in mine), (row, state)
        assert row["unavailable"] == 0
        assert row["filtered_share"] == row["filtered"] / len(mine)
        # the mean over completions, not the mean of the groups' means
        reward = sum(g["reward_sum"] for g in mine) / completions
        assert row["reward_mean"] == pytest.approx(reward, rel=1e-12)


def test_summary_has_few_ranges_covering_every_version_with_exact_sums(many_versions):
    buf, groups = many_versions
    s = _status_json(buf)
    rows = s["version_ranges"]
    # widths 1, 2, 5, 10, 20 leave 250, 250, 100, 50, 25 ranges: 50 is the first with <= 20
    assert s["version_range_width"] == 50 and len(rows) == 10 <= DEFAULT_MAX_RANGES
    assert [(r["first"], r["last"]) for r in rows] == [(k, k + 48) for k in range(0, 500, 50)]
    _check_rows(rows, groups)
    assert (s["groups"], s["completions"]) == (500, sum(g["size"] for g in groups.values()))
    assert (s["consumed"], s["filtered"]) == (70, sum(g["filtered"] for g in groups.values()))
    for key in ("groups", "completions", "eligible", "consumed", "filtered", "expired", "future"):
        assert sum(r[key] for r in rows) == s[key], key
    # the same states, per version, as the index the sampler uses
    counts = GroupIndex(buf, quarantine=False).counts(TRAINER_VERSION, MAX_STALENESS, by_version=False)
    assert {k: s[k] for k in counts} == json.loads(json.dumps(counts)) and "by_version" not in s

    fewer = _status_json(buf, "--ranges", "7")["version_ranges"]
    assert len(fewer) == 5  # width 100
    _check_rows(fewer, groups)


def test_versions_flag_prints_every_version(many_versions):
    buf, groups = many_versions
    every = _status_json(buf, "--versions")
    rows = every["version_ranges"]
    assert [(r["first"], r["last"]) for r in rows] == [(v, v) for v in VERSIONS]
    counts = GroupIndex(buf, quarantine=False).counts(TRAINER_VERSION, MAX_STALENESS)   # per version, as the index
    assert {k: every[k] for k in counts} == json.loads(json.dumps(counts))
    _check_rows(rows, groups)

    human = run_cli("status", str(buf), "--versions", "--trainer-version", str(TRAINER_VERSION))
    assert human.returncode == 0, human.stderr
    assert "groups per version" in human.stdout
    printed = [int(m) for m in re.findall(r"^(\d+) +\d+ +\d+ +\d\.\d{3} ", human.stdout, flags=re.MULTILINE)]
    assert printed == VERSIONS


def test_human_summary_fits_the_rows(many_versions):
    buf, _ = many_versions
    r = run_cli("status", str(buf), "--max-staleness", str(MAX_STALENESS), "--trainer-version",
                str(TRAINER_VERSION))
    assert r.returncode == 0, r.stderr
    assert "groups per version, in ranges of 50 (--versions: every version)" in r.stdout
    rows = re.findall(r"^(\d+)-(\d+) ", r.stdout, flags=re.MULTILINE)
    assert rows == [(str(k), str(k + 48)) for k in range(0, 500, 50)]
    assert "…" not in r.stdout  # a pipe gets whole rows, however many states have groups


def test_partial_group_takes_the_careful_path(tmp_path):
    buf = tmp_path / "buffer"
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:
        for i in range(6):
            w.append(make_group(i, [1, 0, 0, 1], prompt_id=f"p{i}", seed=i))
    shard = sorted((buf / "shards").glob("w*.parquet"))[1]
    t = pq.read_table(shard)
    pq.write_table(t.slice(0, t.num_rows - 1), shard)  # its second group loses a row
    with pytest.warns(UserWarning, match="partial group"):
        s = buffer_status(buf)
    assert s["groups"] == 4 and s["completions"] == 16
    assert list(s["unreadable"]) == [shard.name] and "partial group" in s["unreadable"][shard.name]
    assert [(r["first"], r["groups"]) for r in s["version_ranges"]] == [(0, 1), (1, 1), (4, 1), (5, 1)]


def test_group_split_over_two_shards_takes_the_careful_path(tmp_path):
    """Rows add up to group_size, but over two files: the sampler's index rejects both, so must status."""
    buf = tmp_path / "buffer"
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:
        for i in range(6):
            w.append(make_group(i, [1, 0, 0, 1], prompt_id=f"p{i}", seed=i))
    a, b = sorted((buf / "shards").glob("w*.parquet"))[1:3]
    ta, tb = pq.read_table(a), pq.read_table(b)
    pq.write_table(ta.slice(0, 6), a)                               # group 3 keeps 2 of its 4 rows here
    pq.write_table(pa.concat_tables([ta.slice(6, 2), tb]), b)       # and 2 move to the next shard
    with pytest.warns(UserWarning, match="partial group"):
        s = buffer_status(buf)
    with pytest.warns(UserWarning, match="partial group"):
        index = GroupIndex(buf, quarantine=False)
    assert sorted(s["unreadable"]) == sorted(index.unreadable) and a.name in s["unreadable"]
    assert s["groups"] == len(index.states(5, None)) < 6


@pytest.mark.parametrize("versions, rows, width", [
    ([0], 1, 1), (range(20), 20, 1), (range(21), 20, 2), (range(914), 20, 50), (range(914), 1, 1000),
    ([3, 1000, 10**6], 3, 1), ([3, 1000, 10**6], 2, 2000),
])
def test_range_width_is_the_smallest_round_one_that_fits(versions, rows, width):
    import numpy as np
    assert range_width(np.asarray(versions), rows) == width


@pytest.mark.parametrize("form", ["list", "numpy", "arrow", "chunked"])
def test_reason_codes_from_every_form_status_and_the_index_pass(form):
    """A code per group: 1 + position in FILTER_REASONS, 0 for none, '' or an unknown reason, and a filtered
    group without a reason counts as all_equal; the same from a list, a numpy object array (status's
    cells) and an Arrow array, whole or chunked (the index's column)."""
    import numpy as np
    import pyarrow as pa

    from buffer import reason_codes

    reasons = ["all_wrong", None, "all_correct", "", "all_equal", "mystery", None, "all_wrong"]
    filtered = np.array([True, False, True, True, True, False, True, False])
    arg = {"list": reasons, "numpy": np.array(reasons, dtype=object), "arrow": pa.array(reasons, pa.string()),
           "chunked": pa.chunked_array([reasons[:3], reasons[3:]], pa.string())}[form]
    codes = reason_codes(arg, filtered)
    assert codes.dtype == np.int8
    assert codes.tolist() == [2, 0, 1, 3, 3, 0, 3, 2]
    assert reason_codes([], np.zeros(0, np.bool_)).tolist() == []


def test_cli_default_ranges_is_the_library_default():
    [opt] = [p for p in status_command.params if p.name == "max_ranges"]
    assert opt.default == DEFAULT_MAX_RANGES


def test_fast_path_counts_consumed_for_good_at_the_reuse_th_use(many_versions):
    """With reuse 2, a group pulled once is still eligible: status and the index agree."""
    buf, _ = many_versions
    for reuse in (1, 2):
        s = buffer_status(buf, trainer_version=TRAINER_VERSION, max_staleness=MAX_STALENESS, reuse=reuse)
        counts = GroupIndex(buf, quarantine=False).counts(TRAINER_VERSION, MAX_STALENESS, reuse, by_version=False)
        assert {k: s[k] for k in counts} == counts and s["unreadable"] == {}
        assert s["consumed"] == (70 if reuse == 1 else 0)


def test_merged_shards_are_counted_from_their_footer_summaries(many_versions, tmp_path):
    """After compaction status reads no row of the c-files (their footers sum their groups) and reports the
    same, to the last group and completion."""
    import shutil

    from buffer import BufferDir, compact
    from buffer.stats import shard_summaries as _summaries

    buf, _ = many_versions
    copy = tmp_path / "buffer"
    shutil.copytree(buf, copy)
    args = dict(trainer_version=TRAINER_VERSION, max_staleness=MAX_STALENESS)
    before = buffer_status(copy, **args, max_ranges=None)
    r = compact(copy, target_groups=64, min_age_s=0.0, grace_s=0.0)
    live = BufferDir(copy).live_shards()
    assert r.written_files >= 7 and all(p.name.startswith("c-") for p in live)
    cells, scan = _summaries(live)
    assert scan == [] and int(cells["groups"].sum()) == 500
    after = buffer_status(copy, **args, max_ranges=None)
    for key in ("groups", "completions", "eligible", "consumed", "filtered", "expired", "future", "by_version",
                "filtered_by_reason"):
        assert after[key] == before[key], key
    for a, b in zip(after["version_ranges"], before["version_ranges"]):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], rel=1e-12)
        assert {k: v for k, v in a.items() if k != "reward_mean"} == {k: v for k, v in b.items() if k != "reward_mean"}


def test_shards_without_a_summary_are_read_by_rows_to_the_same_counts(many_versions, tmp_path):
    """Shards written before footers carried summaries are scanned; the counts are the same."""
    import shutil

    from buffer import BufferDir
    from buffer.stats import shard_summaries as _summaries

    buf, _ = many_versions
    copy = tmp_path / "buffer"
    shutil.copytree(buf, copy)
    for p in BufferDir(copy).live_shards():
        pq.write_table(pq.read_table(p).replace_schema_metadata(None), p)   # an older writer's shard
    live = BufferDir(copy).live_shards()
    assert _summaries(live)[1] == live and _summaries(BufferDir(buf).live_shards())[1] == []
    args = dict(trainer_version=TRAINER_VERSION, max_staleness=MAX_STALENESS, max_ranges=None)
    old, new = buffer_status(copy, **args), buffer_status(buf, **args)
    for key in ("groups", "completions", "eligible", "consumed", "filtered", "expired", "by_version"):
        assert old[key] == new[key], key


def test_version_stats_gives_the_sums_of_the_rows_from_the_footers(many_versions, tmp_path):
    """SQL's version_stats (footer sums: c-files, writer shards, and an old shard without a summary read by
    rows) equals the groups' own sums exactly, and mean reward by version equals the full scan's; a damaged
    shard is quarantined and left out, as in any query."""
    import shutil

    from buffer import BufferDir, BufferSQL, compact

    buf, groups = many_versions
    copy = tmp_path / "buffer"
    shutil.copytree(buf, copy)
    compact(copy, target_groups=64, min_age_s=0.0, grace_s=0.0)
    groups = dict(groups)
    with ShardWriter(copy, flush_groups=8, flush_seconds=None) as w:    # and new writer shards beside the c-files
        for i in range(1000, 1040):
            rewards = _rewards(i)
            gid = w.append(make_group(VERSIONS[-1] + 2, rewards, prompt_id=f"p{i}", seed=i, tokens=2,
                                      correct=[r == 1.0 for r in rewards]))
            groups[gid] = {"version": VERSIONS[-1] + 2, "size": len(rewards), "reward_sum": sum(rewards),
                           "filtered": max(rewards) == min(rewards)}
    live = BufferDir(copy).live_shards()
    plain = [p for p in live if not p.name.startswith("c-")]
    assert len(plain) >= 3 and len(live) > len(plain)
    pq.write_table(pq.read_table(plain[0]).replace_schema_metadata(None), plain[0])   # an older writer's shard
    want: dict = {}
    for g in groups.values():
        reason = None if not g["filtered"] else "all_correct" if g["reward_sum"] == g["size"] else "all_wrong"
        cell = want.setdefault((g["version"], g["filtered"], reason), [0, 0, 0.0])
        cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + g["size"], cell[2] + g["reward_sum"]
    db = BufferSQL(copy)
    got = db.query("SELECT * FROM version_stats ORDER BY version, filtered, filter_reason").to_pylist()
    assert {(r["version"], r["filtered"], r["filter_reason"]): [r["groups"], r["completions"],
                                                                 pytest.approx(r["reward_sum"], abs=1e-9)]
            for r in got} == want
    scan = db.query("SELECT version, avg(reward) AS r, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1").to_pylist()
    fast = db.query("SELECT version, sum(reward_sum) / sum(completions) AS r, sum(completions)::BIGINT AS n "
                    "FROM version_stats GROUP BY 1 ORDER BY 1").to_pylist()
    assert [(r["version"], r["n"]) for r in fast] == [(r["version"], r["n"]) for r in scan]
    assert [r["r"] for r in fast] == pytest.approx([r["r"] for r in scan], abs=1e-12)
    _check_versions(db, want, scan)
    bad = plain[1]
    lost = pq.read_table(bad).filter(pa.compute.equal(pq.read_table(bad).column("sample_index"), 0)).num_rows
    bad.write_bytes(b"not parquet")
    total = db.query("SELECT sum(groups)::BIGINT AS n FROM version_stats").to_pylist()[0]["n"]
    assert total == len(groups) - lost
    assert [r["file"] for r in db.query("SELECT file FROM quarantined").to_pylist()] == [bad.name]


def _check_versions(db, want: dict, scan: list[dict]) -> None:
    """SQL's versions view against `want` (the groups' own sums per (version, filtered, reason)) and the full
    scan's mean reward and completions by version, exactly (sums of rewards within 1e-9)."""
    per_version: dict = {}
    for (version, filtered, _), (n, completions, reward_sum) in want.items():
        row = per_version.setdefault(version, [0, 0, 0, 0.0])
        row[0], row[1], row[2], row[3] = row[0] + n, row[1] + (n if filtered else 0), row[2] + completions, \
            row[3] + reward_sum
    got = db.query("SELECT * FROM versions ORDER BY version").to_pylist()
    assert {r["version"]: [r["groups"], r["filtered_groups"], r["completions"],
                           pytest.approx(r["reward_sum"], abs=1e-9)] for r in got} == per_version
    assert [(r["version"], r["completions"]) for r in got] == [(r["version"], r["n"]) for r in scan]
    assert [r["reward_mean"] for r in got] == pytest.approx([r["r"] for r in scan], abs=1e-12)
    types = db.query("SELECT column_name, column_type FROM (DESCRIBE versions)").to_pylist()
    assert [(t["column_name"], t["column_type"]) for t in types] == [
        ("version", "BIGINT"), ("groups", "BIGINT"), ("filtered_groups", "BIGINT"), ("completions", "BIGINT"),
        ("reward_sum", "DOUBLE"), ("reward_mean", "DOUBLE")]


@pytest.mark.parametrize("footers", [True, False])
@pytest.mark.parametrize("scale", [1, 100_000])
def test_versions_gives_a_row_per_version_from_the_footers_or_the_rows(tmp_path, monkeypatch, scale, footers):
    """SQL's versions view: a row per version with groups, its filtered groups, completions and reward sum
    and mean, exactly the groups' own sums and the full scan's mean reward; versions spread far apart
    (scale 100,000: past what version_sums indexes by offset, so by unique()), several shards of one
    version, c-files beside writer shards; and without footers (footers False: shard_table finds none
    usable) the same rows from the rows by SQL. An empty buffer gives no row."""
    from buffer import BufferSQL, compact

    buf = tmp_path / "buffer"
    with ShardWriter(buf, flush_groups=3, flush_seconds=None):
        pass
    assert BufferSQL(buf).query("SELECT * FROM versions").num_rows == 0
    want: dict = {}
    with ShardWriter(buf, flush_groups=3, flush_seconds=None) as w:
        for i, v in enumerate(v * scale for v in (5, 5, 5, 3, 3, 9, 5, 3, 9, 9, 0, 5, 7)):
            rewards = [1.0, 1.0] if i % 4 == 3 else [0.0, 0.0, 0.0] if i == 12 else [1.0, 0.0, 0.5]
            w.append(make_group(v, rewards, prompt_id=f"p{i}", seed=i))
            filtered = max(rewards) == min(rewards)
            reason = None if not filtered else "all_correct" if rewards[0] == 1.0 else "all_wrong"
            cell = want.setdefault((v, filtered, reason), [0, 0, 0.0])
            cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + len(rewards), cell[2] + sum(rewards)
    compact(buf, target_groups=6, min_age_s=0.0, grace_s=0.0, max_groups=6)
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:   # writer shards beside the c-files
        for i, v in enumerate([5 * scale, 11 * scale]):
            w.append(make_group(v, [1.0, 0.0], prompt_id=f"q{i}", seed=100 + i))
            cell = want.setdefault((v, False, None), [0, 0, 0.0])
            cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + 2, cell[2] + 1.0
    if not footers:
        import buffer.stats

        monkeypatch.setattr(buffer.stats, "shard_table", lambda shards, con: None)
    db = BufferSQL(buf)
    scan = db.query("SELECT version, avg(reward) AS r, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1").to_pylist()
    assert len(scan) == 6
    _check_versions(db, want, scan)


@pytest.mark.parametrize("scale", [1, 1000])
def test_a_version_over_several_shards_and_descending_files_is_counted_once_per_state(tmp_path, scale):
    """The fast path sums the cells of a version that several shards hold (and shards written in any
    version order) before it matches the ledger's consumed records to its learnable groups: status gives
    the index's counts, exactly, and each version's groups in one range row. scale 1000 spreads the
    versions (0 to 9,000 for 12 cells), past what the fast path indexes by offset: by unique()."""
    buf = tmp_path / "buffer"
    versions = [v * scale for v in (5, 5, 5, 3, 3, 9, 5, 3, 9, 9, 0, 5)]   # 3 a shard: version 5 in three
    with ShardWriter(buf, flush_groups=3, flush_seconds=None) as w:
        for i, v in enumerate(versions):
            rewards = [1.0, 1.0] if i % 4 == 3 else [1.0, 0.0, 0.5]      # every 4th all equal: filtered
            w.append(make_group(v, rewards, prompt_id=f"p{i}", seed=i))
    with Sampler(buf) as s:
        pulled = s.pull(5, trainer_version=9 * scale, trainer_step=1, max_staleness=None)
    assert pulled is not None and pulled.num_groups == 5
    for t, stale in ((9, None), (9, 4), (6, 1)):
        t, stale = t * scale, None if stale is None else stale * scale
        st = buffer_status(buf, trainer_version=t, max_staleness=stale, max_ranges=None)
        counts = GroupIndex(buf, quarantine=False).counts(t, stale, 1, by_version=True)
        assert {k: st[k] for k in counts} == counts and st["unreadable"] == {}
        assert st["consumed"] == 5 and st["filtered"] == 3 and st["groups"] == 12
        rows = {r["first"]: (r["groups"], r["completions"]) for r in st["version_ranges"]}
        assert rows == {0: (1, 3), 3 * scale: (3, 7), 5 * scale: (5, 14), 9 * scale: (3, 9)}


LONG_VERSIONS = list(range(0, 40_000, 50))   # 800 versions in 40 blocks of SUMMARY_BLOCK (1,000) versions


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A buffer of a long run's shape: 1,600 groups over 40,000 versions, merged into c-files (their footers
    sum them per block of versions too), 1,250 pulls with reuse 2 (some groups used twice) in two merged
    ledger files and a pull's own file after them, and a late writer's shards with old and new versions."""
    from buffer import compact, compact_ledger

    buf = tmp_path_factory.mktemp("long") / "buffer"
    with ShardWriter(buf, flush_groups=32, flush_seconds=None) as w:
        for i in range(2 * len(LONG_VERSIONS)):
            rewards = _rewards(i)
            w.append(make_group(LONG_VERSIONS[i // 2], rewards, prompt_id=f"p{i}", seed=i, tokens=2,
                                correct=[r == 1.0 for r in rewards]))
    with Sampler(buf, reuse=2) as s:   # oldest first: steps 1-2 take versions below ~18,000
        for step in range(1, 5):
            assert s.pull(250, trainer_version=40_000, trainer_step=step, max_staleness=None) is not None
            if step % 2 == 0:
                assert compact_ledger(buf, target_rows=500, min_age_s=0.0, grace_s=0.0).written_files == 1
    compact(buf, target_groups=64, min_age_s=0.0, grace_s=0.0)
    with Sampler(buf, reuse=2) as s:
        assert s.pull(250, trainer_version=40_000, trainer_step=5, max_staleness=None) is not None
    with ShardWriter(buf, flush_groups=4, flush_seconds=None) as w:
        for i, v in enumerate((120, 5_010, 20_020, 20_020, 29_999, 30_000, 39_990, 39_990)):
            w.append(make_group(v, _rewards(i + 3), prompt_id=f"late{i}", seed=1000 + i, tokens=2))
    return buf


def _careful_status(buf, t, stale, reuse, max_ranges):
    """Counts and ranges from the careful path (a GroupIndex, per group), as buffer_status builds them."""
    from buffer import find_buffer
    from pipeline import status as S

    tally = S._tally(S._read_index(find_buffer(buf)), t, stale, reuse)
    return (S.weighted_counts(tally, by_version=False),
            S.version_ranges(tally, S.range_width(tally.version, max_ranges)))


@pytest.mark.parametrize("t, stale, reuse, max_ranges", [
    (40_000, None, 1, 20), (40_000, None, 2, 20), (40_000, 10_000, 1, 20), (40_000, 10_000, 2, 7),
    (25_000, 3_000, 1, 20), (None, 12_345, 2, 30), (40_000, 10_000, 1, 100), (40_000, 10_000, 1, 2)])
def test_old_versions_summed_per_block_give_the_per_group_counts(long_run, t, stale, reuse, max_ranges):
    """Below the versions whose state is one (expired, or eligible without a staleness limit) status sums
    the merged files' footers per block of 1,000 versions, not per version: every count and every range
    row (first, last, groups, completions, each state, shares) equals the careful path's, per group.
    max_ranges 100 (more rows than the 40 blocks): ranges narrower than a block, summed per version."""
    from buffer import BufferDir
    from pipeline import status as S

    d = BufferDir(long_run)
    below = S._uniform_below(40_000 if t is None else t, stale)
    read = S._read_sql(d.live_shards(), d.ledger_shards(), reuse, None, below)
    assert read.blocks and read.ledger_blocks and below >= 10_000    # the block path is taken
    st = buffer_status(long_run, trainer_version=t, max_staleness=stale, reuse=reuse, max_ranges=max_ranges)
    counts, ranges = _careful_status(long_run, 40_000 if t is None else t, stale, reuse, max_ranges)
    assert {k: st[k] for k in counts} == counts and st["unreadable"] == {}
    assert counts["consumed"] > 0 and counts["expired" if stale else "eligible"] > 0
    assert len(st["version_ranges"]) == len(ranges) <= max_ranges
    for got, want in zip(st["version_ranges"], ranges):
        assert got["reward_mean"] == pytest.approx(want["reward_mean"], rel=1e-12)
        assert {k: v for k, v in got.items() if k != "reward_mean"} == \
            {k: v for k, v in want.items() if k != "reward_mean"}
    if max_ranges >= 100:
        assert st["version_range_width"] < 1000
