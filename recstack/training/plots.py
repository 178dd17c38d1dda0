"""Training curves from a run's ``metrics.jsonl``: train loss, eval AUC and eval NE over step; the final
evaluation's reliability diagram; the distributed step's time breakdown.

Drawing goes through an explicit Agg canvas on a ``matplotlib.figure.Figure`` rather than ``pyplot``, so
it needs no display, leaves the process-wide backend alone and is safe to call from a training loop.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from recstack.io import atomic_path
from recstack.training.logger import read_jsonl


def _save(fig: Figure, out: Path) -> None:
    """A PNG written whole or not at all (a full disk: a DiskError naming it, no truncated image left)."""
    with atomic_path(out, sync_dir=False) as tmp:
        fig.savefig(tmp, dpi=100, format="png")

# (kind, key, panel title, y label) for each panel, top to bottom.
PANELS: tuple[tuple[str, str, str, str], ...] = (
    ("train", "loss", "train loss", "loss"),
    ("eval", "auc", "eval AUC", "AUC"),
    ("eval", "ne", "eval normalized entropy", "NE"),
)


def _series(
    records: list[dict[str, Any]], kind: str, key: str, source: Path
) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key`` in records of ``kind``, sorted by step; null or missing values skipped."""
    points = []
    for i, r in enumerate(records):
        if r.get("kind") != kind:
            continue
        value, step = r.get(key), r.get("step")
        if value is None or step is None:
            continue
        try:
            step, value = float(step), float(value)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{source}: record {i + 1} ({kind!r}): field 'step' or {key!r} is not a number "
                f"(step={step!r}, {key}={value!r})"
            ) from e
        if math.isfinite(value):
            points.append((step, value))
    points.sort(key=lambda p: p[0])  # a resumed run appends steps it may have logged before
    return [p[0] for p in points], [p[1] for p in points]


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points; the same length as ``values``."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_curves(metrics_jsonl: Path | str, out_png: Path | str) -> Path:
    """Draw the run's curves into ``out_png`` (parent directories created) and return its path.

    Three stacked panels sharing the step axis; a panel whose metric has no points yet says so. An empty
    file gives a single "no data" figure.
    """
    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    records = read_jsonl(metrics_jsonl)
    series = [_series(records, kind, key, metrics_jsonl) for kind, key, _, _ in PANELS]

    if not any(steps for steps, _ in series):
        fig = Figure(figsize=(6, 3))
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, f"no data yet in {metrics_jsonl.name}", ha="center", va="center")
        ax.set_axis_off()
    else:
        fig = Figure(figsize=(8, 9), layout="constrained")
        axes = fig.subplots(len(PANELS), 1, sharex=True)
        for ax, (kind, key, title, ylabel), (steps, values) in zip(axes, PANELS, series, strict=True):
            ax.set_title(title)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if not steps:
                ax.text(0.5, 0.5, f"no {kind} '{key}' yet", transform=ax.transAxes, ha="center", va="center")
                continue
            # Single points would be invisible as a line; markers keep sparse eval curves readable.
            marker = "o" if len(steps) <= 50 else None
            alpha = 0.6 if kind == "train" else 1.0
            ax.plot(steps, values, marker=marker, markersize=3, linewidth=1, alpha=alpha)
            if kind == "train" and len(values) >= 20:
                # Per-step train loss is noisy; a trailing mean shows the trend.
                window = max(5, len(values) // 20)
                ax.plot(steps, _moving_average(values, window), linewidth=2, label=f"mean of {window}")
                ax.legend(loc="upper right")
        axes[-1].set_xlabel("step")
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        fig.suptitle(metrics_jsonl.parent.name or str(metrics_jsonl))

    out_png.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)  # attaches itself to fig; savefig then renders with Agg
    _save(fig, Path(out_png))
    return out_png


# Per-step time components of distributed training, as logged by the trainer (seconds per step, averaged
# over each log window). "compute" is what is left of the step after the blocking collectives.
_BREAKDOWN = (
    ("time_data_wait", "data wait"),
    ("time_input_dist", "input distribution"),
    ("time_fwd_a2a", "forward all-to-all"),
    ("time_bwd_a2a", "backward all-to-all"),
    ("time_allreduce_emb", "embedding all-reduce"),
    ("time_allreduce_dense", "dense all-reduce (overlaps backward)"),
)


def plot_comm_breakdown(metrics_jsonl: Path | str, out_png: Path | str, pipelined: bool = False) -> Path:
    """Stacked bars of the mean time per step in each phase over the run (one bar per log window).

    With ``pipelined`` the input distribution runs a batch ahead, before the step (in its wait for the batch),
    so it is drawn but not subtracted from the step to get the compute time.
    """
    source, out = Path(metrics_jsonl), Path(out_png)
    rows = [r for r in read_jsonl(source) if r.get("kind") == "train" and r.get("time_step") is not None]
    fig = Figure(figsize=(9, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if not rows:
        ax.text(0.5, 0.5, "no timed training steps", ha="center", va="center")
        ax.set_axis_off()
    else:
        steps = [float(r["step"]) for r in rows]
        width = (steps[1] - steps[0]) * 0.8 if len(steps) > 1 else 1.0
        bottom = [0.0] * len(rows)
        blocking = ("time_fwd_a2a", "time_bwd_a2a", "time_allreduce_emb") + (() if pipelined else ("time_input_dist",))
        compute = [max(float(r["time_step"]) - sum(float(r.get(k) or 0.0) for k in blocking), 0.0) for r in rows]
        for key, label in (("compute", "compute"), *_BREAKDOWN):
            values = compute if key == "compute" else [float(r.get(key) or 0.0) * 1e3 for r in rows]
            if key == "compute":
                values = [v * 1e3 for v in values]
            if not any(values):
                continue
            ax.bar(steps, values, width, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xlabel("step")
        ax.set_ylabel("ms per step")
        ax.set_title("time per training step by phase")
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, Path(out))
    return out


def plot_reliability(bins: dict[str, list[Any]], out_png: Path | str) -> Path:
    """The reliability diagram of ``BinaryMetrics.reliability()``'s ``bins``: per probability bin the
    observed click rate against the mean prediction (on the diagonal when calibrated), each point labelled
    with its count, over a histogram of the counts (log scale)."""
    out = Path(out_png)
    fig = Figure(figsize=(6, 7), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    top.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=1, label="calibrated")
    points = [(q, r, c) for q, r, c in zip(bins["mean_prediction"], bins["rate"], bins["count"], strict=True)
              if c and q is not None and r is not None and math.isfinite(q) and math.isfinite(r)]
    if points:
        top.plot([p[0] for p in points], [p[1] for p in points], marker="o", linewidth=1, label="model")
        for q, r, c in points:
            top.annotate(f"{c}", (q, r), textcoords="offset points", xytext=(4, -10), fontsize=7)
    else:
        top.text(0.5, 0.5, "no evaluation examples", ha="center", va="center")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("observed rate")
    top.set_title(f"reliability ({len(bins['count'])} equal-width bins)")
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left")
    lower, upper = bins["lower"], bins["upper"]
    bottom.bar(lower, bins["count"], width=[u - lo for lo, u in zip(lower, upper, strict=True)], align="edge")
    if any(bins["count"]):
        bottom.set_yscale("log")
    bottom.set_xlabel("predicted probability")
    bottom.set_ylabel("examples")
    out.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, Path(out))
    return out
