"""The `asyncgrpo` command: every command in one list below. A thin layer over the library.

The work is done in buffer/, workers/ and pipeline/; the commands in
pipeline/commands/ parse options, call it and print. User errors print one
paragraph and exit with code 2 (pipeline.errors). Heavy libraries (torch,
pyarrow, DuckDB) load when a command runs, so `--help` stays fast.
"""

from __future__ import annotations

import warnings

import click

from pipeline.commands import daemons, data, experiments, observe, reuse


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


main.add_command(daemons.run)
main.add_command(daemons.generate)
main.add_command(daemons.train)
main.add_command(daemons.compactor)
main.add_command(daemons.eval_cmd)
main.add_command(daemons.warmstart)
main.add_command(daemons.init_model_cmd)
main.add_command(data.sql)
main.add_command(data.status)
main.add_command(data.compact)
main.add_command(data.demo)
main.add_command(reuse.export)
main.add_command(reuse.rescore)
main.add_command(observe.plot)
main.add_command(observe.track)
main.add_command(experiments.config)
main.add_command(experiments.ablate)

if __name__ == "__main__":
    main()
