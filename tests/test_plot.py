"""`asyncgrpo plot` as a user runs it, and `asyncgrpo run` feeding its trackers and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa

from buffer import BufferSQL
from conftest import DEFAULT_RUN_STEPS, REPO, run_cli
from helpers.observed_run import make_run, read_wandb_history

PANELS = ["reward", "eval", "kl", "clip", "importance", "filtered", "idle", "throughput", "staleness"]


def png_size(path) -> tuple[int, int]:
    from matplotlib.image import imread

    h, w = imread(path).shape[:2]
    return w, h


def test_plot_writes_a_png_and_an_html_page_with_data_in_every_panel(tmp_path):
    run = make_run(tmp_path / "r", steps=12)
    r = run_cli("plot", str(run), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary == json.loads((run / "plot.json").read_text())
    points = {k: p["points"] for k, p in summary["panels"].items()}
    # 12 steps x the metrics series of each panel; eval: before and after; idle and throughput: 12 trainer
    # steps and 10 generator batches; filtered: 12 versions x 2 reasons; staleness: 2 values and 12 x 2.
    assert points == {"reward": 24, "eval": 2, "kl": 36, "clip": 60, "importance": 24, "filtered": 24,
                      "idle": 22, "throughput": 22, "staleness": 26}
    assert png_size(run / "plot.png") == (1200, 2232)
    assert 100_000 < (run / "plot.png").stat().st_size < 2_000_000
    html = (run / "plot.html").read_text()
    for p in summary["panels"].values():   # in plotly's JSON, "/" is written "\\u002f"
        assert f"{p['title']}: by wall time".replace("/", "\\u002f") in html, p
    assert "Staleness of consumed groups: histogram" in html
    # each row has its own legend beside it (plotly legend, legend2, ...), each series once
    # reward: 2 series x 2 charts; staleness: 2 series on its wall-time chart (the histogram has no legend)
    assert html.count('"legend":"legend"') == 4 and html.count('"legend":"legend9"') == 2
    assert '"legend9":{' in html and '"legend10"' not in html
    assert 'src="http' not in html and len(html) > 3_000_000   # plotly.js inline: the page works offline


def test_plot_says_which_panels_have_no_data_yet(tmp_path):
    run = make_run(tmp_path / "r", steps=3)
    for d in ("metrics", "generator_metrics"):
        for f in (run / d).glob("*.parquet"):
            f.unlink()
    (run / "run.json").unlink()
    out = tmp_path / "out" / "p.png"
    r = run_cli("plot", str(run), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "no data yet in: reward, eval, kl, clip, importance, idle, throughput" in r.stdout
    points = {k: p["points"] for k, p in json.loads(out.with_suffix(".json").read_text())["panels"].items()}
    assert points["filtered"] > 0 and points["staleness"] == 2 and points["reward"] == 0
    html = out.with_suffix(".html").read_text()
    assert "no trainer steps yet" in html and "not evaluated yet" in html


def test_plot_bad_input_is_exit_code_2(tmp_path):
    r = run_cli("plot", str(tmp_path / "nope"))
    assert r.returncode == 2 and "run directory" in r.stderr and "nope" in r.stderr
    r = run_cli("plot", str(tmp_path), "--out", str(tmp_path / "a.jpg"))
    assert r.returncode == 2 and "a.jpg" in r.stderr
    r = run_cli("plot", str(tmp_path))
    assert r.returncode == 2 and "not a buffer or run directory" in r.stderr


def test_run_feeds_tensorboard_and_wandb_and_writes_its_plots(default_run):
    """A real run of the default job (the one tests/test_run.py checks): the trackers get every step the
    trainer wrote, and the run ends with plot.png, every panel drawn."""
    run, p = default_run
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"plots: {run / 'plot.png'}" in p.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "trackers" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    rows = BufferSQL(run, quarantine=False).query("SELECT step, \"reward/mean\" AS r FROM metrics ORDER BY step")
    f32 = pa.compute.cast(rows.column("r"), pa.float32()).to_pylist()
    steps = range(1, DEFAULT_RUN_STEPS + 1)
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == list(zip(steps, f32))
    assert "generator/idle_share" in acc.Tags()["scalars"]
    (w,) = (run / "trackers" / "wandb" / "wandb").glob("offline-run-*")
    hist = [h for h in read_wandb_history(next(w.glob("run-*.wandb"))) if "reward/mean" in h]
    assert [(h["_step"], h["reward/mean"]) for h in hist] == list(zip(steps, rows.column("r").to_pylist()))
    summary = json.loads((run / "plot.json").read_text())
    assert all(summary["panels"][k]["points"] > 0 for k in PANELS), summary
    assert summary["panels"]["eval"]["points"] == 2   # before and after
    assert png_size(run / "plot.png") == (1200, 2232)


def test_the_runs_periodic_plot_is_drawn_by_a_child_process(tmp_path):
    """The supervisor's plots every run.plot_every_s come from `asyncgrpo plot` in a child: matplotlib,
    plotly and the run's points never enter the supervisor, whose memory grew with each plot."""
    run = make_run(tmp_path / "r", steps=12)
    code = ("import sys; from pathlib import Path; from pipeline.trackers import write_run_plot; "
            f"write_run_plot(Path({str(run)!r})); print(sorted(m for m in ('matplotlib', 'plotly') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert png_size(run / "plot.png") == (1200, 2232) and (run / "plot.html").stat().st_size > 3_000_000
    (run / "plot.png").unlink()
    (run / "plot.png").mkdir()          # the child cannot write its PNG: it fails, and says so
    code = ("from pathlib import Path; from pipeline.trackers import write_run_plot; "
            f"write_run_plot(Path({str(run)!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    assert r.returncode != 0 and "asyncgrpo plot exited with" in r.stderr, r.stderr
