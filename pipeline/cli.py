"""The `asyncgrpo` command. A thin layer: the work is done in buffer/ and pipeline/.

Heavy imports (pyarrow, duckdb, later torch) happen inside commands, so
`--help` stays fast. User errors print one paragraph and exit with code 2.
"""

from __future__ import annotations

import errno
import sys
import warnings

import click


class UserError(click.ClickException):
    """Bad input from the user: message on stderr, exit code 2, no traceback."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"asyncgrpo: error: {self.format_message()}", err=True)


def _user_error_types() -> tuple[type[Exception], ...]:
    """Errors that mean bad input (a path, a config value, a file), not a bug.

    Only from modules already imported (an error class whose module was never imported
    cannot have been raised), so a user error never pays for importing torch.
    """
    return tuple(getattr(sys.modules[module], name) for module, name in _USER_ERRORS if module in sys.modules)


_USER_ERRORS = [("buffer.layout", "BufferError"), ("pipeline.run", "RunError"), ("workers.checks", "ConfigError"),
                ("workers.model", "ModelError"), ("workers.tasks", "TaskError"),
                ("workers.trainer.session", "TrainerError"), ("workers.warmstart", "WarmstartError")]


def _user_errors(fn):
    """Turn the library's user-facing errors into UserError."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _user_error_types() as e:
            raise UserError(str(e)) from None
        except OSError as e:
            if e.errno not in _ENVIRONMENT_ERRNOS:
                raise
            raise UserError(_environment_message(e)) from None
    return wrapper


# Disk full, file-size limit, quota, read-only filesystem, no permission: the machine, not a bug.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _environment_message(e: OSError) -> str:
    """One paragraph for an OSError raised below the library's own checks (e.g. a lock file)."""
    from buffer.layout import StorageError

    if isinstance(e, StorageError):
        return str(e)
    return str(StorageError(e.filename or "a file", e))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="asyncgrpo")
def main() -> None:
    """Asynchronous, buffered GRPO: generator and trainer daemons around a
    Parquet replay buffer you can query with SQL.

    \b
    Examples:
      asyncgrpo demo runs/demo
      asyncgrpo status runs/demo
      asyncgrpo sql runs/demo "SELECT version, avg(reward) FROM rollouts GROUP BY 1"
    """
    warnings.showwarning = _show_warning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings (an unreadable shard left out) as one line, without Python's file and line."""
    click.echo(f"asyncgrpo: warning: {message}", err=True)


@main.command()
@click.argument("path", type=click.Path(file_okay=False))
@click.argument("query", required=False)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True, help="Output format.")
@click.option("--max-width", type=click.IntRange(min=8), default=60, show_default=True,
              help="Table format: longest cell shown before it is cut with '...'.")
@_user_errors
def sql(path: str, query: str | None, fmt: str, max_width: int) -> None:
    """Run a read-only SQL QUERY over the buffer at PATH (a buffer or a run directory).

    Views: rollouts (one row per completion), groups (one per group),
    consumed (the trainer's ledger), metrics (trainer steps) and
    generator_metrics (generator batches) when the run has them,
    quarantined (shards set aside). With no QUERY, reads queries from stdin,
    or opens a prompt when stdin is a terminal. Only SELECT is accepted.

    \b
    Examples:
      asyncgrpo sql runs/demo "SELECT count(*) FROM groups WHERE filtered"
      asyncgrpo sql runs/demo "SELECT version, avg(reward) r FROM rollouts GROUP BY 1 ORDER BY 1"
      asyncgrpo sql runs/demo --format csv "SELECT * FROM consumed" > ledger.csv
      asyncgrpo sql runs/demo          # interactive
    """
    from buffer.sql import BufferSQL, SqlError
    from pipeline.output import print_table

    db = BufferSQL(path)
    if query is not None:
        print_table(db.query(query), fmt, max_width)
        return
    if not sys.stdin.isatty():
        text = sys.stdin.read()
        if not text.strip():
            raise UserError("no query given: pass QUERY or pipe SQL on stdin")
        print_table(db.query(text), fmt, max_width)
        return
    _interactive(db, fmt, max_width, SqlError)


def _interactive(db, fmt: str, max_width: int, sql_error) -> None:
    import readline  # noqa: F401 - line editing and history for input()

    from pipeline.output import print_table
    click.echo("asyncgrpo sql: views rollouts, groups, consumed, metrics, quarantined. "
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
            print_table(db.query(text), fmt, max_width)
        except sql_error as e:
            click.echo(f"error: {e}", err=True)


@main.command()
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--trainer-version", type=click.IntRange(min=0), default=None,
              help="Version to judge staleness against [default: the newest in the ledger, "
                   "else the newest group version].")
@click.option("--max-staleness", type=click.IntRange(min=0), default=None,
              help="Staleness limit for 'expired' [default: unlimited].")
@click.option("--reuse", type=click.IntRange(min=1), default=1, show_default=True,
              help="Times a group may be trained on before it counts as consumed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@_user_errors
def status(path: str, trainer_version: int | None, max_staleness: int | None, reuse: int,
           as_json: bool) -> None:
    """Groups per state and per version, files and bytes of the buffer at PATH.

    States: eligible (may be pulled), consumed, filtered (all rewards equal),
    expired (staler than --max-staleness), future (newer than the trainer),
    unavailable (shard quarantined). Unreadable shards are reported, not moved.

    \b
    Examples:
      asyncgrpo status runs/demo
      asyncgrpo status runs/demo --max-staleness 2 --json
    """
    from pipeline.status import buffer_status, print_status

    report = buffer_status(path, trainer_version=trainer_version, max_staleness=max_staleness,
                           reuse=reuse)
    if as_json:
        import json
        click.echo(json.dumps(report, indent=1))
    else:
        print_status(report)


@main.command()
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--target-groups", type=click.IntRange(min=2), default=4096, show_default=True,
              help="Groups per merged shard.")
@click.option("--min-age", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds a shard must be old before it is merged (sealed).")
@click.option("--grace", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds merged-away shards stay on disk for readers that listed them.")
@_user_errors
def compact(path: str, target_groups: int, min_age: float, grace: float) -> None:
    """Merge small sealed shards of the buffer at PATH into large ones.

    Safe while generators, the trainer and SQL queries run: readers go
    through the manifest, and replaced files are deleted after --grace.

    \b
    Example:
      asyncgrpo compact runs/demo --min-age 0
    """
    from buffer.compaction import compact as do_compact
    from buffer.layout import find_buffer

    r = do_compact(find_buffer(path), target_groups=target_groups, min_age_s=min_age, grace_s=grace)
    click.echo(f"merged {r.merged_files} shards ({r.groups} groups) into {r.written_files}; "
               f"deleted {r.deleted_files} replaced shards; quarantined {r.quarantined}")


@main.command()
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
@_user_errors
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
    from pipeline.demo import run_demo

    run_demo(run_dir, groups=groups, group_size=group_size, groups_per_step=groups_per_step,
             max_staleness=max_staleness, seed=seed, force=force)


from pipeline import commands  # noqa: E402,F401  (registers the pipeline's commands on `main`)

if __name__ == "__main__":
    main()
