"""Commands that reuse a run's stored rollouts: export (datasets) and rescore (a new reward, a new run)."""

from __future__ import annotations

import json

import click

from pipeline.errors import user_errors
from pipeline.export import KINDS, export_run
from pipeline.rescore import rescore_run


@click.command()
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--to", "to", required=True, type=click.Path(), metavar="DIR",
              help="Folder to write <kind>.parquet into; it must be new or empty (or see --force).")
@click.option("--kind", required=True, type=click.Choice(KINDS),
              help="sft: the best correct completion per prompt; pairs: (chosen, rejected) from each group "
                   "whose rewards differ; rollouts: every completion with its rewards and versions.")
@click.option("--versions", default=None, metavar="A:B",
              help="Only groups of these policy versions, inclusive (A:, :B and a single version work too).")
@click.option("--where", default=None, metavar="SQL",
              help="Only completions for which this SQL condition on the rollouts view holds, e.g. "
                   "\"finish_reason = 'stop' AND task = 'arithmetic'\" (before sft/pairs pick their rows).")
@click.option("--force", is_flag=True, help="Replace DIR if it holds only Parquet files (an earlier export).")
@user_errors
def export(run: str, to: str, kind: str, versions: str | None, where: str | None, force: bool) -> None:
    """Write the rollouts stored in RUN's buffer as a dataset: DIR/KIND.parquet.

    The file loads with datasets.load_dataset("parquet", data_files="DIR/KIND.parquet").
    Columns: sft: prompt, completion, reward, version, group_id, traj_id,
    prompt_id, task, num_tokens (best = highest reward, then fewest tokens,
    among correct completions). pairs: prompt, chosen, rejected,
    chosen_reward, rejected_reward (chosen_reward > rejected_reward: a group's
    best and worst completions), group_id, prompt_id, task, version, and the
    two traj_ids. rollouts: every column of the rollouts view, with the reward
    map spread into one reward/<function> column each. Shards that retention
    archived are not exported. Written beside DIR and renamed into place.

    \b
    Examples:
      asyncgrpo export runs/a --to data/a-sft --kind sft
      asyncgrpo export runs/a --to data/a-pairs --kind pairs --versions 50:
      asyncgrpo export runs/a --to data/a-all --kind rollouts --where "finish_reason = 'stop'"
    """
    r = export_run(run, to, kind, versions=versions, where=where, force=force)
    click.echo(f"wrote {r.rows} rows ({r.kind}) to {r.file}")
    click.echo(f'load it with: datasets.load_dataset("parquet", data_files="{r.file}")')


@click.command()
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--reward-config", "reward_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="A TOML file with one [reward] table (as in a run's config), laid on RUN's reward.")
@click.option("--set", "overrides", multiple=True, metavar="reward.KEY=VALUE",
              help="Override one reward field (repeatable), e.g. --set reward.correct=format; a list is set whole.")
@click.option("--out", required=True, type=click.Path(file_okay=False), metavar="NEW_RUN",
              help="The new run directory (must not exist, or be empty; see --force).")
@click.option("--force", is_flag=True, help="Replace NEW_RUN if an earlier rescore wrote it.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@user_errors
def rescore(run: str, reward_file: str | None, overrides: tuple[str, ...], out: str, force: bool,
            as_json: bool) -> None:
    """Score RUN's stored completions with another reward and write them as a new run, NEW_RUN.

    The new reward is RUN's [reward] with --reward-config's [reward] table and
    then --set reward.KEY=VALUE laid on it, as for a run's config. Each
    completion is scored against its prompt's answer (looked up in RUN's
    task); the buffer writer computes each group's statistics, advantages and
    filter flag as for a generator. Token ids, behaviour log-probs, versions
    and prompts are unchanged. NEW_RUN has config.toml (the new reward), run.json
    (RUN's initial model, rescored_from, this report), buffer/ and
    rescored_groups.parquet (old and new group ids, state before and after),
    so `asyncgrpo sql`, `status` and `ablate --replay NEW_RUN` take it.

    Reports groups per state (trainable, all_correct, all_wrong, all_equal)
    before and after, how many flipped between filtered and trainable, and the
    Pearson correlation of old and new rewards over completions.

    \b
    Examples:
      asyncgrpo rescore runs/a --out runs/a-format \\
          --set 'reward.functions=[{name = "accuracy"}, {name = "format", weight = 0.5}]'
      asyncgrpo rescore runs/a --reward-config my_reward.toml --out runs/a-mine --json
      asyncgrpo ablate --staleness 0,2 --seeds 1 --replay runs/a-format --out runs/replay-format
    """
    report = rescore_run(run, out, reward_file=reward_file, overrides=overrides, force=force,
                         show_progress=not as_json)
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    click.echo(f"rescored {report['groups']} groups ({report['completions']} completions) of {run} into {out}")
    click.echo(f"{'groups':<12} {'before':>8} {'after':>8}")
    for s in report["states_before"]:
        click.echo(f"{s:<12} {report['states_before'][s]:>8} {report['states_after'][s]:>8}")
    click.echo(f"filtered -> trainable: {report['filtered_to_trainable']}, trainable -> filtered: "
               f"{report['trainable_to_filtered']}, filtered for another reason: {report['filtered_other_reason']}")
    corr = report["reward_correlation"]
    click.echo(f"reward: mean {report['reward_mean_before']:.4f} -> {report['reward_mean_after']:.4f}, "
               f"{report['completions_reward_changed']} completions changed, Pearson correlation "
               f"{'undefined (constant rewards)' if corr is None else f'{corr:.4f}'}, "
               f"{report['reward_errors']} reward errors")
    click.echo(f"train on it: asyncgrpo ablate --replay {out} --out DIR")
