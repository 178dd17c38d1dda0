"""``recstack eval | predict``: score prepared data with a trained checkpoint (metrics as JSON, or a scores
file)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recstack.cli.args import positive_int
from recstack.io import atomic_path, check_writable, json_safe

if TYPE_CHECKING:
    import torch


def add_parser(sub: argparse._SubParsersAction) -> None:
    for name, func in (("eval", run_eval), ("predict", run_predict)):
        e = sub.add_parser(name, help=f"{name} with a trained checkpoint")
        e.add_argument("--checkpoint", required=True,
                       help="checkpoint (ckpt_<step>.pt, or a torchrun run's step_<step>/), used as given, or run "
                            "directory: its best checkpoint when it trained with train.early_stopping, else its "
                            "newest")
        e.add_argument("--last", action="store_true",
                       help="with a run directory: its newest checkpoint even when it kept a best one")
        e.add_argument("--data", required=name == "predict",
                       help="prepared data directory" + ("" if name == "predict" else " (default: the rows the "
                             "run evaluated on: data.eval, else the held-out tail of its training set)"))
        e.add_argument("--batch-size", type=positive_int, default=16384)
        e.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N or auto "
                                                       "(a GPU when there is one)")
        if name == "predict":
            e.add_argument("--out", required=True, help="scores file: .npy (probabilities) or .csv")
            e.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        e.set_defaults(func=func)



def _device(name: str) -> torch.device:
    """``--device``: auto | cpu | cuda | cuda:N (a CUDA device must exist here)."""
    from recstack.training.config import check_device_name
    from recstack.training.step import resolve_device

    check_device_name(name, check_available=True, field="--device")
    return resolve_device(name)


def run_eval(args: argparse.Namespace) -> None:
    from recstack.data.prepared_dataset import PreparedDataset
    from recstack.training.inference import evaluate, evaluation_rows, load_model

    cfg, model = load_model(args.checkpoint, _device(args.device), last=args.last)
    if args.data:
        data = PreparedDataset(args.data)
        rows, what = (0, len(data)), f"{data.path}: all {len(data)} rows (--data)"
    else:  # the rows the run evaluated on, never the ones it trained on
        data, rows, what = evaluation_rows(cfg, args.checkpoint)
    print(f"evaluating {what}", file=sys.stderr)
    result = evaluate(cfg, model, data, args.batch_size, rows)
    # An undefined metric (AUC of a one-class or empty set) is null: JSON has no NaN.
    safe = json_safe(result)
    print(json.dumps({**safe, "data": str(data.path), "rows": list(rows)}, indent=2, allow_nan=False))


def run_predict(args: argparse.Namespace) -> None:
    import numpy as np

    from recstack.data.prepared_dataset import PreparedDataset
    from recstack.training.inference import load_model, predict_logits

    out = Path(args.out)
    if out.suffix not in (".npy", ".csv"):
        raise ValueError(f"--out {out}: expected a .npy or .csv file name")
    if out.exists() and not args.overwrite:  # checked before the (long) scoring
        raise FileExistsError(f"--out {out} exists (pass --overwrite to replace it)")
    check_writable(out, directory=False)  # a read-only or missing place for it, too
    cfg, model = load_model(args.checkpoint, _device(args.device), last=args.last)
    logits, labels = predict_logits(cfg, model, PreparedDataset(args.data), args.batch_size)
    prob = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed over it: an interrupted run (or a full disk: a DiskError) leaves no
    # file with rows missing, and no .tmp.
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        if out.suffix == ".npy":  # header, then the rows by f.write: np.save's own write hides ENOSPC
            scores = prob.astype(np.float32)
            np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(scores))
            f.write(scores.tobytes())
        else:  # CSV: row, score, label
            f.write(b"row,score,label\n")
            f.writelines(f"{i},{p:.7g},{int(y)}\n".encode() for i, (p, y) in enumerate(zip(prob, labels, strict=True)))
    print(f"wrote {len(prob)} scores to {out}")
