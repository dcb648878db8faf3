"""Trackers: TensorBoard event files and an offline W&B run fed from a run's files, exactly, once per row."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from helpers.observed_run import metrics_row, make_run, read_wandb_history
from pipeline.errors import RunError
from pipeline.trackers import Follower, open_trackers

SCALARS = [k for k in metrics_row(1) if k not in ("step", "time")]


def tb_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "trackers" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]} | {
        "_tensors": acc.Tags()["tensors"]}


def wandb_runs(run: Path) -> list[Path]:
    return sorted((run / "trackers" / "wandb" / "wandb").glob("offline-run-*"))


def f32(x: float) -> float:
    return float(pa.scalar(x, pa.float32()).as_py())


def test_track_logs_every_metrics_row_once_to_tensorboard_and_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)   # offline by default
    run = make_run(tmp_path / "r", steps=12)
    r = run_cli("track", str(run), "--report-to", "tensorboard,wandb", "--once")
    assert r.returncode == 0, r.stderr
    assert "logged 12 trainer steps (up to step 12)" in r.stdout

    tb = tb_scalars(run)
    for k in SCALARS:   # TensorBoard keeps float32
        assert tb[k] == [(s, f32(metrics_row(s)[k])) for s in range(1, 13)], k
    # 10 generator batches: tokens 100..109 in 10 s, 2.5 s waiting, 60 groups, 9 filtered (b % 3).
    assert tb["generator/idle_share"] == [(12, 0.25)]
    assert tb["generator/tokens_per_s"] == [(12, 104.5)]
    assert tb["generator/groups"] == [(12, 60.0)] and tb["generator/filtered_frac"] == [(12, f32(9 / 60))]
    assert "samples/completions" in tb["_tensors"]

    (w,) = wandb_runs(run)
    hist = read_wandb_history(next(w.glob("run-*.wandb")))
    assert [h["_step"] for h in hist] == list(range(1, 13))
    for h in hist:   # W&B keeps float64: the rows exactly
        assert {k: h[k] for k in SCALARS} == {k: metrics_row(h["_step"])[k] for k in SCALARS}
    assert hist[-1]["generator/idle_share"] == 0.25 and hist[-1]["generator/tokens_per_s"] == 104.5
    (table,) = (w / "files" / "media" / "table" / "samples").glob("completions_12_*.table.json")
    t = json.loads(table.read_text())
    assert t["columns"] == ["version", "prompt", "completion", "reward", "correct", "finish_reason"]
    assert len(t["data"]) == 8 and {row[0] for row in t["data"]} == {11}   # the newest version

    # Again: nothing new, nothing logged twice. Then two more steps: only those.
    r = run_cli("track", str(run), "--report-to", "tensorboard,wandb", "--once")
    assert r.returncode == 0 and "logged 0 trainer steps (up to step 12)" in r.stdout, r.stderr
    pq.write_table(pa.Table.from_pylist([metrics_row(13), metrics_row(14)]),
                   run / "metrics" / "steps-000000013-000000014.parquet")
    r = run_cli("track", str(run), "--report-to", "tensorboard,wandb", "--once")
    assert r.returncode == 0 and "logged 2 trainer steps (up to step 14)" in r.stdout, r.stderr
    assert [s for s, _ in tb_scalars(run)["reward/mean"]] == list(range(1, 15))
    steps = [h["_step"] for w in wandb_runs(run) for h in read_wandb_history(next(w.glob("run-*.wandb")))
             if "reward/mean" in h]
    assert sorted(steps) == list(range(1, 15))


class Recorder:
    name = "recorder"

    def __init__(self):
        self.steps, self.closed = [], False

    def log_scalars(self, step, scalars, wall_time):
        self.steps.append(step)

    def log_samples(self, step, rows, wall_time):
        pass

    def flush(self):
        pass

    def close(self):
        self.closed = True


class Broken(Recorder):
    name = "broken"

    def log_scalars(self, step, scalars, wall_time):
        if step == 3:
            raise ConnectionError("tracker server went away")
        super().log_scalars(step, scalars, wall_time)


def test_a_tracker_that_fails_mid_run_is_logged_and_turned_off_the_others_go_on(tmp_path, caplog):
    run = make_run(tmp_path / "r", steps=6)
    ok, broken = Recorder(), Broken()
    follower = Follower(run, [broken, ok], {"step": 0, "generators": {}, "samples_version": -1})
    with caplog.at_level(logging.ERROR, logger="asyncgrpo.track"):
        assert follower.poll() == 6
    assert ok.steps == [1, 2, 3, 4, 5, 6, 6]   # six steps, then the generators' sum at step 6
    assert broken.steps == [1, 2] and broken.closed and follower.trackers == [ok]
    assert "tracker broken failed (ConnectionError: tracker server went away); it is turned off" in caplog.text
    assert json.loads((run / "trackers" / "state.json").read_text())["step"] == 6


def test_bad_tracker_name_is_a_config_error_and_nothing_starts(tmp_path):
    run = tmp_path / "r"
    r = run_cli("run", "--run", str(run), "--set", 'run.report_to=["tensorboard", "tensorbord"]')
    assert r.returncode == 2
    assert "run.report_to" in r.stderr and "'tensorbord'" in r.stderr and "'wandb'" in r.stderr
    assert not run.exists()
    r = run_cli("track", str(tmp_path), "--report-to", "tensorboard,mlflow")
    assert r.returncode == 2 and "--report-to 'tensorboard,mlflow'" in r.stderr


def test_a_tracker_that_cannot_start_stops_the_run_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "no-such-mode")
    run = tmp_path / "r"
    r = run_cli("run", "--run", str(run), "--set", 'run.report_to=["tensorboard", "wandb"]')
    assert r.returncode == 2, r.stderr
    assert "tracker 'wandb' failed to start" in r.stderr and "no-such-mode" in r.stderr
    assert not run.exists()   # no config, no logs, no daemon: the tensorboard folder made first is gone too


def test_a_tracker_not_installed_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RunError, match=r"tracker 'wandb' is not installed; .*pip install -e '\.\[track\]'"):
        open_trackers(["tensorboard", "wandb"], tmp_path)
    assert not (tmp_path / "trackers").exists()


def test_run_config_checks_tracker_settings():
    from pipeline.config import ConfigError, load_config

    cfg = load_config(None, ['run.report_to=["wandb", "tensorboard"]', "run.plot_every_s=none"])
    assert cfg.run.report_to == ("wandb", "tensorboard") and cfg.run.plot_every_s is None
    with pytest.raises(ConfigError, match=r"run.report_to must be a list without repeats"):
        load_config(None, ['run.report_to=["wandb", "wandb"]'])
    with pytest.raises(ConfigError, match=r"run.track_every_s must be a number of seconds > 0, got 0"):
        load_config(None, ["run.track_every_s=0"])

