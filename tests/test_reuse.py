"""`asyncgrpo export` and `asyncgrpo rescore` on a run whose buffer holds known groups.

The source run is built without generating: real arithmetic prompts of the
default task, completions that are the right answer or a wrong one, tokenized
with the cached tiny model's tokenizer, scored with the default reward and
written through ShardWriter (two generator ids). Per version (0, 1, 2) six
groups of G = 4: one all correct, one all wrong, four mixed; the six prompts
repeat in every version. One completion of each [1, 0, 1, 0] group stopped at
the length limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from buffer import BufferSQL, ShardWriter
from buffer.groups import Completion, Group
from conftest import CACHE, run_cli
from pipeline.config import load_config, save_config
from pipeline.rundir import prepare_model, write_run_info
from workers.rewards import Scorer
from workers.tasks import load_task

G = 4
PATTERNS = [(1, 1, 1, 1), (0, 0, 0, 0), (1, 0, 0, 0), (1, 1, 0, 0), (0, 1, 1, 1), (1, 0, 1, 0)]
VERSIONS = (0, 1, 2)
INVERTED = "tests.helpers.rescore_rewards:inverted"
SETTINGS = [f"model.cache_dir={CACHE}", "generator.num_generations=4", "trainer.groups_per_step=4"]


def q(path: Path, sql: str) -> list[dict]:
    return BufferSQL(path).query(sql).to_pylist()


def load(file: Path, tmp_path: Path):
    import datasets

    return datasets.load_dataset("parquet", data_files=str(file), split="train", cache_dir=str(tmp_path / "hf"))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from workers.model import load_tokenizer

    run = tmp_path_factory.mktemp("reuse") / "src"
    cfg = load_config(None, SETTINGS)
    model = prepare_model(cfg, echo=lambda *_: None)
    tok = load_tokenizer(model)
    prompts = load_task(cfg.task).train[:len(PATTERNS)]
    scorer = Scorer(cfg.reward)
    rng = np.random.default_rng(0)
    run.mkdir()
    save_config(cfg, run / "config.toml")
    write_run_info(run, {"initial_model": str(model)})
    writers = [ShardWriter(run / "buffer", generator_id=g, flush_groups=4, flush_seconds=None)
               for g in ("gen0", "gen1")]
    for v in VERSIONS:
        for k, (p, pattern) in enumerate(zip(prompts, PATTERNS)):
            comps = []
            for i, right in enumerate(pattern):
                text = p.answer if right else str(int(p.answer) + 1 + i)
                ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                s = scorer.score(p, text)
                comps.append(Completion(text=text, token_ids=ids,
                                        logprobs=-rng.random(len(ids)).astype(np.float32), reward=s.reward,
                                        finish_reason="length" if pattern == (1, 0, 1, 0) and i == 3 else "stop",
                                        reward_components=s.components, correct=s.correct))
            writers[k % 2].append(Group(prompt_id=p.prompt_id, prompt=p.text, prompt_ids=tok(p.text)["input_ids"],
                                        version=v, completions=comps, task="arithmetic"))
    for w in writers:
        w.close()
    return run


@pytest.fixture(scope="module")
def inverted(source) -> tuple[Path, dict]:
    out = source.parent / "inverted"
    r = run_cli("rescore", str(source), "--out", str(out), "--json",
                "--set", f"reward.functions=[{{name = '{INVERTED}'}}]", "--set", f"reward.correct={INVERTED}")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


# ---- export ----------------------------------------------------------------------------------

def test_export_sft_is_the_best_correct_completion_per_prompt(source, tmp_path):
    r = run_cli("export", str(source), "--to", str(tmp_path / "sft"), "--kind", "sft")
    assert r.returncode == 0, r.stderr
    assert f"wrote 5 rows (sft) to {tmp_path / 'sft' / 'sft.parquet'}" in r.stdout
    ds = load(tmp_path / "sft" / "sft.parquet", tmp_path)
    expected = q(source, "SELECT count(DISTINCT prompt_id) n FROM rollouts WHERE correct")[0]["n"]
    assert ds.num_rows == expected == 5          # every prompt but the all-wrong one
    assert ds.column_names == ["prompt", "completion", "reward", "version", "group_id", "traj_id", "prompt_id",
                               "task", "num_tokens"]
    src = {x["traj_id"]: x for x in q(source, "SELECT traj_id, correct, completion, prompt FROM rollouts")}
    for row in ds:
        assert src[row["traj_id"]]["correct"] is True
        assert (row["completion"], row["prompt"]) == (src[row["traj_id"]]["completion"], src[row["traj_id"]]["prompt"])
        assert row["version"] == 2     # equal rewards and lengths: the newest version wins


def test_export_pairs_have_chosen_above_rejected(source, tmp_path):
    r = run_cli("export", str(source), "--to", str(tmp_path / "pairs"), "--kind", "pairs")
    assert r.returncode == 0, r.stderr
    ds = load(tmp_path / "pairs" / "pairs.parquet", tmp_path)
    groups = {x["group_id"]: x for x in q(source, "SELECT group_id, reward_min, reward_max FROM groups")}
    assert ds.num_rows == sum(g["reward_max"] > g["reward_min"] for g in groups.values()) == 12
    for row in ds:
        assert row["chosen_reward"] > row["rejected_reward"]
        g = groups[row["group_id"]]
        assert (row["chosen_reward"], row["rejected_reward"]) == (g["reward_max"], g["reward_min"])
        assert row["chosen"] != row["rejected"]


def test_export_rollouts_has_every_completion_and_its_reward_components(source, tmp_path):
    r = run_cli("export", str(source), "--to", str(tmp_path / "all"), "--kind", "rollouts")
    assert r.returncode == 0, r.stderr
    ds = load(tmp_path / "all" / "rollouts.parquet", tmp_path)
    assert ds.num_rows == q(source, "SELECT count(*) n FROM rollouts")[0]["n"] == 72
    for name in ("reward", "reward/accuracy", "version", "filtered", "filter_reason", "behavior_logprobs",
                 "completion_ids", "advantage", "correct"):
        assert name in ds.column_names
    assert "reward_components" not in ds.column_names
    assert ds["reward/accuracy"] == ds["reward"]
    table = pq.read_table(tmp_path / "all" / "rollouts.parquet")
    src = BufferSQL(source).query("SELECT * FROM rollouts ORDER BY version, group_id, sample_index")
    for name in ("traj_id", "completion_ids", "behavior_logprobs", "version", "advantage", "filter_reason"):
        assert table.column(name).equals(src.column(name)), name


def test_export_filters_by_versions_and_where(source, tmp_path):
    where = "finish_reason = 'stop' AND reward > 0"
    r = run_cli("export", str(source), "--to", str(tmp_path / "f"), "--kind", "rollouts", "--versions", "1:2",
                "--where", where)
    assert r.returncode == 0, r.stderr
    got = pq.read_table(tmp_path / "f" / "rollouts.parquet")
    expected = q(source, f"SELECT count(*) n FROM rollouts WHERE version BETWEEN 1 AND 2 AND {where}")[0]["n"]
    assert got.num_rows == expected == 2 * 12   # the length-limited completions are wrong ones
    assert set(got.column("version").to_pylist()) == {1, 2} and set(got.column("finish_reason").to_pylist()) == {"stop"}
    r = run_cli("export", str(source), "--to", str(tmp_path / "v0"), "--kind", "sft", "--versions", ":0")
    assert r.returncode == 0, r.stderr
    assert set(pq.read_table(tmp_path / "v0" / "sft.parquet").column("version").to_pylist()) == {0}
    # --where applies to rows before pairs are formed: with only the correct completions no group has a pair.
    r = run_cli("export", str(source), "--to", str(tmp_path / "p"), "--kind", "pairs", "--versions", "2",
                "--where", "correct")
    assert r.returncode == 0, r.stderr
    assert pq.read_table(tmp_path / "p" / "pairs.parquet").num_rows == 0
    assert "wrote 0 rows (pairs)" in r.stdout


def test_export_bad_input_is_exit_2_and_writes_nothing(source, tmp_path):
    to = tmp_path / "out"
    cases = [
        (["export", str(tmp_path / "nope"), "--to", str(to), "--kind", "sft"], "nope"),
        (["export", str(source), "--to", str(to), "--kind", "dpo"], "'dpo'"),
        (["export", str(source), "--to", str(to), "--kind", "sft", "--where", "rewrd > 0"], "--where 'rewrd > 0'"),
        (["export", str(source), "--to", str(to), "--kind", "sft", "--where", "1; DROP TABLE x"], "--where"),
        (["export", str(source), "--to", str(to), "--kind", "sft", "--where",
          "true) UNION ALL (SELECT * FROM rollouts"], "is not one SQL condition"),
        (["export", str(source), "--to", str(to), "--kind", "sft", "--versions", "5:3"], "--versions '5:3'"),
        (["export", str(source), "--to", str(to), "--kind", "sft", "--versions", "a"], "--versions 'a'"),
    ]
    shards = sorted(p.name for p in (source / "buffer" / "shards").iterdir())
    for inside in (source / "buffer" / "shards", source):   # --force there would delete the buffer
        r = run_cli("export", str(source), "--to", str(inside), "--kind", "sft", "--force")
        assert r.returncode == 2 and "is inside (or holds) the run" in r.stderr, r.stderr
    assert sorted(p.name for p in (source / "buffer" / "shards").iterdir()) == shards
    for args, named in cases:
        r = run_cli(*args)
        assert r.returncode == 2 and named in r.stderr, (args, r.stderr)
        assert not to.exists() and not list(tmp_path.glob(".out.*")), args
    to.mkdir()
    (to / "notes.txt").write_text("mine")
    for extra in ([], ["--force"]):    # --force replaces only a folder of Parquet files
        r = run_cli("export", str(source), "--to", str(to), "--kind", "sft", *extra)
        assert r.returncode == 2 and str(to) in r.stderr and "--to" in r.stderr, r.stderr
        assert [p.name for p in to.iterdir()] == ["notes.txt"]
    (to / "notes.txt").unlink()
    assert run_cli("export", str(source), "--to", str(to), "--kind", "pairs").returncode == 0   # empty: fine
    r = run_cli("export", str(source), "--to", str(to), "--kind", "sft", "--force")
    assert r.returncode == 0, r.stderr
    assert [p.name for p in to.iterdir()] == ["sft.parquet"]


# ---- rescore ---------------------------------------------------------------------------------

def _aligned(source: Path, new: Path) -> tuple[pa.Table, pa.Table]:
    """The source's and NEW_RUN's rollouts, row i of one the same completion as row i of the other."""
    mapping = pq.read_table(new / "rescored_groups.parquet").to_pylist()
    to_source = {m["group_id"]: m["source_group_id"] for m in mapping}
    old = BufferSQL(source).query("SELECT * FROM rollouts").sort_by([("group_id", "ascending"),
                                                                     ("sample_index", "ascending")])
    fresh = BufferSQL(new).query("SELECT * FROM rollouts")
    fresh = fresh.append_column("source_group_id",
                                pa.array([to_source[g] for g in fresh.column("group_id").to_pylist()]))
    fresh = fresh.sort_by([("source_group_id", "ascending"), ("sample_index", "ascending")])
    assert fresh.column("source_group_id").equals(old.column("group_id"))
    return old, fresh


UNCHANGED = ["prompt_id", "task", "prompt", "prompt_ids", "completion", "completion_ids", "behavior_logprobs",
             "num_tokens", "finish_reason", "version", "generator_id", "temperature", "top_p", "top_k", "sample_index",
             "group_size"]


def test_rescore_with_an_inverted_reward_flips_every_advantage(source, inverted):
    new, report = inverted
    old, fresh = _aligned(source, new)
    for name in UNCHANGED:      # byte-identical: Arrow equality of the whole column
        assert fresh.column(name).equals(old.column(name)), name
    assert fresh.column("reward").to_pylist() == [1.0 - r for r in old.column("reward").to_pylist()]
    trainable = pc.invert(old.column("filtered"))
    assert pc.all(pc.equal(fresh.column("filtered"), old.column("filtered"))).as_py()
    assert fresh.filter(trainable).column("advantage").equals(
        pc.negate(old.filter(trainable).column("advantage")))        # exactly, sign by sign
    assert pc.all(pc.not_equal(old.filter(trainable).column("advantage"), 0)).as_py()
    swap = {"all_correct": "all_wrong", "all_wrong": "all_correct"}
    filtered = old.column("filtered").to_pylist()
    assert [swap[r] for r, f in zip(old.column("filter_reason").to_pylist(), filtered) if f] == \
        [r for r, f in zip(fresh.column("filter_reason").to_pylist(), filtered) if f]
    assert report["states_before"] == {"trainable": 12, "all_correct": 3, "all_wrong": 3, "all_equal": 0}
    assert report["states_after"] == {"trainable": 12, "all_correct": 3, "all_wrong": 3, "all_equal": 0}
    flips = (report["filtered_to_trainable"], report["trainable_to_filtered"], report["filtered_other_reason"])
    assert flips == (0, 0, 6)
    assert report["changes"] == {"all_correct -> all_wrong": 3, "all_wrong -> all_correct": 3}
    assert report["reward_correlation"] == pytest.approx(-1.0, abs=1e-12)
    assert (report["groups"], report["completions"], report["completions_reward_changed"]) == (18, 72, 72)
    assert report["reward_mean_before"] == report["reward_mean_after"] == 36 / 72
    info = json.loads((new / "run.json").read_text())
    assert info["rescored_from"] == str(source.resolve()) and info["rescore"] == report
    assert info["initial_model"] == json.loads((source / "run.json").read_text())["initial_model"]
    assert load_config(new / "config.toml").reward.correct == INVERTED
    assert not list(new.parent.glob(".inverted.*"))


def test_rescored_run_takes_sql_and_status(inverted):
    new, _ = inverted
    r = run_cli("status", str(new), "--json")
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert (status["groups"], status["eligible"], status["filtered"], status["completions"]) == (18, 12, 6, 72)
    assert status["filtered_by_reason"] == {"all_correct": 3, "all_wrong": 3, "all_equal": 0}
    r = run_cli("sql", str(new), "--format", "csv",
                "SELECT filter_reason, count(*) n FROM groups GROUP BY 1 ORDER BY 1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["filter_reason,n", "all_correct,3", "all_wrong,3", ",12"]


def test_rescore_with_the_same_reward_changes_nothing(source, tmp_path):
    toml = tmp_path / "reward.toml"
    toml.write_text('[reward]\nfunctions = [{name = "accuracy"}, {name = "format", weight = 0.0}]\n')
    r = run_cli("rescore", str(source), "--reward-config", str(toml), "--out", str(tmp_path / "same"))
    assert r.returncode == 0, r.stderr
    assert "filtered -> trainable: 0, trainable -> filtered: 0, filtered for another reason: 0" in r.stdout
    assert "Pearson correlation 1.0000" in r.stdout and "0 completions changed" in r.stdout
    old, fresh = _aligned(source, tmp_path / "same")
    for name in [*UNCHANGED, "reward", "advantage", "group_reward_mean", "group_reward_std", "filtered",
                 "filter_reason", "correct"]:
        assert fresh.column(name).equals(old.column(name)), name
    assert fresh.column("reward_components").to_pylist()[0] == [("accuracy", 1.0), ("format", 0.0)]


def test_rescore_bad_input_is_exit_2_and_writes_nothing(source, tmp_path):
    out = tmp_path / "new"
    toml = tmp_path / "bad.toml"
    toml.write_text("[trainer]\nlr = 1e-5\n")
    inv = ["--set", f"reward.functions=[{{name = '{INVERTED}'}}]", "--set", f"reward.correct={INVERTED}"]
    cases = [
        (["rescore", str(tmp_path / "nope"), "--out", str(out), *inv], "nope"),
        (["rescore", str(source), "--out", str(out)], "no new reward given"),
        (["rescore", str(source), "--out", str(out), "--set", "trainer.lr=1e-5"], "trainer.lr"),
        (["rescore", str(source), "--out", str(out), "--reward-config", str(toml)], "[trainer]"),
        (["rescore", str(source), "--out", str(out), "--reward-config", str(tmp_path / "none.toml")], "none.toml"),
        (["rescore", str(source), "--out", str(out), "--set", "reward.functions=[{name = 'acuracy'}]"], "'acuracy'"),
        (["rescore", str(source), "--out", str(out), "--set", "reward.functions=[{name = 'no.such:fn'}]"],
         "no.such"),
        (["rescore", str(source), "--out", str(out), *inv, "--set", "reward.correct=format"], "format"),
        (["rescore", str(source), "--out", str(source), *inv], "source run"),
    ]
    for args, named in cases:
        r = run_cli(*args)
        assert r.returncode == 2 and named in r.stderr, (args, r.stderr)
        assert not out.exists() and not list(tmp_path.glob(".new.*")), args
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--force"]):    # --force replaces only an earlier rescore's output
        r = run_cli("rescore", str(source), "--out", str(out), *inv, *extra)
        assert r.returncode == 2 and "--out" in r.stderr and str(out) in r.stderr, r.stderr
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert run_cli("rescore", str(source), "--out", str(out), *inv).returncode == 0
    r = run_cli("rescore", str(source), "--out", str(out), *inv, "--force", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["groups"] == 18 and not list(tmp_path.glob(".new.*"))


def test_replay_trains_on_the_rescored_run(inverted, tmp_path):
    new, _ = inverted
    sets = [a for o in [*SETTINGS, "trainer.max_steps=2", "run.time_limit_s=none", "run.eval_size=20"]
            for a in ("--set", o)]
    r = run_cli("ablate", "--staleness", "1", "--is-mode", "none", "--seeds", "1", "--eval-every", "1",
                "--replay", str(new), "--out", str(tmp_path / "replay"), *sets, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    cell = tmp_path / "replay" / "cells" / "s1-none-seed1"
    consumed = q(cell, "SELECT c.group_id, c.staleness, g.filtered FROM consumed c JOIN groups g USING (group_id)")
    ours = {x["group_id"] for x in q(new, "SELECT group_id FROM groups")}
    assert len(consumed) == 2 * 4 and all(x["group_id"] in ours and not x["filtered"] for x in consumed)
    assert q(cell, "SELECT count(*) n FROM metrics") == [{"n": 2}]
    # Each step's mean reward is that of the new rewards of the groups it pulled.
    steps = q(cell, 'SELECT m.step, m."reward/mean" logged, (SELECT avg(r.reward) FROM rollouts r JOIN consumed c '
                    'USING (group_id) WHERE c.trainer_step = m.step) stored FROM metrics m ORDER BY 1')
    assert [x["step"] for x in steps] == [1, 2]
    assert all(x["logged"] == pytest.approx(x["stored"], rel=1e-6) for x in steps), steps
