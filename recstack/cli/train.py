"""``recstack train``: parse the config, build a Trainer, train, print the summary."""

from __future__ import annotations

import argparse
import json

from recstack.config import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (configs/*.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set model.embedding_dim=32 (repeatable)")
    p.add_argument("--output-dir", help="metrics.jsonl, summary.json, TensorBoard, checkpoints, curves.png")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an --output-dir that holds an earlier run (its checkpoints and metrics "
                        "are removed)")


def run(args: argparse.Namespace) -> dict:
    from recstack.training.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg, args.output_dir, resume=args.resume, overwrite=args.overwrite)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if not trainer.is_main:
        return summary
    print(json.dumps(summary, indent=2))
    auc, ne = summary.get("auc"), summary.get("ne")
    if auc is None:  # no evaluation rows
        print("final eval: none (no evaluation rows)")
        return summary
    line = f"final eval: AUC {auc:.4f}  NE {ne:.4f}"
    if "oracle_auc" in summary:
        line += f"  (generator's oracle AUC {summary['oracle_auc']:.4f})"
    print(line)
    return summary
