"""``bench/quality.py --tune DURATION``: ``recstack tune`` on each data set's validation split, then the chosen
configuration over the seeds, scored on the test split against the better FuxiCTR model.

The target this measures: on every real data set, ``recstack tune`` with a 20-minute budget on the 2-core machine,
then ``best.toml`` trained once per seed (``--seeds``), has a mean test AUC at or above the better of FuxiCTR's DLRM
and DCNv2 with their published settings, and a mean test logloss no worse than that peer's + 0.002. Each data set
gets one study, through the CLI a user runs:

    recstack tune --config RECIPE --output-dir WORK/NAME/tune --set data.train=... --set data.eval=... \\
        --time-budget DURATION --jobs JOBS --seed 0 --seeds 0 1 2

then ``recstack eval --checkpoint WORK/NAME/tune/seeds/<seed> --data TEST`` per seed. Tune reads the training and
validation splits only; the test split is read once per seed, after the study has ended, by ``eval``. The study's
size depends on the machine's load (the budget is wall time): the trials it finished, and the load average while
it ran, are in the report.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from pathlib import Path

TUNED = "recstack DLRM (tuned)"
LOGLOSS_SLACK = 0.002  # the target's "logloss no worse than the peer's + 0.002"


def run_tuned_recstack(name: str, layout: str, work: Path, budget: str, jobs: int, seeds: list[int]) -> list[dict]:
    """One study on data set ``name`` with its layout's recipe and the recipe's space, then ``best.toml`` per seed
    in ``seeds``, each scored on the test split -> one run per seed (as ``quality.run_recstack``'s), each with the
    study's description under ``study``."""
    from quality import RECIPES, ROOT, _recstack

    data, out = work / name / "recstack", work / name / "tune"
    if out.exists():  # a fresh study each time: --resume would change what the budget means
        shutil.rmtree(out)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    _recstack(["tune", "--config", str(ROOT / RECIPES[layout]), "--output-dir", str(out),
               "--set", f"data.train={data / 'train'}", "--set", f"data.eval={data / 'valid'}",
               "--time-budget", budget, "--jobs", str(jobs), "--seed", "0",
               "--seeds", *map(str, seeds)])
    wall = time.perf_counter() - t0
    study = describe_study(out)
    study.update(budget=budget, jobs=jobs, wall_s=round(wall, 1), load_before=round(load_before, 2),
                 load_after=round(os.getloadavg()[0], 2))
    retrained = json.loads((out / "seeds.json").read_text())
    runs = []
    for seed, valid_auc in zip(retrained["seeds"], retrained["valid_auc"], strict=True):
        run = out / "seeds" / str(seed)
        test = json.loads(_recstack(["eval", "--checkpoint", str(run), "--data", str(data / "test")]))
        summary = json.loads((run / "summary.json").read_text())
        kept = summary.get("best") or summary
        runs.append({"model": TUNED, "seed": seed, "valid_auc": valid_auc, "valid_logloss": kept.get("logloss"),
                     "test_auc": test["auc"], "test_logloss": test["logloss"], "study": study,
                     "wall_s": round(wall / len(retrained["seeds"]), 2)})
    return runs


def describe_study(out: Path) -> dict:
    """What ``recstack tune`` left in ``out``: trials by outcome, the best trial and its sampled values (from
    ``trials.csv``), and whether trial 0 (the recipe itself) was the best."""
    with open(out / "trials.csv", newline="") as f:
        trials = list(csv.DictReader(f))
    outcomes: dict[str, int] = {}
    for t in trials:
        outcomes[t["state"]] = outcomes.get(t["state"], 0) + 1
    complete = [t for t in trials if t["state"] == "complete" and t["valid_auc"]]
    best = max(complete, key=lambda t: float(t["valid_auc"]))
    fixed = {"number", "state", "valid_auc", "valid_logloss", "evaluations", "seconds", "directory"}
    params = {k: v for k, v in best.items() if k not in fixed and v != ""}
    return {"trials": len(trials), "outcomes": outcomes, "best_trial": int(best["number"]),
            "best_valid_auc": round(float(best["valid_auc"]), 5), "best_params": params}


def tune_verdicts(models: dict) -> dict | None:
    """The target's verdicts from ``summarize``'s per-model statistics: the tuned configuration's mean test AUC
    against the FuxiCTR model with the better mean test AUC (met when >=), and its mean test logloss against
    that peer's + LOGLOSS_SLACK (met when <=). None without a tuned run or a peer."""
    ours = models.get(TUNED)
    peers = {m: s for m, s in models.items() if m.startswith("FuxiCTR")}
    if ours is None or not peers:
        return None
    peer = max(peers, key=lambda m: peers[m]["test_auc"]["mean"])
    p = peers[peer]
    diff = ours["test_auc"]["mean"] - p["test_auc"]["mean"]
    return {"peer": peer, "tuned_auc": ours["test_auc"], "peer_auc": p["test_auc"], "diff_auc": round(diff, 5),
            "tuned_logloss": ours["test_logloss"], "peer_logloss": p["test_logloss"],
            "auc_met": diff >= 0,
            "logloss_met": ours["test_logloss"]["mean"] <= p["test_logloss"]["mean"] + LOGLOSS_SLACK}


def tune_table(result: dict) -> str:
    """Markdown: per data set, the study (trials, best trial), the tuned configuration's test AUC and logloss over
    the seeds, the recipe's and the best peer's, and the two verdicts."""
    from quality import _fmt

    lines = ["| data set | trials (complete/pruned/failed) | best trial | tuned test AUC | tuned logloss | "
             "recipe test AUC | best peer | peer test AUC | peer logloss | diff | AUC >= peer | "
             "logloss <= peer + 0.002 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, ds in result["datasets"].items():
        v = ds.get("tune")
        if v is None:
            continue
        study = next(r["study"] for r in ds["runs"] if r["model"] == TUNED)
        o = study["outcomes"]
        counts = f"{study['trials']} ({o.get('complete', 0)}/{o.get('pruned', 0)}/{o.get('failed', 0)})"
        recipe = ds["models"].get("recstack DLRM")
        met = {True: "met", False: "missed"}
        lines.append(f"| {name} | {counts} | {study['best_trial']} | {_fmt(v['tuned_auc'])} | "
                     f"{_fmt(v['tuned_logloss'])} | {_fmt(recipe['test_auc']) if recipe else 'n/a'} | {v['peer']} | "
                     f"{_fmt(v['peer_auc'])} | {_fmt(v['peer_logloss'])} | {v['diff_auc']:+.4f} | "
                     f"{met[v['auc_met']]} | {met[v['logloss_met']]} |")
    return "\n".join(lines)


def saved_runs(paths: list[Path], name: str, rows: dict, seeds: list[int]) -> list[dict]:
    """The runs data set ``name`` has in earlier reports of ``bench/quality.py`` (``--peers``): FuxiCTR's and
    the recipe's, on the seeds asked for. The split is checked to be the one prepared now (its row counts), so a
    report of another split cannot be compared. Their saved test predictions are dropped: the runs directory
    they name may be gone, and a bootstrap needs them."""
    for path in paths:
        ds = json.loads(path.read_text())["datasets"].get(name)
        if ds is None:
            continue
        if ds["rows"] != rows:
            raise SystemExit(f"{path}: data set {name} has rows {ds['rows']}, the split prepared now {rows}")
        keep = [{k: v for k, v in r.items() if k != "test_predictions"} for r in ds["runs"]
                if r["seed"] in seeds and (r["model"].startswith("FuxiCTR") or r["model"] == "recstack DLRM")]
        return keep
    raise SystemExit(f"{', '.join(map(str, paths))}: no saved runs of data set {name}")
