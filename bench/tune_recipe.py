"""Choose a recipe's options on validation data: a small, fixed set of candidates on top of a recipe of
``configs/recipes/``, each trained with ``recstack train`` on a real data set's training split and scored on
its validation split only (the test split is never read here; ``bench/quality.py`` scores the chosen recipe).

The candidates add what docs/training.md offers against overfitting: early stopping with the best checkpoint
(up to 10 epochs, an evaluation every half epoch, patience 3 on validation AUC), embedding L2, dropout, batch
normalisation and FuxiCTR's wider top MLP. Prints JSON: per candidate its overrides and the validation AUC and
logloss of the model it keeps (the best evaluation with early stopping, else the last), mean [min, max] over
the seeds, best first.

    python bench/tune_recipe.py --dataset ml100k --seeds 0 --out bench/results/tune_categorical.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import RECIPES, ROOT, _recstack, _stat, prepare  # noqa: E402

ES = ["train.epochs=10", "train.early_stopping.patience=3", "train.early_stopping.metric=\"auc\""]
CANDIDATES: dict[str, list[str]] = {
    "recipe": [],
    "early stopping": ES,
    "es + emb L2 3e-3": [*ES, "optim.sparse_weight_decay=3e-3"],
    "es + emb L2 1e-3": [*ES, "optim.sparse_weight_decay=1e-3"],
    "es + emb L2 5e-3": [*ES, "optim.sparse_weight_decay=5e-3"],
    "es + emb L2 1e-2": [*ES, "optim.sparse_weight_decay=1e-2"],
    "es + emb L2 3e-3 + dim 32": [*ES, "optim.sparse_weight_decay=3e-3", "model.embedding_dim=32"],
    "es + emb L2 3e-3 + top 400x3": [*ES, "optim.sparse_weight_decay=3e-3", "model.top_mlp=[400,400,400,1]"],
    "es + emb L2 3e-3 + dropout 0.1": [*ES, "optim.sparse_weight_decay=3e-3", "model.dropout=0.1"],
    "es + emb L2 3e-3 + emb lr 0.05": [*ES, "optim.sparse_weight_decay=3e-3", "optim.sparse_lr=0.05"],
    "es + dropout 0.2 + batch norm + top 400x3": [*ES, "model.dropout=0.2", "model.mlp_norm=\"batch\"",
                                                  "model.top_mlp=[400,400,400,1]"],
    "es + dropout 0.2 + batch norm + top 400x3 + emb L2 3e-3": [
        *ES, "model.dropout=0.2", "model.mlp_norm=\"batch\"", "model.top_mlp=[400,400,400,1]",
        "optim.sparse_weight_decay=3e-3"],
}


def train_valid(name: str, recipe: str, cand: str, sets: list[str], seed: int, work: Path, eval_every: int) -> dict:
    """One candidate, one seed: the validation metrics of the model the run keeps."""
    data = work / name / "recstack"
    run = work / name / "tune" / f"{cand.replace(' ', '_').replace('+', '')}_{seed}"
    args = ["train", "--output-dir", str(run), "--overwrite", "--config", str(ROOT / recipe)]
    for s in [f"data.train={data / 'train'}", f"data.eval={data / 'valid'}", f"train.seed={seed}",
              "train.progress=false", f"train.eval_every={eval_every}", *sets]:
        args += ["--set", s]
    t0 = time.perf_counter()
    _recstack(args)
    summary = json.loads((run / "summary.json").read_text())
    kept = summary.get("best") or summary
    return {"seed": seed, "valid_auc": kept["auc"], "valid_logloss": kept["logloss"],
            "step": summary.get("best_step", summary.get("step")), "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="ml100k")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "quality")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    ds = prepare(args.dataset, args.work)
    recipe = RECIPES["criteo" if ds["layout"] == "criteo" else "categorical"]
    batch = 256 if recipe.endswith("categorical.toml") else 128
    eval_every = max(1, ds["rows"]["train"] // batch // 2)  # twice per epoch
    result: dict = {"command": "python bench/tune_recipe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "dataset": args.dataset, "recipe": recipe, "eval_every": eval_every, "candidates": []}
    for cand in args.candidates:
        runs = [train_valid(args.dataset, recipe, cand, CANDIDATES[cand], s, args.work, eval_every)
                for s in args.seeds]
        entry = {"name": cand, "set": CANDIDATES[cand], "runs": runs,
                 "valid_auc": _stat([r["valid_auc"] for r in runs]),
                 "valid_logloss": _stat([r["valid_logloss"] for r in runs])}
        print(f"[tune] {json.dumps(entry)}", file=sys.stderr, flush=True)
        result["candidates"].append(entry)
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    result["candidates"].sort(key=lambda c: -c["valid_auc"]["mean"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
