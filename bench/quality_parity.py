"""``bench/quality.py --parity``: recstack configured with FuxiCTR's published hyperparameters against FuxiCTR itself.

For each data set and each FuxiCTR model the bench runs (DLRM, DCNv2 with the BARS settings of ``SETTINGS``),
recstack trains ``configs/parity/<layout>_<model>.toml`` instead of its recipe: the same settings in recstack's
keys (Adam on the tables with FuxiCTR's all-rows embedding L2, its MLP / cross-network structure, batch norm and
dropout, batch 4096, early stopping on validation AUC with patience 2 and the learning rate / 10 at each
plateau), evaluated once per epoch as FuxiCTR evaluates, on the same splits and seeds. The verdict per model:
whether recstack's test AUCs over the seeds and FuxiCTR's overlap ([min, max] of each, "within the seeds'
spread"); with one seed there is no spread and only the difference is reported.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

PARITY_MODELS = ("DLRM", "DCNv2")


def parity_config(layout: str, model: str) -> str:
    """The recstack config (relative to the repository) that expresses FuxiCTR ``model``'s settings for the
    data set ``layout`` (movielens, else criteo: the settings for numeric fields)."""
    return f"configs/parity/{'movielens' if layout == 'movielens' else 'criteo'}_{model.lower()}.toml"


def epoch_eval(config: str, train_rows: int, root: Path) -> str:
    """``--set`` for one evaluation per epoch at the config's batch size, as FuxiCTR (eval_steps None: every
    epoch of ceil(rows / batch) batches)."""
    import tomllib

    batch = tomllib.loads((root / config).read_text())["train"]["batch_size"]
    return f"train.eval_every={max(1, math.ceil(train_rows / batch))}"


def run_parity_recstack(name: str, layout: str, model: str, train_rows: int, seed: int, work: Path) -> dict:
    """One seed of recstack with ``model``'s parity config on data set ``name``: train, then score the kept
    (best by validation AUC) checkpoint on the test split."""
    from quality import ROOT, _recstack, train_recipe

    config = parity_config(layout, model)
    data, run = work / name / "recstack", work / name / f"run_parity_{model}_{seed}"
    t0 = time.perf_counter()
    _, kept = train_recipe(data, run, config, seed, [epoch_eval(config, train_rows, ROOT)])
    test = json.loads(_recstack(["eval", "--checkpoint", str(run), "--data", str(data / "test")]))
    return {"model": f"recstack {model} (parity)", "seed": seed, "config": config, "valid_auc": kept.get("auc"),
            "valid_logloss": kept.get("logloss"), "test_auc": test["auc"], "test_logloss": test["logloss"],
            "wall_s": round(time.perf_counter() - t0, 2)}


def verdicts(models: dict) -> dict:
    """{FuxiCTR model: verdict} from ``summarize``'s per-model statistics: recstack's and FuxiCTR's mean test
    AUC and logloss, the difference, and ``within_spread`` (the two [min, max] ranges over seeds overlap; None
    with a single seed, where there is no spread to be within)."""
    out = {}
    for model in PARITY_MODELS:
        ours, peer = models.get(f"recstack {model} (parity)"), models.get(f"FuxiCTR {model}")
        if ours is None or peer is None:
            continue
        a, b = ours["test_auc"], peer["test_auc"]
        spread = len(ours["seeds"]) > 1 and len(peer["seeds"]) > 1
        out[model] = {"recstack_auc": a, "fuxictr_auc": b, "diff_auc": round(a["mean"] - b["mean"], 5),
                      "recstack_logloss": ours["test_logloss"], "fuxictr_logloss": peer["test_logloss"],
                      "within_spread": (a["min"] <= b["max"] and b["min"] <= a["max"]) if spread else None}
    return out


def parity_table(result: dict) -> str:
    """Markdown: per data set and model, both libraries' test AUC mean [min, max] and the verdict."""
    from quality import _fmt

    lines = ["| data set | model | recstack (parity config) test AUC | FuxiCTR test AUC | difference | within the "
             "seeds' spread |", "|---|---|---|---|---|---|"]
    for name, ds in result["datasets"].items():
        for model, v in ds.get("parity", {}).items():
            within = {True: "yes", False: "no", None: "n/a (one seed)"}[v["within_spread"]]
            lines.append(f"| {name} | {model} | {_fmt(v['recstack_auc'])} | {_fmt(v['fuxictr_auc'])} | "
                         f"{v['diff_auc']:+.4f} | {within} |")
    return "\n".join(lines)
