"""The asyncgrpo command, as a user runs it: subprocesses, exit codes, messages."""

import csv
import io
import json

import pytest

from conftest import run_cli

COMMANDS = ["sql", "status", "compact", "demo", "run", "generate", "train", "eval", "init-model", "warmstart",
            "config", "ablate", "export", "rescore", "plot", "track"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("cli") / "demo"
    r = run_cli("demo", str(run), "--groups", "300", "--groups-per-step", "16")
    assert r.returncode == 0, r.stderr
    assert "SYNTHETIC" in r.stdout and "asyncgrpo sql" in r.stdout
    return run


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_help_with_an_example(cmd):
    r = run_cli(cmd, "--help")
    assert r.returncode == 0 and "Example" in r.stdout and f"asyncgrpo {cmd}" in r.stdout


def test_top_level_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in COMMANDS)


def test_status_json_agrees_with_sql(demo_run):
    r = run_cli("status", str(demo_run), "--json", "--max-staleness", "2")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["groups"] == 300 and s["completions"] == 2400
    assert sum(s[k] for k in ("eligible", "consumed", "filtered", "expired", "future", "unavailable")) == 300
    q = run_cli("sql", str(demo_run), "--format", "json",
                "SELECT count(*) FILTER (WHERE filtered) AS f, count(*) FILTER (WHERE times_consumed > 0) AS c "
                "FROM groups")
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout) == [{"f": s["filtered"], "c": s["consumed"]}]
    human = run_cli("status", str(demo_run))
    assert human.returncode == 0 and "groups per version" in human.stdout


def test_sql_formats_and_stdin(demo_run):
    r = run_cli("sql", str(demo_run), "--format", "csv", "SELECT version, count(*) AS n FROM groups GROUP BY 1 ORDER BY 1")
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert r.returncode == 0 and rows[0]["version"] == "0" and sum(int(x["n"]) for x in rows) == 300
    r = run_cli("sql", str(demo_run), input="SELECT count(*) AS n FROM rollouts;")
    assert r.returncode == 0 and "2400" in r.stdout and "(1 row)" in r.stdout
    r = run_cli("sql", str(demo_run / "buffer"), "--format", "json", "SELECT completion_ids FROM rollouts LIMIT 1")
    assert isinstance(json.loads(r.stdout)[0]["completion_ids"], list)


def test_sql_versions_view_matches_the_rows(demo_run):
    """`asyncgrpo sql` over the versions view (footer sums) gives the rows' groups, completions and mean reward."""
    fast = run_cli("sql", str(demo_run), "--format", "json",
                   "SELECT version, groups, filtered_groups, completions, reward_mean FROM versions ORDER BY 1")
    rows = run_cli("sql", str(demo_run), "--format", "json",
                   "SELECT version, count(*) AS groups, count(*) FILTER (WHERE filtered) AS filtered_groups, "
                   "sum(num_completions)::BIGINT AS completions, sum(reward_mean * num_completions) / "
                   "sum(num_completions) AS reward_mean FROM groups GROUP BY 1 ORDER BY 1")
    assert fast.returncode == 0 and rows.returncode == 0, fast.stderr + rows.stderr
    fast, rows = json.loads(fast.stdout), json.loads(rows.stdout)
    assert sum(r["groups"] for r in fast) == 300 and len(fast) > 1
    assert [{k: v for k, v in r.items() if k != "reward_mean"} for r in fast] == \
        [{k: v for k, v in r.items() if k != "reward_mean"} for r in rows]
    assert [r["reward_mean"] for r in fast] == pytest.approx([r["reward_mean"] for r in rows], abs=1e-12)


@pytest.mark.parametrize("args, message", [
    (["sql", "/nonexistent/run", "SELECT 1"], "path not found: /nonexistent/run"),
    (["status", "/tmp"], "not a buffer or run directory: /tmp"),
    (["compact", "/nonexistent/run"], "path not found"),
    (["sql", "{run}", "SELEC 1"], "syntax error"),
    (["sql", "{run}", "DELETE FROM rollouts"], "only SELECT queries are allowed"),
    (["sql", "{run}", "SELECT * FROM nosuchview"], "nosuchview"),
    (["sql", "{run}", "--format", "xml", "SELECT 1"], "'xml' is not one of"),
    (["status", "{run}", "--max-staleness", "-1"], "-1 is not in the range x>=0"),
    (["demo", "{run}"], "already exists; pass --force"),
])
def test_user_errors_exit_2_without_traceback(demo_run, args, message):
    r = run_cli(*[a.format(run=demo_run) for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_compact_command(tmp_path):
    run = tmp_path / "d"
    assert run_cli("demo", str(run), "--groups", "200").returncode == 0
    r = run_cli("compact", str(run), "--min-age", "0", "--grace", "0")
    assert r.returncode == 0 and "merged" in r.stdout
