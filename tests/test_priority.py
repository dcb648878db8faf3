"""Housekeeping leaves the CPU to the daemons it serves: the compactor daemon (compactor.nice) and
the supervisor's periodic plot child (trackers.PLOT_NICE) run at a lower priority, and the
supervisor takes a progress snapshot (an index refresh) only when it shows one."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from buffer import ShardWriter
from conftest import REPO, make_group, run_cli
from pipeline import trackers
from pipeline.config import load_config, save_config

unix = pytest.mark.skipif(not hasattr(os, "nice"), reason="niceness is a Unix notion")


def niceness(pid: int) -> int:
    """Field 19 of /proc/PID/stat (after the parenthesised command name)."""
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])


def make_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, []), run / "config.toml")
    with ShardWriter(run / "buffer") as w:
        w.append(make_group(0, [1.0, 0.0]))
    return run


@unix
@pytest.mark.parametrize("setting, raised", [(None, 10), ("7", 7), ("0", 0)])
def test_the_compactor_daemon_lowers_its_priority_by_compactor_nice(tmp_path, setting, raised):
    run = make_run(tmp_path)
    extra = [] if setting is None else ["--set", f"compactor.nice={setting}"]
    log = tmp_path / "compactor.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "pipeline", "compactor", "--run", str(run), *extra],
                             cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=out, stderr=out)
    try:
        # It renices itself before its first pass, whose start it logs ("compacting ...").
        deadline = time.time() + 120
        while "compacting" not in log.read_text() and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert p.poll() is None and "compacting" in log.read_text(), log.read_text()
        assert niceness(p.pid) == min(os.nice(0) + raised, 19)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    assert p.returncode == 0, log.read_text()


@pytest.mark.parametrize("value, need", [("20", "an integer from 0 to 19, got 20"),
                                         ("-1", "an integer from 0 to 19, got -1"),
                                         ("2.5", "expected an integer, got 2.5")])
def test_a_bad_compactor_nice_names_the_key(value, need):
    r = run_cli("config", "--set", f"compactor.nice={value}")
    assert r.returncode == 2 and "compactor.nice" in r.stderr and need in r.stderr


@unix
def test_the_periodic_plot_runs_at_a_lower_priority(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    # The child reports its niceness as its exit status; write_run_plot names it in its error.
    monkeypatch.setattr(trackers, "cli_argv",
                        lambda *args: [sys.executable, "-c", "import os, sys; sys.exit(os.nice(0))"])
    want = min(os.nice(0) + trackers.PLOT_NICE, 19)
    with pytest.raises(RuntimeError, match=f"asyncgrpo plot exited with {want}:"):
        trackers.write_run_plot(run)
    assert os.nice(0) < want     # this process's own priority is unchanged


def test_the_supervisor_takes_a_snapshot_only_when_it_prints_one(monkeypatch):
    from pipeline.run import _watch

    monkeypatch.setattr(sys, "stdout", io.StringIO())   # not a terminal (even under pytest -s): a line every 10 s

    class Sup:
        run = "runs/x"

        def check(self) -> bool:
            return True

    class Progress:
        taken = 0

        def snapshot(self) -> dict:
            self.taken += 1
            return {"elapsed_s": 0.0, "step": 0, "version": 0, "reward": None, "accuracy": None,
                    "staleness": None, "groups": 0, "eligible": 0, "filtered": 0, "expired": 0,
                    "consumed": 0, "trainer_idle": None}

    progress, lines, why = Progress(), [], {"why": None}
    started = time.time()
    _watch(Sup(), progress, time.time() + 3.0, why, lines.append)
    assert why["why"] == "time limit" and time.time() - started >= 3.0
    assert progress.taken == 1 and len(lines) == 1 and lines[0].startswith("[    0s] step 0 v0")
