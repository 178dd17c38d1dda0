"""``recstack export`` (a checkpoint -> a serving artifact) and ``recstack serve`` (an HTTP scoring server)."""

from __future__ import annotations

import argparse
import json


def _cmd_export(args: argparse.Namespace) -> None:
    from recstack.serving.artifact import read_manifest
    from recstack.serving.export import export_checkpoint

    path, version = export_checkpoint(args.checkpoint, args.out, args.tables, args.table, args.data)
    m = read_manifest(path, verify=False)
    tb = m["table_bytes"]
    widths = sorted({t["width"] for t in m["tables"]})
    print(json.dumps({"artifact": str(path), "version": version, "tables": len(m["tables"]), "widths": widths,
                      "table_bytes": tb["total"], "fp32_table_bytes": tb["fp32"], "ratio": round(tb["ratio"], 4)}))


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="write a trained checkpoint as a serving artifact (dense program, quantized "
                                      "tables, feature transforms, checksummed manifest)")
    e.add_argument("--checkpoint", required=True,
                   help="checkpoint (ckpt_<step>.pt, ckpt_<step>/, a torchrun run's step_<step>/) or run directory")
    e.add_argument("--out", required=True, help="a new artifact directory, or an existing versions directory "
                                                "(the artifact becomes OUT/<newest version + 1>)")
    e.add_argument("--tables", default="fp32", metavar="WIDTH",
                   help="width of every table: fp32 (default), fp16, int8 or int4 (row-wise scale and bias)")
    e.add_argument("--table", action="append", default=[], metavar="NAME=WIDTH",
                   help="width of one table (repeatable), e.g. --table C3=int4")
    e.add_argument("--data", help="the prepared training data (default: the run's data.train)")
    e.set_defaults(func=_cmd_export)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Every serving command: ``export`` here; ``serve`` (``add_serve_parser``) is added beside it."""
    add_export_parser(sub)
