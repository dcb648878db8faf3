"""Commands on a buffer or run directory: sql, status, compact, demo.

DuckDB and pyarrow load when a command runs (buffer names its modules lazily),
so `--help` stays fast.
"""

from __future__ import annotations

import json
import sys

import click

import buffer
from buffer.layout import find_buffer, run_file_set
from pipeline.demo import run_demo
from pipeline.errors import UserError, user_errors
from pipeline.output import print_table
from pipeline.status import buffer_status, print_status
from workers.compactor import CompactorConfig


@click.command()
@click.argument("path", type=click.Path(file_okay=False))
@click.argument("query", required=False)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True, help="Output format: a table to read, CSV or a JSON array of row objects.")
@click.option("--max-width", type=click.IntRange(min=8), default=60, show_default=True,
              help="Table format: longest cell shown before it is cut with '...'.")
@user_errors
def sql(path: str, query: str | None, fmt: str, max_width: int) -> None:
    """Run a read-only SQL QUERY over the buffer at PATH (a buffer or a run directory).

    Views: rollouts (one row per completion), groups (one per group),
    consumed (the trainer's ledger), metrics (trainer steps) and
    generator_metrics (generator batches) when the run has them,
    quarantined (shards set aside), and archived_rollouts (the columns of
    rollouts, over the shards retention moved to <buffer>/archive/shards/;
    see compactor.keep_versions) when there are some. Per-version sums from
    the shards' footers, which read no row however large the buffer:
    versions (one row per version: groups, filtered_groups, completions,
    reward_sum, reward_mean) and version_stats (one per version, filter flag
    and reason). With no QUERY, reads
    queries from stdin, or opens a prompt when stdin is a terminal. Only
    SELECT is accepted.

    Values print exactly as DuckDB renders them, in every format. csv:
    lines end in "\\n" (no "\\r"), NULL is an empty field, an empty string is "".
    json: integers and decimals keep every digit (as JSON numbers, HUGEINT
    too), lists, structs and maps nest, and NaN, inf and -inf are the strings
    "NaN", "Infinity" and "-Infinity" (JSON has no such numbers).

    \b
    Examples:
      asyncgrpo sql runs/demo "SELECT count(*) FROM groups WHERE filtered"
      asyncgrpo sql runs/demo "SELECT version, avg(reward) r FROM rollouts GROUP BY 1 ORDER BY 1"
      asyncgrpo sql runs/demo "SELECT version, reward_mean FROM versions ORDER BY 1"   # the same, no row read
      asyncgrpo sql runs/demo --format csv "SELECT * FROM consumed" > ledger.csv
      asyncgrpo sql runs/a "SELECT version, avg(reward) FROM archived_rollouts GROUP BY 1"
      asyncgrpo sql runs/demo          # interactive
    """
    db = buffer.BufferSQL(path)
    if query is None and not sys.stdin.isatty():
        query = sys.stdin.read()
        if not query.strip():
            raise UserError("no query given: pass QUERY or pipe SQL on stdin")
    if query is not None:
        with db.result(query) as rows:
            print_table(rows, fmt, max_width)
        return
    _interactive(db, fmt, max_width)


def _interactive(db, fmt: str, max_width: int) -> None:
    import readline  # noqa: F401 - line editing and history for input()
    click.echo("asyncgrpo sql: views rollouts, groups, consumed, metrics, generator_metrics, quarantined, "
               "archived_rollouts (those a run has), versions, version_stats. "
               "End a query with ';'. Ctrl-D quits.")
    lines: list[str] = []
    while True:
        try:
            line = input("sql> " if not lines else "...> ")
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo()
            lines = []
            continue
        lines.append(line)
        text = "\n".join(lines).strip()
        if not text.endswith(";"):
            continue
        lines = []
        try:
            with db.result(text) as rows:
                print_table(rows, fmt, max_width)
        except buffer.SqlError as e:
            click.echo(f"error: {e}", err=True)


@click.command()
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--trainer-version", type=click.IntRange(min=0), default=None,
              help="Version to judge staleness against [default: the newest in the ledger, "
                   "else the newest group version].")
@click.option("--max-staleness", type=click.IntRange(min=0), default=None,
              help="Staleness limit for 'expired' [default: unlimited].")
@click.option("--reuse", type=click.IntRange(min=1), default=1, show_default=True,
              help="Times a group may be trained on before it counts as consumed.")
@click.option("--ranges", "max_ranges", type=click.IntRange(min=1), default=20, show_default=True,
              help="Most rows of the per-version table: versions are summed in ranges of a round width "
                   "(1, 2, 5, 10, 20, 50, ...) so that a long run fits a screen.")
@click.option("--versions", "every_version", is_flag=True,
              help="One row per version instead of ranges (the full table).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@user_errors
def status(path: str, trainer_version: int | None, max_staleness: int | None, reuse: int,
           max_ranges: int, every_version: bool, as_json: bool) -> None:
    """Groups per state and per range of versions, files and bytes of the buffer at PATH.

    States: eligible (may be pulled), consumed, filtered (all rewards equal),
    expired (staler than --max-staleness), future (newer than the trainer),
    unavailable (shard quarantined). Unreadable shards are reported, not moved.
    Shards archived by retention (compactor.keep_versions) are not counted;
    their number and bytes are shown on their own line ("archive" in --json).

    Per range of versions: groups, completions, mean reward (over completions),
    filtered share (of groups) and groups per state; --versions gives every version.

    \b
    Examples:
      asyncgrpo status runs/demo
      asyncgrpo status runs/demo --versions
      asyncgrpo status runs/demo --max-staleness 2 --json
    """
    report = buffer_status(path, trainer_version=trainer_version, max_staleness=max_staleness,
                           reuse=reuse, max_ranges=None if every_version else max_ranges)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        print_status(report)


@click.command()
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--target-groups", type=click.IntRange(min=2), default=4096, show_default=True,
              help="Groups per merged shard.")
@click.option("--min-age", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds a shard must be old before it is merged (sealed).")
@click.option("--grace", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds merged-away shards stay on disk for readers that listed them.")
@user_errors
def compact(path: str, target_groups: int, min_age: float, grace: float) -> None:
    """Merge small sealed files of the buffer (or run) at PATH into large ones.

    Rollout shards become c-files of about --target-groups groups, and
    every 4 c-files of one size level one of the next (up to 256 MiB a file); the
    ledger's one-file-per-pull records, and in a run directory the trainer's
    and the generators' metrics files, become files of up to 262,144 rows.
    Safe while generators, the trainer and SQL queries run: readers go
    through each kind's manifest, and replaced files are deleted after
    --grace. (The compactor daemon, which `asyncgrpo run` starts, does this
    every 30 s, and at once when more than 256 files of a kind wait.)

    \b
    Example:
      asyncgrpo compact runs/demo --min-age 0
    """
    root = find_buffer(path)
    defaults = CompactorConfig()
    r = buffer.compact(root, target_groups=target_groups, min_age_s=min_age, grace_s=grace, fanout=defaults.fanout,
                       max_groups=None, max_bytes=defaults.level_max_bytes)
    click.echo(f"merged {r.merged_files} shards ({r.groups} groups) into {r.written_files}; "
               f"deleted {r.deleted_files} replaced shards; quarantined {r.quarantined}")
    others = {"ledger": buffer.compact_ledger(root, min_age_s=min_age, grace_s=grace)}
    run = root.parent if root.name == "buffer" else None
    for kind in ("metrics", "generator_metrics"):
        if run is not None and (run / kind).is_dir():
            others[kind] = buffer.compact_small(run_file_set(run / kind, kind), target_rows=defaults.target_rows,
                                                min_age_s=min_age, grace_s=grace,
                                                sort_by="step" if kind == "metrics" else None)
    for kind, o in others.items():
        click.echo(f"{kind}: merged {o.merged_files} files ({o.groups} rows) into {o.written_files}; "
                   f"deleted {o.deleted_files} replaced files")


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False), default="runs/demo")
@click.option("--groups", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Synthetic groups to write.")
@click.option("--group-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Completions per group (G).")
@click.option("--groups-per-step", type=click.IntRange(min=1), default=32, show_default=True,
              help="Groups the mock trainer pulls per step.")
@click.option("--max-staleness", type=click.IntRange(min=0), default=2, show_default=True,
              help="Staleness limit of the mock trainer.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Delete RUN_DIR first if it exists.")
@user_errors
def demo(run_dir: str, groups: int, group_size: int, groups_per_step: int, max_staleness: int,
         seed: int, force: bool) -> None:
    """Exercise the replay buffer end to end with SYNTHETIC rollouts (no model).

    A mock generator appends random groups stamped with the mock trainer's
    version; a mock trainer pulls within the staleness limit and records the
    ledger; then the buffer is compacted and summarised. It shows the buffer's
    behaviour (filtered, expired, consumed groups, SQL) before the real
    daemons exist.

    \b
    Example:
      asyncgrpo demo runs/demo --force && asyncgrpo status runs/demo
    """
    run_demo(run_dir, groups=groups, group_size=group_size, groups_per_step=groups_per_step,
             max_staleness=max_staleness, seed=seed, force=force)
