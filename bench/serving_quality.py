"""Quantized serving tables: memory against fp32 and the AUC change on real held-out data, per width.

Data (real): MovieLens-100k (``scripts/fetch_movielens.py``; ratings in time order, label rating >= 4) and the
shared Criteo Kaggle sample (``--criteo``, raw TSV prepared with a vocabulary). For each, one model is trained
(dim 16, dot interaction, Adam + row-wise Adagrad, one epoch; the last ``eval_fraction`` of the rows in time
order held out), exported once per width with ``recstack export``, and the held-out rows are scored by
``ServingModel`` from each artifact (the quantized lookup and the exported dense program) and, as the reference,
by the trained model in eager fp32 (``predict_logits``). Reported per data set and width: table bytes / fp32
table bytes, AUC and AUC - reference AUC, and the largest |logit - reference logit|.

    python bench/serving_quality.py [--movielens runs/data/ml-100k] [--criteo FILE] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from recstack.config import load_config  # noqa: E402
from recstack.data.prepare.criteo_prepare import prepare_criteo  # noqa: E402
from recstack.exfm.movielens import MovieLensConfig, prepare_movielens  # noqa: E402
from recstack.metrics import BinaryMetrics  # noqa: E402
from recstack.serving.export import export_checkpoint  # noqa: E402
from recstack.serving.model import EncodedBatch, ServingModel  # noqa: E402
from recstack.training.inference import evaluation_rows, load_model, predict_logits  # noqa: E402
from recstack.training.trainer import Trainer  # noqa: E402

WIDTHS = ("fp32", "fp16", "int8", "int4")
MODEL = ["model.embedding_dim=16", "model.bottom_mlp=[64, 16]", "model.top_mlp=[64, 32, 1]",
         'optim.dense="adam"', "optim.dense_lr=0.002", 'optim.sparse="rowwise_adagrad"', "optim.sparse_lr=0.05",
         "train.epochs=1", "train.progress=false", "data.eval_fraction=0.2"]


def auc(logits: np.ndarray, labels: np.ndarray) -> float:
    m = BinaryMetrics()
    m.update(torch.from_numpy(logits.astype(np.float32)), torch.from_numpy(labels))
    return float(m.compute()["auc"])


def measure(name: str, data: Path, work: Path, batch_size: int) -> dict[str, Any]:
    cfg = load_config(None, [f'data.train="{data}"', f"train.batch_size={batch_size}", *MODEL])
    trainer = Trainer(cfg, work / "run")
    try:
        trainer.train()
    finally:
        trainer.close()
    cfg, model = load_model(work / "run")
    ds, (lo, hi), what = evaluation_rows(cfg, work / "run")
    ref, labels = predict_logits(cfg, model, ds, progress=False, rows=(lo, hi))
    out: dict[str, Any] = {"data": name, "held_out": what.split(": ", 1)[-1], "rows": hi - lo,
                           "reference_auc": auc(ref, labels), "widths": {}}
    (work / "models").mkdir()
    for w in WIDTHS:
        path, _ = export_checkpoint(work / "run", work / "models", w)
        m = ServingModel.load(path)
        batch = ds.batch(lo, hi)
        caps = torch.tensor(model.feature_rows())
        batch.sparse.ids = torch.remainder(batch.sparse.ids, caps.repeat_interleave(batch.sparse.ids_per_feature))
        logits = m.score(EncodedBatch(batch.dense, batch.sparse)).numpy()
        tb = m.manifest["table_bytes"]
        a = auc(logits, labels)
        out["widths"][w] = {"table_bytes": tb["total"], "fp32_table_bytes": tb["fp32"], "ratio": tb["ratio"],
                            "auc": a, "auc_delta": a - out["reference_auc"],
                            "max_abs_logit_diff": float(np.abs(logits - ref).max())}
        print(f"{name:10s} {w:5s} tables {tb['ratio']:.4f}x fp32  AUC {a:.5f} ({a - out['reference_auc']:+.5f})  "
              f"max |dlogit| {out['widths'][w]['max_abs_logit_diff']:.2e}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--movielens", default="runs/data/ml-100k", help="MovieLens-100k directory ('' to skip)")
    p.add_argument("--criteo", default="/work/shared/data/criteo_kaggle_sample.tsv",
                   help="raw Criteo TSV ('' to skip)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving_quality.json"))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        if args.movielens:
            prepare_movielens(MovieLensConfig(path=args.movielens), t / "ml" / "data")
            results.append(measure("movielens", t / "ml" / "data", t / "ml", 256))
        if args.criteo:
            prepare_criteo([Path(args.criteo)], t / "criteo" / "data", vocab_min_freq=1, progress=False)
            results.append(measure("criteo", t / "criteo" / "data", t / "criteo", 64))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
