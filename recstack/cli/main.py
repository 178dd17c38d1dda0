"""The one command line: ``recstack train | eval | predict | data prepare | data synth | data inspect | plan |
analyze-a2a | exfm``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recstack import __version__
from recstack.cli import train as train_cmd
from recstack.cli.data import add_inspect_parser, add_schema_prepare_arguments
from recstack.errors import ConfigError, RecstackError

if TYPE_CHECKING:
    import torch


def _device(name: str) -> torch.device:
    """``--device`` of eval and predict: auto | cpu | cuda | cuda:N (a CUDA device must exist here)."""
    from recstack.config import check_device_name
    from recstack.training.trainer import resolve_device

    check_device_name(name, check_available=True, field="--device")
    return resolve_device(name)


def _cmd_eval(args: argparse.Namespace) -> None:
    from recstack.data.format import PreparedDataset
    from recstack.training.inference import evaluate, evaluation_rows, load_model

    cfg, model = load_model(args.checkpoint, _device(args.device))
    if args.data:
        data = PreparedDataset(args.data)
        rows, what = (0, len(data)), f"{data.path}: all {len(data)} rows (--data)"
    else:  # the rows the run evaluated on, never the ones it trained on
        data, rows, what = evaluation_rows(cfg, args.checkpoint)
    print(f"evaluating {what}", file=sys.stderr)
    result = evaluate(cfg, model, data, args.batch_size, rows)
    # An undefined metric (AUC of a one-class or empty set) is null: JSON has no NaN.
    result = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in result.items()}
    print(json.dumps({**result, "data": str(data.path), "rows": list(rows)}, indent=2, allow_nan=False))


def _cmd_predict(args: argparse.Namespace) -> None:
    import numpy as np

    from recstack.data.format import PreparedDataset
    from recstack.training.inference import load_model, predict_logits

    out = Path(args.out)
    if out.suffix not in (".npy", ".csv"):
        raise ValueError(f"--out {out}: expected a .npy or .csv file name")
    if out.exists() and not args.overwrite:  # checked before the (long) scoring
        raise FileExistsError(f"--out {out} exists (pass --overwrite to replace it)")
    cfg, model = load_model(args.checkpoint, _device(args.device))
    logits, labels = predict_logits(cfg, model, PreparedDataset(args.data), args.batch_size)
    prob = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed over it: an interrupted run leaves no file with rows missing.
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        if out.suffix == ".npy":
            np.save(f, prob.astype(np.float32))
        else:  # CSV: row, score, label
            f.write(b"row,score,label\n")
            f.writelines(f"{i},{p:.7g},{int(y)}\n".encode() for i, (p, y) in enumerate(zip(prob, labels, strict=True)))
    os.replace(tmp, out)
    print(f"wrote {len(prob)} scores to {out}")


def _cmd_prepare(args: argparse.Namespace) -> None:
    if args.schema or args.valid or args.test or args.stats_from:  # schema-driven input (any format)
        from recstack.cli.data import run_schema_prepare

        if args.sub_sample_rate:
            raise SystemExit("data prepare: --sub-sample-rate applies to Criteo raw files, not to --schema input")
        run_schema_prepare(args)
        return
    from recstack.data.prepare.criteo_prepare import prepare_criteo, sort_day_files

    inputs: list[Path] = []
    for name in args.inputs:
        p = Path(name)
        inputs.extend(sort_day_files([q for q in p.iterdir() if q.is_file()]) if p.is_dir() else [p])
    report = prepare_criteo(
        inputs, Path(args.out), max_ind_range=args.max_ind_range, vocab_min_freq=args.vocab_min_freq,
        skip_bad_rows=args.skip_bad_rows, overwrite=args.overwrite, sub_sample_rate=args.sub_sample_rate,
        sub_sample_seed=args.sub_sample_seed,
    )
    print(f"prepared {report.rows} rows into {args.out} ({report.rows_per_sec:,.0f} rows/s)")
    if report.dropped_negatives:
        print(f"dropped {report.dropped_negatives} negative rows (--sub-sample-rate {args.sub_sample_rate:g})")
    if report.skipped:
        print(f"skipped {report.skipped} bad rows, first ones:")
        for where in report.bad_rows[:20]:
            print(f"  {where}")


def _cmd_synth(args: argparse.Namespace) -> None:
    from recstack.config import synth_config
    from recstack.data.synth.generate import generate
    from recstack.typed_toml import parse_override

    values: dict = {"rows": args.rows, "seed": args.seed}
    for text in args.overrides:
        keys, value = parse_override(text)
        if len(keys) != 1:
            raise ConfigError(f"--set {text}: expected KEY=VALUE with a generator option (see SynthConfig) as KEY")
        values[keys[0]] = value
    cfg = synth_config(values)
    out = generate(cfg, Path(args.out), overwrite=args.overwrite)
    print(f"wrote {cfg.rows} synthetic rows to {out}")


def _cmd_train(args: argparse.Namespace) -> None:
    if args.dump_a2a:  # the capture settings live in [compression]; the flags are shorthands for them
        try:
            steps = [int(v) for v in args.dump_steps.split(",") if v.strip()]
        except ValueError as e:
            raise ConfigError(f"--dump-steps {args.dump_steps!r}: expected comma-separated step numbers") from e
        args.overrides += [f"compression.dump_dir={json.dumps(args.dump_a2a)}", f"compression.dump_steps={steps}"]
    train_cmd.run(args)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recstack", description=__doc__)
    p.add_argument("--version", action="version", version=f"recstack {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model from a TOML config")
    train_cmd.add_arguments(t)
    t.add_argument("--dump-a2a", metavar="DIR", help="save the pooled embeddings and gradients the all-to-all "
                   "carries, per table, at --dump-steps (for recstack analyze-a2a)")
    t.add_argument("--dump-steps", default="1", metavar="S1,S2", help="steps to capture (default 1)")
    t.set_defaults(func=_cmd_train)

    for name, func in (("eval", _cmd_eval), ("predict", _cmd_predict)):
        e = sub.add_parser(name, help=f"{name} with a trained checkpoint")
        e.add_argument("--checkpoint", required=True,
                       help="checkpoint (ckpt_<step>.pt, or a torchrun run's step_<step>/) or run directory")
        e.add_argument("--data", required=name == "predict",
                       help="prepared data directory" + ("" if name == "predict" else " (default: the rows the "
                             "run evaluated on: data.eval, else the held-out tail of its training set)"))
        e.add_argument("--batch-size", type=_positive_int, default=16384)
        e.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N or auto "
                                                       "(a GPU when there is one)")
        if name == "predict":
            e.add_argument("--out", required=True, help="scores file: .npy (probabilities) or .csv")
            e.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        e.set_defaults(func=func)

    data = sub.add_parser("data", help="prepare or generate data sets").add_subparsers(dest="data_command",
                                                                                      required=True)
    pr = data.add_parser("prepare", help="Criteo raw TSV (plain or .gz), or with --schema Parquet, CSV/TSV or "
                                         "libFM -> prepared format")
    pr.add_argument("inputs", nargs="+", help="raw files or directories of day files, in time order")
    pr.add_argument("--out", required=True)
    pr.add_argument("--max-ind-range", type=int, help="hash categorical values into this many rows")
    pr.add_argument("--vocab-min-freq", type=int, help="vocabulary of values seen at least this often")
    pr.add_argument("--skip-bad-rows", action="store_true", help="skip malformed rows and report them")
    pr.add_argument("--sub-sample-rate", type=float, default=0.0, metavar="R",
                    help="drop each negative row with probability R (the DLRM reference's Terabyte training days: "
                         "0.875)")
    pr.add_argument("--sub-sample-seed", type=int, default=0, metavar="S",
                    help="seed of the --sub-sample-rate draws (default 0)")
    pr.add_argument("--overwrite", action="store_true")
    add_schema_prepare_arguments(pr)
    pr.set_defaults(func=_cmd_prepare)
    add_inspect_parser(data)

    sy = data.add_parser("synth", help="generate a synthetic Criteo-shaped click log")
    sy.add_argument("--out", required=True)
    sy.add_argument("--rows", type=int, default=100_000)
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a generator option (see SynthConfig), e.g. --set drift=0.5")
    sy.add_argument("--overwrite", action="store_true")
    sy.set_defaults(func=_cmd_synth)

    from recstack.cli import plan as plan_cmd
    pl = sub.add_parser("plan", help="shard embedding tables over ranks (load-balancing planner)")
    plan_cmd.add_arguments(pl)
    pl.set_defaults(func=plan_cmd.run)

    from recstack.compression.analysis import analyze as analyze_cmd
    an = sub.add_parser("analyze-a2a", help="value range, distinct rows, entropy and codec ratios of captured "
                                            "all-to-all payloads (or raw float32 files)")
    analyze_cmd.add_arguments(an)
    an.set_defaults(func=analyze_cmd.run)

    from recstack.cli import exfm as exfm_cmd
    exfm_cmd.add_parser(sub)
    from recstack.cli import serving as serving_cmd
    serving_cmd.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except RecstackError as e:  # bad input (2) or a failed peer (3): a message, not a traceback
        print(f"recstack {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"recstack {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
