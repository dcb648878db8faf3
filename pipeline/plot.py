"""`asyncgrpo plot`: a run's charts as one PNG (matplotlib) and one HTML page (plotly), read from its files.

Every chart is drawn twice, against the trainer step (a generator's rows against
the version it sampled with) and against wall time (minutes since the run's
first record), except the staleness histogram. The data comes from the run's
SQL views (buffer.sql, quarantine off: plotting never moves a file) and
`run.json` (greedy accuracy before and after):

    reward            reward/mean, batch/accuracy                      (metrics)
    eval              greedy accuracy on held-out prompts: before (step 0), after (last step),
                      and any eval/* metrics column
    kl                kl/ref (beta > 0 only), kl/new_behaviour, kl/old_behaviour
    clip              clip/frac, clip/low_frac, clip/high_frac, is/truncated_frac, is/masked_frac
    importance        is/mean, clip/ratio_mean
    filtered          share of the groups sampled at a version filtered, per reason  (rollouts)
    idle              trainer: time/wait_s / time/step_s; each generator: wait_s / seconds
    throughput        trainer perf/tokens_per_s; each generator: tokens / seconds
    staleness         histogram of the staleness of consumed groups (consumed); mean and max over time

A noisy series (more than 200 points) is drawn faint, with its centred moving
average (window: a hundredth of the points) over it. A panel with no data says
so on the panel. Beside the PNG, `<stem>.json` gives the points drawn per panel
(what the tests check) and `<stem>.html` the same charts, plotly.js inline so
the page works offline.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import buffer
from buffer.layout import atomic_write_bytes
from buffer.store import RemotePath, as_path
from workers.remote_weights import work_dir

SMOOTH_ABOVE = 200   # points; noisier series get a moving average over the raw line


@dataclass
class Series:
    """One line (or, for a histogram, bars): y against step and wall time (unix s), each of shape (P,)."""

    name: str
    step: np.ndarray
    time: np.ndarray
    y: np.ndarray
    markers: bool = False


@dataclass
class Panel:
    key: str
    title: str
    ylabel: str
    empty: str                      # what the panel says when it has no data
    series: list[Series] = field(default_factory=list)
    histogram: Series | None = None  # x in `step` (the staleness), counts in `y`; drawn in the step column
    percent: bool = False

    def points(self) -> int:
        parts = self.series + ([self.histogram] if self.histogram is not None else [])
        return int(sum(np.isfinite(s.y).sum() for s in parts))


def _col(table, name: str) -> np.ndarray | None:
    """A numeric metrics column as float64 (nulls as NaN), or None when absent or all null."""
    if name not in table.column_names:
        return None
    import pyarrow as pa

    a = np.asarray(table.column(name).cast(pa.float64()).to_numpy(), dtype=np.float64)   # nulls: NaN
    return a if np.isfinite(a).any() else None


def _query(db, sql: str):
    """Rows of a view, or None when the run has no such view yet (no metrics written, ...)."""
    try:
        return db.query(sql)
    except buffer.SqlError as e:
        if "does not exist" in str(e):
            return None
        raise


def plot_data(run_dir: str | os.PathLike) -> list[Panel]:
    """The panels of a run directory (raises BufferError when it has no buffer)."""
    run = as_path(run_dir)
    db = buffer.BufferSQL(run, quarantine=False)
    m = _query(db, "SELECT * FROM metrics ORDER BY step")
    g = _query(db, "SELECT generator_id, version, started_at, wait_s, seconds, tokens FROM generator_metrics "
                   "ORDER BY generator_id, started_at")
    f = db.query("SELECT version, coalesce(filter_reason, '') AS reason, count(*) AS groups, "
                 "epoch(min(created_at)) AS t FROM rollouts WHERE sample_index = 0 GROUP BY 1, 2 ORDER BY 1")
    hist = db.query("SELECT staleness, count(*) AS n FROM consumed GROUP BY 1 ORDER BY 1")
    info = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}

    panels = {p.key: p for p in [
        Panel("reward", "Reward and batch accuracy", "per completion", "no trainer steps yet"),
        Panel("eval", "Greedy accuracy, held-out prompts", "accuracy",
              "not evaluated yet (asyncgrpo run evaluates before and after)", percent=True),
        Panel("kl", "KL to reference and to behaviour", "nats per token", "no KL metrics yet"),
        Panel("clip", "Clipped and IS-truncated/masked tokens", "share of tokens", "no trainer steps yet",
              percent=True),
        Panel("importance", "Importance weight and ratio (means)", "mean", "no trainer steps yet"),
        Panel("filtered", "Filtered groups by reason (per version sampled)", "share of groups",
              "no groups in the buffer yet", percent=True),
        Panel("idle", "Idle share (trainer: waiting for data; generators: for the trainer)", "share",
              "no trainer or generator timings yet", percent=True),
        Panel("throughput", "Throughput", "tokens / s", "no trainer or generator timings yet"),
        Panel("staleness", "Staleness of consumed groups", "groups", "no group consumed yet"),
    ]}
    times = []
    if m is not None and m.num_rows:
        step, t = _col(m, "step"), _col(m, "time")
        times.append(np.nanmin(t))

        def add(key: str, names, label=lambda n: n):
            for n in names:
                y = _col(m, n)
                if y is not None:
                    panels[key].series.append(Series(label(n), step, t, y))

        add("reward", ["reward/mean", "batch/accuracy"])
        add("eval", sorted(c for c in m.column_names if c.startswith("eval/")))
        add("kl", ["kl/ref", "kl/new_behaviour", "kl/old_behaviour"])
        add("clip", ["clip/frac", "clip/low_frac", "clip/high_frac", "is/truncated_frac", "is/masked_frac"])
        add("importance", ["is/mean", "clip/ratio_mean"])
        wait, step_s = _col(m, "time/wait_s"), _col(m, "time/step_s")
        if wait is not None and step_s is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                panels["idle"].series.append(Series("trainer", step, t, np.where(step_s > 0, wait / step_s, np.nan)))
        add("throughput", ["perf/tokens_per_s"], lambda n: "trainer")
        add("staleness", ["staleness/mean", "staleness/max"])
    if g is not None and g.num_rows:
        gid = np.array(g.column("generator_id").to_pylist())
        times.append(float(np.nanmin(_col(g, "started_at"))))
        for name in sorted(set(gid)):
            sel = gid == name
            v, t0 = _col(g, "version")[sel], _col(g, "started_at")[sel]
            secs, wait, tokens = _col(g, "seconds")[sel], _col(g, "wait_s")[sel], _col(g, "tokens")[sel]
            ok = secs > 0
            panels["idle"].series.append(Series(name, v[ok], t0[ok], (wait / np.where(ok, secs, 1))[ok]))
            busy = tokens > 0   # batch 0 (start-up) samples nothing
            panels["throughput"].series.append(Series(name, v[busy], t0[busy], tokens[busy] / secs[busy]))
    if f.num_rows:
        version, reason = _col(f, "version"), np.array(f.column("reason").to_pylist())
        groups, t = _col(f, "groups"), _col(f, "t")
        times.append(float(np.nanmin(t)))
        versions, first = np.unique(version, return_index=True)
        total = np.bincount(np.searchsorted(versions, version), weights=groups, minlength=len(versions))
        vt = np.array([t[version == v].min() for v in versions]) if len(versions) < 5000 else t[first]
        for r in sorted(set(reason) - {""}):
            per = np.zeros(len(versions))
            sel = reason == r
            per[np.searchsorted(versions, version[sel])] = groups[sel]
            panels["filtered"].series.append(Series(r, versions, vt, per / total))
    if hist.num_rows:
        x, n = _col(hist, "staleness"), _col(hist, "n")
        panels["staleness"].histogram = Series("groups", x, np.full_like(x, np.nan), n)
    if "eval_before" in info:
        t0 = min(times) if times else np.nan
        last = panels["reward"].series[0] if panels["reward"].series else None
        steps, ts, ys = [0.0], [t0], [info["eval_before"]]
        after = (info.get("summary") or {}).get("eval_after")
        if after is not None and last is not None:
            steps.append(float(last.step[-1]))
            ts.append(float(last.time[-1]))
            ys.append(after)
        panels["eval"].series.insert(0, Series("greedy: before and after the run", np.array(steps), np.array(ts),
                                               np.array(ys, dtype=float), markers=True))
    return list(panels.values())


def _smooth(y: np.ndarray) -> np.ndarray:
    """Centred moving average over a hundredth of the points (NaNs skipped)."""
    w = max(len(y) // 100, 3)
    ok = np.isfinite(y)
    k = np.ones(w)
    num = np.convolve(np.where(ok, y, 0.0), k, mode="same")
    den = np.convolve(ok.astype(float), k, mode="same")
    with np.errstate(invalid="ignore"):
        return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def _t0(panels: list[Panel]) -> float:
    ts = [np.nanmin(s.time) for p in panels for s in p.series if np.isfinite(s.time).any()]
    return float(min(ts)) if ts else 0.0


def _finite_series(p: Panel, xkey: str, t0: float):
    """(index, series, x, y) of each of the panel's series with finite points, against trainer step or
    wall time in minutes since t0 (what both renderers draw)."""
    for i, s in enumerate(p.series):
        x = s.step if xkey == "step" else (s.time - t0) / 60.0
        ok = np.isfinite(x) & np.isfinite(s.y)
        if ok.any():
            yield i, s, x[ok], s.y[ok]


def render_png(panels: list[Panel], title: str) -> bytes:
    """The panels as rows of two axes (against step, against wall time); PNG bytes."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    t0 = _t0(panels)
    fig = Figure(figsize=(15, 3.1 * len(panels)), dpi=80, layout="constrained")
    fig.suptitle(title, fontsize=14)
    axes = fig.subplots(len(panels), 2, squeeze=False)
    for p, (ax_s, ax_t) in zip(panels, axes):
        ax_s.set_title(f"{p.title}: by step", fontsize=11)
        ax_t.set_title(f"{p.title}: by wall time", fontsize=11)
        ax_s.set_xlabel("histogram: staleness (versions)" if p.histogram is not None else "trainer step")
        ax_t.set_xlabel("wall time (minutes)")
        if p.histogram is not None:
            ax_s.set_title(f"{p.title}: histogram", fontsize=11)
            ax_s.bar(p.histogram.step, p.histogram.y, color="tab:blue", width=0.8)
            ax_s.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax_s.set_ylabel(p.ylabel)
        for ax, xkey in ((ax_s, "step"), (ax_t, "time")):
            if p.histogram is not None and ax is ax_s:
                continue
            drawn = False
            for i, s, x, y in _finite_series(p, xkey, t0):
                drawn = True
                color = f"C{i}"
                if s.markers:
                    ax.plot(x, y, "o", color=color, markersize=7, label=s.name)
                elif len(y) > SMOOTH_ABOVE:
                    ax.plot(x, y, color=color, alpha=0.2, linewidth=0.6)
                    ax.plot(x, _smooth(y), color=color, linewidth=1.5, label=s.name)
                else:
                    ax.plot(x, y, color=color, linewidth=1.2, label=s.name)
            if drawn:
                ax.legend(fontsize=8, loc="best")
                ax.set_ylabel("staleness (versions)" if p.histogram is not None else p.ylabel)
                if p.percent:
                    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
            else:
                ax.text(0.5, 0.5, p.empty, ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.grid(alpha=0.3)
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def render_html(panels: list[Panel], title: str) -> str:
    """The same charts as one self-contained HTML page (plotly.js inline: works offline)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    t0 = _t0(panels)
    titles = []
    for p in panels:
        titles += [f"{p.title}: {'histogram' if p.histogram is not None else 'by step'}", f"{p.title}: by wall time"]
    fig = make_subplots(rows=len(panels), cols=2, subplot_titles=titles, vertical_spacing=0.25 / len(panels))
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    legends = {}   # one legend per row, beside it: a single page-wide legend listed every series far from its chart
    for r, p in enumerate(panels, start=1):
        legend = "legend" if r == 1 else f"legend{r}"
        legends[legend] = {"x": 1.01, "y": fig.get_subplot(r, 2).yaxis.domain[1], "xanchor": "left",
                           "yanchor": "top", "font": {"size": 10}}
        if p.histogram is not None:
            fig.add_trace(go.Bar(x=p.histogram.step, y=p.histogram.y, name=f"{p.key}: groups", showlegend=False,
                                 marker_color=palette[0]), row=r, col=1)
            fig.update_xaxes(title_text="staleness (versions)", row=r, col=1)
        for c, xkey in ((1, "step"), (2, "time")):
            if p.histogram is not None and c == 1:
                continue
            drawn = False
            for i, s, x, y in _finite_series(p, xkey, t0):
                drawn = True
                y = _smooth(y) if len(y) > SMOOTH_ABOVE and not s.markers else y
                fig.add_trace(go.Scatter(x=x, y=y, name=s.name, legendgroup=f"{p.key}{i}", legend=legend,
                                         showlegend=c == 2, mode="markers" if s.markers else "lines",
                                         line={"color": palette[i % len(palette)], "width": 1.5}), row=r, col=c)
            if not drawn:
                fig.add_annotation(text=p.empty, showarrow=False, xref="x domain", yref="y domain", x=0.5, y=0.5,
                                   font={"color": "gray"}, row=r, col=c)
            fig.update_xaxes(title_text="trainer step" if xkey == "step" else "wall time (minutes)", row=r,
                             col=c) if not (p.histogram is not None and c == 1) else None
            ylabel = "staleness (versions)" if p.histogram is not None and c == 2 else p.ylabel
            fig.update_yaxes(title_text=ylabel, tickformat=".2~%" if p.percent else None, row=r, col=c)
    fig.update_layout(title=title, height=330 * len(panels), width=1400, template="plotly_white",
                      margin={"r": 200}, **legends)
    return fig.to_html(include_plotlyjs=True, full_html=True)


def write_plots(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> dict:
    """Write `out` (default <run>/plot.png) and, beside it, the same stem's .html and .json (points per panel);
    each written to a temp name and renamed. Returns what the .json holds."""
    run = as_path(run_dir)
    png = Path(out) if out is not None else work_dir(run) / "plot.png"   # a run on a store: this machine's
    panels = plot_data(run)
    title = f"asyncgrpo run {(run if isinstance(run, RemotePath) else run.resolve()).name}"
    png.parent.mkdir(parents=True, exist_ok=True)
    summary = {"png": str(png), "html": str(png.with_suffix(".html")),
               "panels": {p.key: {"title": p.title, "points": p.points()} for p in panels}}
    atomic_write_bytes(png.parent, png, render_png(panels, title))
    atomic_write_bytes(png.parent, png.with_suffix(".html"), render_html(panels, title).encode())
    atomic_write_bytes(png.parent, png.with_suffix(".json"), (json.dumps(summary, indent=1) + "\n").encode())
    return summary
