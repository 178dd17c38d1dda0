"""Aggregate an ExFM experiment: NE gain per arm and staleness over seeds, tables and charts.

A VM's NE is pooled over every example it was progressively evaluated on from ``vm_start`` on (logloss
over all those examples / entropy of their base rate), so windows weigh by their size. NE gain % of an arm
= (NE_alone - NE_arm) / NE_alone * 100 against the VM alone of the same seed and vertical; a seed's gain is
the mean over verticals, and the report gives the mean over seeds with the sample standard deviation and the
range. Calibration is mean prediction / observed rate, AUC the pooled AUC, both averaged like the gain.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from recstack.exfm.config import ARM_TITLES

COLORS = {"alone": "0.35", "distill": "tab:orange", "distill_sa": "tab:red", "aux": "tab:blue", "aux_sa": "tab:green",
          "fm": "tab:purple"}


def ne_gain(base: float, new: float) -> float:
    """NE gain % of ``new`` over ``base`` (positive = better)."""
    return (base - new) / base * 100.0


def _spread(values: list[float]) -> dict[str, Any]:
    a = np.array([v for v in values if v is not None and math.isfinite(v)], np.float64)
    if len(a) == 0:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "values": []}
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "min": float(a.min()),
            "max": float(a.max()), "n": int(len(a)), "values": [float(x) for x in a]}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """-> {"alone": ..., "arms": [{arm, staleness, gain, ne, auc, calibration, fm_ne, adapter_ne}],
    "sa_advantage": [...], "fm": ...} with spreads over seeds."""
    alone = {(r["seed"], r["vertical"]): r["summary"]["serving"] for r in results["vm"] if r["arm"] == "alone"}
    per: dict[tuple[str, int], dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(
        lambda: defaultdict(list)))
    for r in results["vm"]:
        if r["arm"] == "alone":
            continue
        s, base = r["summary"], alone[(r["seed"], r["vertical"])]
        cell = per[(r["arm"], r["staleness"])][r["seed"]]
        cell["gain"].append(ne_gain(base["ne"], s["serving"]["ne"]))
        for key in ("ne", "auc", "calibration"):
            cell[key].append(s["serving"][key])
        cell["fm_ne"].append(s.get("fm", {}).get("ne"))
        cell["adapter_ne"].append(s.get("adapter", {}).get("ne"))

    def seed_means(cells: dict[int, dict[str, list[float]]], key: str) -> list[float]:
        out = []
        for c in cells.values():
            vals = [v for v in c[key] if v is not None]
            out.append(float(np.mean(vals)) if vals else float("nan"))
        return out

    arms = []
    for (arm, d), cells in sorted(per.items(), key=lambda kv: (list(ARM_TITLES).index(kv[0][0]), kv[0][1])):
        arms.append({"arm": arm, "staleness": d, **{k: _spread(seed_means(cells, k)) for k in
                     ("gain", "ne", "auc", "calibration", "fm_ne", "adapter_ne")}})
    by_seed: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (seed, _v), m in alone.items():
        for key in ("ne", "auc", "calibration"):
            by_seed[seed][key].append(m[key])
    alone_row = {k: _spread([float(np.mean(c[k])) for c in by_seed.values()]) for k in ("ne", "auc", "calibration")}
    advantage = []
    for d in sorted({d for _, d in per}):
        for arm, other in (("aux_sa", "aux"), ("aux_sa", "distill"), ("distill_sa", "distill")):
            if (arm, d) in per and (other, d) in per:
                a, b = per[(arm, d)], per[(other, d)]
                diffs = [float(np.mean(a[s]["gain"]) - np.mean(b[s]["gain"])) for s in a if s in b]
                advantage.append({"staleness": d, "arm": arm, "versus": other, "points": _spread(diffs)})
    fm = defaultdict(list)
    for res in results.get("fm", {}).values():
        for key, m in res["summary"].items():
            fm[key].append(m["ne"])
    return {"alone": alone_row, "arms": arms, "sa_advantage": advantage,
            "fm_fresh_ne": {k: _spread(v) for k, v in sorted(fm.items())}}


def _fmt(s: dict[str, Any], digits: int = 2) -> str:
    if s["mean"] is None:
        return "-"
    if s["n"] > 1:
        return f"{s['mean']:+.{digits}f} ± {s['std']:.{digits}f}"
    return f"{s['mean']:+.{digits}f}"


def markdown(summary: dict[str, Any], vertical_names: list[str]) -> str:
    a = summary["alone"]
    lines = [
        f"VM alone: NE {a['ne']['mean']:.4f} (seed spread ± {a['ne']['std']:.4f}), AUC {a['auc']['mean']:.4f}, "
        f"calibration {a['calibration']['mean']:.3f}; verticals: {', '.join(vertical_names)}.",
        "",
        "| arm | staleness | NE gain % (mean ± sd over seeds) | range | NE | AUC | calibration | FM-label NE "
        "| adapter NE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["arms"]:
        g = r["gain"]
        rng = f"{g['min']:+.2f} .. {g['max']:+.2f}" if g["mean"] is not None else "-"
        fm = f"{r['fm_ne']['mean']:.4f}" if r["fm_ne"]["mean"] is not None else "-"
        ad = f"{r['adapter_ne']['mean']:.4f}" if r["adapter_ne"]["mean"] is not None else "-"
        lines.append(f"| {ARM_TITLES[r['arm']]} | {r['staleness']} | {_fmt(g)} | {rng} | {r['ne']['mean']:.4f} | "
                     f"{r['auc']['mean']:.4f} | {r['calibration']['mean']:.3f} | {fm} | {ad} |")
    if summary["sa_advantage"]:
        lines += ["", "| staleness | arm | minus | NE gain points (mean ± sd over seeds) |", "|---|---|---|---|"]
        for r in summary["sa_advantage"]:
            lines.append(f"| {r['staleness']} | {ARM_TITLES[r['arm']]} | {ARM_TITLES[r['versus']]} "
                         f"| {_fmt(r['points'])} |")
    return "\n".join(lines) + "\n"


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def plot_gain(summary: dict[str, Any], path: Path, title: str = "") -> Path:
    """NE gain % against VM alone per arm over staleness: mean over seeds, bars = sd, dots = seeds."""
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    arms = sorted({r["arm"] for r in summary["arms"]}, key=list(ARM_TITLES).index)
    for i, arm in enumerate(arms):
        rows = sorted((r for r in summary["arms"] if r["arm"] == arm), key=lambda r: r["staleness"])
        x = np.array([r["staleness"] for r in rows], np.float64) + (i - (len(arms) - 1) / 2) * 0.08
        y = [r["gain"]["mean"] for r in rows]
        ax.errorbar(x, y, yerr=[r["gain"]["std"] for r in rows], marker="o", capsize=3, color=COLORS[arm],
                    label=ARM_TITLES[arm])
        for xi, r in zip(x, rows, strict=True):
            ax.scatter([xi] * r["gain"]["n"], r["gain"]["values"], s=8, color=COLORS[arm], alpha=0.35)
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.set_xlabel("FM staleness d (windows)")
    ax.set_ylabel("NE gain % vs VM alone")
    ax.set_xticks(sorted({r["staleness"] for r in summary["arms"]}))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "NE gain over the VM alone (mean ± sd over seeds)")
    return _save(fig, path)


def _window_series(results: dict[str, Any], arm: str, d: int, group: str) -> dict[int, float]:
    """Window -> mean over seeds and verticals of ``group``'s NE for (arm, d)."""
    acc: dict[int, list[float]] = defaultdict(list)
    for r in results["vm"]:
        if r["arm"] == arm and r["staleness"] == d:
            for rec in r["records"]:
                ne = rec.get(group, {}).get("ne")
                if ne is not None:
                    acc[rec["window"]].append(ne)
    return {w: float(np.mean(v)) for w, v in sorted(acc.items())}


def plot_by_window(results: dict[str, Any], path: Path) -> Path:
    """Per staleness (columns): NE per window of each arm and of the FM labels (top), and each arm's NE gain %
    per window against VM alone (bottom); means over seeds and verticals."""
    cfg = results["config"]
    stal = sorted(cfg["experiment"]["staleness"])
    arms = [a for a in ARM_TITLES if a in cfg["experiment"]["arms"]]
    start = cfg["stream"]["vm_start"]
    fig = Figure(figsize=(4 * len(stal), 7), layout="constrained")
    axes = fig.subplots(2, len(stal), sharex=True, sharey="row", squeeze=False)
    alone = _window_series(results, "alone", -1, "serving")
    for j, d in enumerate(stal):
        top, bottom = axes[0][j], axes[1][j]
        for arm in arms:
            s = alone if arm == "alone" else _window_series(results, arm, d, "serving")
            top.plot(list(s), list(s.values()), color=COLORS[arm], label=ARM_TITLES[arm], linewidth=1.2)
            if arm != "alone":
                w = [k for k in s if k in alone and k >= start]
                bottom.plot(w, [ne_gain(alone[k], s[k]) for k in w], color=COLORS[arm], linewidth=1.2)
        fm = _window_series(results, next((a for a in arms if a != "alone"), "aux"), d, "fm")
        top.plot(list(fm), list(fm.values()), color=COLORS["fm"], linestyle="--", label=f"FM labels (d={d})")
        for ax in (top, bottom):
            ax.axvspan(-0.5, start - 0.5, color="0.9", zorder=0)  # warm-up: every arm is the VM alone
            ax.grid(True, alpha=0.3)
        bottom.axhline(0.0, color="0.5", linewidth=0.8)
        top.set_title(f"staleness d = {d}")
        bottom.set_xlabel("window")
    # The untrained model's first windows would squash the rest of the curve: zoom on the trained part.
    late = [rec[g]["ne"] for r in results["vm"] for rec in r["records"] if rec["window"] >= max(start - 2, 1)
            for g in ("serving", "fm") if rec.get(g, {}).get("ne") is not None]
    if late:
        pad = 0.05 * (max(late) - min(late)) + 1e-3
        axes[0][0].set_ylim(min(late) - pad, max(late) + pad)
    axes[0][0].set_ylabel("NE (progressive)")
    axes[1][0].set_ylabel("NE gain % vs VM alone")
    axes[0][0].legend(fontsize=7)
    return _save(fig, path)


def published_vm(results: dict[str, Any]) -> dict[str, Any] | None:
    """The published VM (``experiment.publish_vm``) with its NE and NE gain % over the VM alone of its seed and
    vertical, and what its server measured when that was added (``served``: p50 / p99 ms, req/s); None: none."""
    pub = results.get("published_vm")
    if not pub:
        return None
    key = (pub["seed"], pub["vertical"])
    ne = {(r["arm"], r["staleness"]): r["summary"]["serving"]["ne"] for r in results["vm"]
          if (r["seed"], r["vertical"]) == key}
    arm_ne, alone_ne = ne[(pub["arm"], pub["staleness"])], ne[("alone", -1)]
    return {**pub, "ne": arm_ne, "alone_ne": alone_ne, "ne_gain": ne_gain(alone_ne, arm_ne)}


def published_markdown(pub: dict[str, Any]) -> str:
    """The report's line for the published VM: its NE gain beside its served latency (when measured)."""
    versions = pub.get("versions", [])
    fulls = sum(1 for v in versions if v.get("full"))
    head = (f"Published VM (seed {pub['seed']}, vertical {pub['vertical']}, {ARM_TITLES[pub['arm']]}, staleness "
            f"{pub['staleness']}) to {pub['root']}: {len(versions)} versions ({fulls} full, {len(versions) - fulls} "
            f"deltas); NE {pub['ne']:.4f}, NE gain {pub['ne_gain']:+.2f}% over the VM alone ({pub['alone_ne']:.4f})")
    s = pub.get("served")
    if not s:
        return head + "; not served in this run.\n"
    return (head + f"; served: p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms at "
            f"{s['rps']:.0f} req/s ({s['what']}).\n")


def write_report(results: dict[str, Any], out: Path) -> dict[str, Any]:
    """results.json, report.md, ne_gain.png and ne_by_window.png in ``out``; -> the summary."""
    out = Path(out)
    summary = summarize(results)
    results = {**results, "summary": summary}
    pub = published_vm(results)
    if pub is not None:
        results["published_vm"] = pub
    text = markdown(summary, results.get("vertical_names", []))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(text + ("\n" + published_markdown(pub) if pub is not None else ""))
    plot_gain(summary, out / "ne_gain.png")
    plot_by_window(results, out / "ne_by_window.png")
    return summary


def add_served(out: Path, served: dict[str, Any]) -> dict[str, Any]:
    """Record what the published VM's server measured (``served``: ``p50_ms``, ``p99_ms``, ``rps`` and ``what``
    was measured) in the report of the run in ``out`` (results.json and report.md rewritten) -> the published
    VM's entry. A ValueError when the run published no VM."""
    out = Path(out)
    results = json.loads((out / "results.json").read_text())
    if not results.get("published_vm"):
        raise ValueError(f"{out / 'results.json'}: the run published no VM (experiment.publish_vm)")
    for key in ("p50_ms", "p99_ms", "rps", "what"):
        if key not in served:
            raise ValueError(f"served figures: {key!r} missing")
    results["published_vm"]["served"] = served
    write_report(results, out)
    return json.loads((out / "results.json").read_text())["published_vm"]
