"""Re-score a run's stored completions with another reward configuration, into a new run.

    read every live rollout of RUN (oldest group first)
    score each completion with the new [reward] against its prompt's answer
    append each group, with its new rewards, to NEW_RUN/buffer through ShardWriter, which
      computes the group statistics, advantages and filter flag as it does for a generator
    NEW_RUN/config.toml: RUN's config with the new [reward]; NEW_RUN/run.json: RUN's initial
      model, rescored_from, and the report; NEW_RUN/rescored_groups.parquet: old and new group
      ids with their states before and after

Prompts, token ids, behaviour log-probs, versions, sampling settings, finish
reasons and generator ids are carried over unchanged; group ids, traj ids and
created_at are the new writer's (the groups are appended in the source's order,
so the order by created_at is kept). The buffer stores no answers: each prompt
is looked up by prompt_id in RUN's task (its config's [task]), as the generator
had it. NEW_RUN is written beside its final name and renamed into place
(pipeline.staging). Shards that retention archived are not rescored.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import buffer
from buffer.layout import BufferDir
from pipeline.config import load_run_config, parse_override, read_toml, save_config, with_tables
from pipeline.errors import DataError
from pipeline.rundir import read_run_info, write_run_info
from pipeline.schema import to_dict
from pipeline.staging import check_target, staged_dir
from workers.rewards import Scorer
from workers.tasks import load_task

GROUP_MAP = "rescored_groups.parquet"
"""NEW_RUN/<this>: one row per group: source_group_id, group_id, version, before, after (state names)."""
TRAINABLE = "trainable"
"""A group's state: this, or the reason it is filtered (buffer.FILTER_REASONS)."""
_COLUMNS = ["group_id", "prompt_id", "task", "prompt", "prompt_ids", "completion", "completion_ids",
            "behavior_logprobs", "finish_reason", "reward", "filtered", "filter_reason", "version",
            "generator_id", "temperature", "top_p", "top_k"]
_FLUSH_GROUPS = 1024
"""Groups per shard of the new buffer: it is written once, so few large shards (row groups stay 64 groups)."""


def new_config(run: Path, reward_file: str | None, overrides: tuple[str, ...] | list[str]):
    """RUN's config with the [reward] table of `reward_file` and then the reward.* `overrides` on it."""
    tables: dict = {}
    if reward_file is not None:
        data = read_toml(reward_file)
        other = sorted(k for k in data if k != "reward")
        if other or "reward" not in data:
            raise DataError(f"--reward-config {reward_file!r}: rescore changes only the reward, so the file "
                            f"holds one [reward] table (found {', '.join(f'[{k}]' for k in sorted(data)) or 'none'})")
        tables = {"reward": data["reward"]}
    for item in overrides:
        key, _ = parse_override(item)
        if not key.startswith("reward."):
            raise DataError(f"--set {item!r}: rescore changes only the reward; set reward.* keys, e.g. "
                            "--set 'reward.functions=[{name = \"accuracy\"}, {name = \"format\", weight = 0.5}]'")
    if not tables and not overrides:
        raise DataError("no new reward given: pass --reward-config FILE (a [reward] table) and/or "
                        "--set reward.KEY=VALUE")
    where = " and ".join([f"--reward-config {reward_file!r}"] * (reward_file is not None)
                         + ["--set"] * bool(overrides))
    return with_tables(load_run_config(run), tables, overrides, where)


def _is_rescored_run(folder: Path) -> str | None:
    """None when `folder` is a run an earlier rescore wrote, else why it must be kept."""
    if "rescored_from" not in read_run_info(folder):
        return "it is not a run written by `asyncgrpo rescore` (its run.json has no rescored_from)"
    return None


def rescore_run(run: str | Path, out: str | Path, *, reward_file: str | None = None,
                overrides: tuple[str, ...] | list[str] = (), force: bool = False,
                show_progress: bool = False) -> dict:
    """Write NEW_RUN `out` from run `run` with the new reward (see the module doc); returns the report."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from rich.console import Console
    from rich.progress import Progress

    run, out = Path(run), Path(out)
    if not run.is_dir():
        raise DataError(f"run directory {str(run)!r} does not exist")
    if not BufferDir.is_buffer(run / "buffer"):
        raise DataError(f"{str(run)!r} has no buffer (no {run / 'buffer' / 'shards'}); name a run directory")
    if out.resolve() == run.resolve() or out.resolve() in run.resolve().parents:
        raise DataError(f"--out {str(out)!r} would replace the source run {str(run)!r}; name a new folder")
    cfg = new_config(run, reward_file, overrides)
    check_target(out, "--out", force, _is_rescored_run)
    scorer = Scorer(cfg.reward)   # imports the reward functions: a bad import path is an error here
    task = load_task(load_run_config(run).task)
    prompts = {p.prompt_id: p for p in task.train + task.eval}
    rows = _read_rollouts(run, prompts)

    mapping: dict[str, list] = {"source_group_id": [], "group_id": [], "version": [], "before": []}
    new_rewards: list[float] = []
    with staged_dir(out) as stage, Progress(console=Console(stderr=True), transient=True,
                                            disable=not show_progress) as progress:
        bar = progress.add_task("rescoring groups", total=len(set(rows.column("group_id").to_pylist())))
        writers: dict[str, buffer.ShardWriter] = {}   # one per generator id, so that column is kept
        try:
            for source_id, before, gen, stored in _stored_groups(rows):
                group = _rescored(stored, prompts[stored.prompt_id], scorer)
                if gen not in writers:
                    writers[gen] = buffer.ShardWriter(stage / "buffer", generator_id=gen,
                                                      flush_groups=_FLUSH_GROUPS, flush_seconds=None)
                mapping["group_id"].append(writers[gen].append(group))
                mapping["source_group_id"].append(source_id)
                mapping["version"].append(group.version)
                mapping["before"].append(before)
                new_rewards += [c.reward for c in group.completions]
                progress.advance(bar)
        finally:
            for w in writers.values():
                w.close()
        written = buffer.BufferSQL(stage).query("SELECT group_id, filtered, filter_reason FROM groups").to_pylist()
        after = {r["group_id"]: r["filter_reason"] if r["filtered"] else TRAINABLE for r in written}
        mapping["after"] = [after[g] for g in mapping["group_id"]]
        report = _report(run, out, cfg, mapping, rows.column("reward").to_pylist(), new_rewards, scorer.num_errors)
        pq.write_table(pa.table({k: pa.array(v, pa.int64() if k == "version" else pa.string())
                                 for k, v in mapping.items()}), stage / GROUP_MAP)
        save_config(cfg, stage / "config.toml")
        info = {k: v for k, v in read_run_info(run).items() if k == "initial_model"}
        write_run_info(stage, {**info, "rescored_from": str(run.resolve()), "rescore": report})
    return report


def _read_rollouts(run: Path, prompts: dict):
    """RUN's live rollouts, oldest group first, each group's rows together in sample order."""
    rows = buffer.BufferSQL(run).query(f"SELECT {', '.join(_COLUMNS)} FROM rollouts "
                                       "ORDER BY created_at, group_id, sample_index")
    if rows.num_rows == 0:
        raise DataError(f"the buffer of {str(run)!r} holds no rollouts to rescore")
    missing = sorted(set(rows.column("prompt_id").to_pylist()) - set(prompts))
    if missing:
        raise DataError(f"{len(missing)} stored prompt ids are not in the task of {run / 'config.toml'} "
                        f"(e.g. {missing[0]!r}): their answers are unknown; was the prompt file changed?")
    return rows.combine_chunks()


def _stored_groups(rows) -> Iterator[tuple[str, str, str, buffer.Group]]:
    """(source group id, its state, generator id, the group) for each group of `rows` (from _read_rollouts),
    in order, each completion with its stored reward.

    Token ids and log-probs are numpy views of the Arrow buffers, so they are written back bit for bit.
    """
    py = {name: rows.column(name).to_pylist() for name in
          ("group_id", "prompt_id", "task", "prompt", "completion", "finish_reason", "reward", "filtered",
           "filter_reason", "version", "generator_id", "temperature", "top_p", "top_k")}

    def lists(name: str):   # one chunk: _read_rollouts combined them
        arr = rows.column(name).chunk(0)
        return arr.values.to_numpy(), arr.offsets.to_numpy()

    (ids, id_off), (lps, lp_off), (pids, pid_off) = lists("completion_ids"), lists("behavior_logprobs"), \
        lists("prompt_ids")
    gids = py["group_id"]
    starts = [i for i in range(len(gids)) if i == 0 or gids[i] != gids[i - 1]]
    for s, e in zip(starts, starts[1:] + [len(gids)]):
        completions = [buffer.Completion(text=py["completion"][i], token_ids=ids[id_off[i]:id_off[i + 1]],
                                         logprobs=lps[lp_off[i]:lp_off[i + 1]], reward=py["reward"][i],
                                         finish_reason=py["finish_reason"][i]) for i in range(s, e)]
        group = buffer.Group(prompt_id=py["prompt_id"][s], prompt=py["prompt"][s],
                             prompt_ids=pids[pid_off[s]:pid_off[s + 1]], version=py["version"][s],
                             completions=completions, task=py["task"][s], temperature=py["temperature"][s],
                             top_p=py["top_p"][s], top_k=py["top_k"][s])
        before = py["filter_reason"][s] if py["filtered"][s] else TRAINABLE
        yield gids[s], before, py["generator_id"][s], group


def _rescored(group, prompt, scorer: Scorer):
    """`group` with each completion scored by `scorer` against `prompt`, as the generator scores them."""
    completions = []
    for c in group.completions:
        score = scorer.score(prompt, c.text)
        completions.append(replace(c, reward=score.reward, reward_components=score.components,
                                   correct=score.correct, reward_error=score.error))
    return replace(group, completions=completions)


def _report(run: Path, out: Path, cfg, mapping: dict, old: list[float], new: list[float], errors: int) -> dict:
    before, after = mapping["before"], mapping["after"]
    moves = Counter(f"{b} -> {a}" for b, a in zip(before, after) if b != a)
    states = (TRAINABLE, *buffer.FILTER_REASONS)
    return {
        "source": str(run), "out": str(out), "groups": len(before), "completions": len(old),
        "reward_before": to_dict(load_run_config(run).reward), "reward": to_dict(cfg.reward),
        "states_before": {s: before.count(s) for s in states},
        "states_after": {s: after.count(s) for s in states},
        "filtered_to_trainable": sum(b != TRAINABLE and a == TRAINABLE for b, a in zip(before, after)),
        "trainable_to_filtered": sum(b == TRAINABLE and a != TRAINABLE for b, a in zip(before, after)),
        "filtered_other_reason": sum(TRAINABLE not in (b, a) and b != a for b, a in zip(before, after)),
        "changes": dict(sorted(moves.items())),
        "reward_mean_before": math.fsum(old) / len(old), "reward_mean_after": math.fsum(new) / len(new),
        "reward_correlation": pearson(old, new),
        "completions_reward_changed": sum(a != b for a, b in zip(old, new)),
        "reward_errors": errors,
    }


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation of x and y, sums taken exactly (math.fsum), so it is the same on every machine;
    None when either is constant (undefined)."""
    n = len(x)
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    dx, dy = [a - mx for a in x], [b - my for b in y]
    sxx, syy = math.fsum(a * a for a in dx), math.fsum(b * b for b in dy)
    if sxx == 0 or syy == 0:
        return None
    return math.fsum(a * b for a, b in zip(dx, dy)) / math.sqrt(sxx * syy)
