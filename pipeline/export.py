"""A run's rollouts as a dataset: one Parquet file that `datasets.load_dataset("parquet", ...)` reads.

Kinds, each selected with DuckDB over the buffer's read-only `rollouts` view
(live shards; shards that retention archived are not included), after the
filters (`versions`, inclusive, and a SQL `where` on the view's columns):

    sft       per prompt (task, prompt_id), its best correct completion: highest
              reward, then fewest tokens, then newest version, then traj_id.
              Columns: prompt, completion, reward, version, group_id, traj_id,
              prompt_id, task, num_tokens.
    pairs     per group, its best completion (highest reward, then fewest tokens)
              as chosen and its worst (lowest reward, then most tokens) as
              rejected, when the chosen reward is higher (a group of equal rewards
              gives no pair). Columns: prompt, chosen, rejected, chosen_reward,
              rejected_reward, group_id, prompt_id, task, version, chosen_traj_id,
              rejected_traj_id.
    rollouts  every completion with every column of the view, the reward map
              spread into one column per function ("reward/<name>", null where a
              row lacks it: `datasets` has no map type).

The file is <to>/<kind>.parquet, written in a folder beside <to> and renamed
into place (pipeline.staging), so a failure leaves nothing half-written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import buffer
from pipeline.errors import DataError
from pipeline.staging import check_target, staged_dir

Kind = Literal["sft", "pairs", "rollouts"]
KINDS: tuple[Kind, ...] = ("sft", "pairs", "rollouts")
COMPONENT_PREFIX = "reward/"
"""Prefix of the per-function reward columns of a rollouts export."""

_SFT = """
SELECT prompt, completion, reward, version, group_id, traj_id, prompt_id, task, num_tokens
FROM (SELECT *, row_number() OVER (PARTITION BY task, prompt_id
                                   ORDER BY reward DESC, num_tokens, version DESC, traj_id) AS best
      FROM selected WHERE correct)
WHERE best = 1
ORDER BY task, prompt_id
"""

_PAIRS = """,
ranked AS (
    SELECT *, row_number() OVER (PARTITION BY group_id ORDER BY reward DESC, num_tokens, traj_id) AS best,
              row_number() OVER (PARTITION BY group_id ORDER BY reward, num_tokens DESC, traj_id) AS worst
    FROM selected)
SELECT c.prompt, c.completion AS chosen, r.completion AS rejected, c.reward AS chosen_reward,
       r.reward AS rejected_reward, c.group_id, c.prompt_id, c.task, c.version,
       c.traj_id AS chosen_traj_id, r.traj_id AS rejected_traj_id
FROM ranked c JOIN ranked r ON c.group_id = r.group_id AND c.best = 1 AND r.worst = 1
WHERE c.reward > r.reward
ORDER BY c.version, c.group_id
"""


@dataclass(frozen=True)
class ExportResult:
    kind: Kind
    rows: int
    file: Path


def parse_versions(text: str | None) -> tuple[int | None, int | None]:
    """'3:7' -> (3, 7), inclusive; '3:' and ':7' leave one end open; '5' is 5:5; None is everything."""
    if text is None:
        return None, None
    m = re.fullmatch(r"\s*(\d*)\s*(:?)\s*(\d*)\s*", text)
    if m is None or (not m.group(1) and not m.group(3)) or (not m.group(2) and not m.group(1)):
        raise DataError(f"--versions {text!r}: expected A:B (inclusive), A:, :B or one version, "
                        "with A and B integers >= 0, e.g. --versions 10:20")
    lo = int(m.group(1)) if m.group(1) else None
    hi = int(m.group(3)) if m.group(3) else (lo if not m.group(2) else None)
    if lo is not None and hi is not None and lo > hi:
        raise DataError(f"--versions {text!r}: the first version ({lo}) is after the last ({hi})")
    return lo, hi


def _selected_sql(versions: tuple[int | None, int | None], where: str | None) -> str:
    lo, hi = versions
    conds = [f"version >= {lo}" if lo is not None else None, f"version <= {hi}" if hi is not None else None,
             f"(\n{where}\n)" if where is not None else None]
    conds = [c for c in conds if c is not None]
    return "SELECT * FROM rollouts" + (" WHERE " + " AND ".join(conds) if conds else "")


def _is_export(folder: Path) -> str | None:
    """None when `folder` holds only Parquet files (an earlier export), else why it must be kept."""
    other = sorted(p.name for p in folder.iterdir() if not (p.is_file() and p.suffix == ".parquet"))
    return None if not other else f"it holds more than Parquet files (e.g. {other[0]!r})"


def export_run(run: str | Path, to: str | Path, kind: Kind, *, versions: str | None = None,
               where: str | None = None, force: bool = False) -> ExportResult:
    """Write the `kind` dataset of the run (or buffer) at `run` to `<to>/<kind>.parquet`; see the module doc."""
    import pyarrow.parquet as pq

    if kind not in KINDS:
        raise DataError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    bounds = parse_versions(versions)
    if where is not None and not where.strip():
        raise DataError("--where '': give a condition on the rollouts view's columns, e.g. --where 'reward > 0'")
    if where is not None:
        _check_condition(where)
    to = Path(to)
    source = Path(run).resolve()
    if to.resolve() == source or source in to.resolve().parents or to.resolve() in source.parents:
        raise DataError(f"--to {str(to)!r} is inside (or holds) the run {str(run)!r}; export to a folder "
                        "outside it (--force there could delete the buffer)")
    check_target(to, "--to", force, _is_export)
    db = buffer.BufferSQL(run)
    selected = _selected_sql(bounds, where)
    try:
        with db.result(f"SELECT * FROM ({selected}) LIMIT 0"):
            pass
    except buffer.SqlError as e:
        raise DataError(f"--where {where!r}: {e}" if where is not None else str(e)) from None
    table = db.query(_kind_sql(db, kind, selected))
    with staged_dir(to) as stage:
        pq.write_table(table, stage / f"{kind}.parquet", compression="zstd")
    return ExportResult(kind, table.num_rows, to / f"{kind}.parquet")


def _check_condition(where: str) -> None:
    """DataError unless `where` is one SQL expression (so it cannot close the WHERE and add a clause)."""
    import duckdb

    try:
        duckdb.SQLExpression(where)
    except duckdb.Error as e:
        raise DataError(f"--where {where!r} is not one SQL condition: {str(e).strip().splitlines()[0]}") from None


def _kind_sql(db, kind: Kind, selected: str) -> str:
    with_selected = f"WITH selected AS ({selected})"
    if kind == "sft":
        return with_selected + _SFT
    if kind == "pairs":
        return with_selected + _PAIRS
    names = db.query(with_selected + "\nSELECT DISTINCT unnest(map_keys(reward_components)) AS name FROM selected "
                     "ORDER BY name").column("name").to_pylist()
    spread = "".join(f", reward_components[{_literal(n)}] AS {_ident(COMPONENT_PREFIX + n)}" for n in names)
    return with_selected + f"\nSELECT * EXCLUDE (reward_components){spread} FROM selected " \
                           "ORDER BY version, group_id, sample_index"


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'
