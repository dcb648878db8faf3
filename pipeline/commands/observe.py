"""Commands that show a run: plot (PNG and HTML charts) and track (feed TensorBoard / W&B).

Thin: pipeline.plot and pipeline.trackers do the work; matplotlib, plotly,
tensorboard and wandb load when a command runs, so `--help` stays fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from buffer.store import RemotePath, as_path
from pipeline.commands.options import setup_logging
from pipeline.config import ConfigError, load_run_config
from pipeline.errors import UserError, user_errors
from pipeline.plot import write_plots
from pipeline.schema import to_dict
from pipeline.trackers import Follower, TRACKER_NAMES, open_trackers, trackers_dir


def _run_dir(run: str):
    p = as_path(run)
    exists = (p / "config.toml").is_file() or (p / "buffer").is_dir() if isinstance(p, RemotePath) else p.is_dir()
    if not exists:
        raise UserError(f"run directory {run!r} does not exist")
    return p


@click.command()
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), default=None, metavar="FILE.png",
              help="Where the PNG goes (default RUN/plot.png); the HTML page and the points per panel (.json) "
              "are written beside it with the same stem.")
@click.option("--json", "as_json", is_flag=True, help="Print the points drawn per panel as JSON.")
@user_errors
def plot(run: str, out: str | None, as_json: bool) -> None:
    """Draw a run's charts: one PNG and one HTML page (plotly, works offline).

    Reward and batch accuracy, greedy accuracy before and after, KL to the
    reference and to the behaviour policy, clipped and IS-truncated tokens,
    importance weights, filtered groups by reason, trainer and generator
    idle shares, throughput (each against trainer step and wall time), and
    the staleness of consumed groups. `asyncgrpo run` writes the same to
    RUN/plot.png every run.plot_every_s and at its end. Reads only; works
    while the run runs.

    \b
    Examples:
      asyncgrpo plot runs/default                 # runs/default/plot.png and plot.html
      asyncgrpo plot runs/default --out /tmp/a.png
    """
    if out is not None and not out.endswith(".png"):
        raise UserError(f"--out {out!r}: expected a file name ending in .png")
    summary = write_plots(_run_dir(run), out)
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    empty = [k for k, p in summary["panels"].items() if p["points"] == 0]
    click.echo(f"wrote {summary['png']} and {summary['html']}"
               + (f" (no data yet in: {', '.join(empty)})" if empty else ""))


def _run_config(run_dir: Path) -> dict:
    """The run's resolved config for the trackers' run page (empty where there is none, or it is unreadable)."""
    try:
        return to_dict(load_run_config(run_dir))
    except ConfigError:
        return {}


@click.command()
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--report-to", "report_to", required=True, metavar="NAMES",
              help="Comma-separated trackers: tensorboard, wandb (W&B offline unless WANDB_MODE is set).")
@click.option("--every", "every_s", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds between looks at the run's files.")
@click.option("--once", is_flag=True, help="Log what the run holds now and exit (a finished run).")
@click.option("--samples-every", "samples_every_s", type=click.FloatRange(min=0), default=60.0,
              show_default=True, help="Seconds between tables of sample completions (of the newest version).")
@user_errors
def track(run: str, report_to: str, every_s: float, once: bool, samples_every_s: float) -> None:
    """Feed TensorBoard and/or W&B from a run's files, for daemons started by hand.

    What `asyncgrpo run` does with run.report_to: every trainer step's
    metrics, the generators' batches summed (generator/*), and a table of
    sample completions of the newest version now and then. Logs to
    RUN/trackers/; remembers what it logged there, so running it again
    (or after `asyncgrpo run`) logs no row twice. Stops on Ctrl-C, or
    after one look with --once.

    \b
    Examples:
      asyncgrpo track runs/default --report-to tensorboard,wandb
      asyncgrpo track runs/default --report-to tensorboard --once && tensorboard --logdir runs/default/trackers
    """
    setup_logging()
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    bad = [n for n in names if n not in TRACKER_NAMES]
    if bad or not names:
        raise UserError(f"--report-to {report_to!r}: expected trackers from {', '.join(TRACKER_NAMES)}, "
                        "comma-separated")
    run_dir = _run_dir(run)
    trackers, state = open_trackers(names, run_dir, _run_config(run_dir))
    follower = Follower(run_dir, trackers, state, samples_every_s=samples_every_s)
    try:
        while True:
            follower.poll(final=once)
            if once or not follower.trackers:
                break
            time.sleep(every_s)
    except KeyboardInterrupt:
        follower.poll(final=True)
    finally:
        follower.close()
    click.echo(f"logged {follower.logged_steps} trainer steps (up to step {state['step']}) to "
               f"{', '.join(names)} in {trackers_dir(run_dir)}")
