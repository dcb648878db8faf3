"""A small run of bench/chaos.py: kill -9 the trainer and generators at random moments; nothing is lost.

The full harness (100 kills) is `nice python bench/chaos.py`; this is the same code with
6 kill events and 20 trainer steps (about 80 s on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import CACHE, REPO
from test_run import processes_of


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_nothing(tmp_path):
    run = tmp_path / "chaos"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--run", str(run), "--kills", "6",
                        "--max-steps", "20", "--interval", "2", "5", "--seed", "1",
                        "--set", f"model.cache_dir={CACHE}"],
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=600)
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, (figures, r.stderr[-3000:])
    assert figures["kills"] == 6 and figures["processes_killed"] >= 6
    steps = figures["max_steps"]    # 20, or later if the last kill rolled the trainer back past step 17
    assert steps >= 20 and figures["trainer_exit"] == 0 and figures["latest_version"] == steps
    assert figures["latest_complete"] and figures["steps_recorded"] == steps and figures["steps_wrong"] == 0
    assert figures["groups_consumed"] == steps * 8 and figures["groups_trained_twice"] == 0
    assert figures["groups_seen_before_kills"] > 0 and figures["flushed_groups_lost"] == 0
    assert figures["quarantined"] == 0 and figures["over_staleness_limit"] == 0
    assert figures["staleness_max"] <= 2 and figures["consumed_missing_or_filtered"] == 0
    assert figures["metrics_rows_wrong"] == 0 and figures["query_errors"] == 0
    assert figures["own_exits"] == {}, r.stderr[-3000:]     # no daemon died of anything but the kills
    assert not processes_of(run)
