"""``recstack data prepare | inspect | synth``: raw files to the prepared format, statistics of raw or prepared
data, synthetic click logs."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from recstack.data.prepare.schema import FORMATS
from recstack.errors import ConfigError
from recstack.io import atomic_write_text, check_writable


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    _add_schema_prepare_arguments(pr)
    pr.set_defaults(func=run_prepare)
    _add_inspect_parser(data)

    sy = data.add_parser("synth", help="generate a synthetic Criteo-shaped click log")
    sy.add_argument("--out", required=True)
    sy.add_argument("--rows", type=int, default=100_000)
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a generator option (see SynthConfig), e.g. --set drift=0.5")
    sy.add_argument("--overwrite", action="store_true")
    sy.set_defaults(func=run_synth)


def _check_out(out: Path, overwrite: bool) -> None:
    """Before the work: ``--out`` is a directory to be (re)placed, in a place that takes new files."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} already exists (pass --overwrite to replace it)")
    check_writable(out, directory=True)


def run_prepare(args: argparse.Namespace) -> None:
    _check_out(Path(args.out), args.overwrite)
    if args.schema or args.valid or args.test or args.stats_from:  # schema-driven input (any format)
        if args.sub_sample_rate:
            raise SystemExit("data prepare: --sub-sample-rate applies to Criteo raw files, not to --schema input")
        _run_schema_prepare(args)
        return
    from recstack.data.prepare.criteo_prepare import prepare_criteo, sort_day_files
    from recstack.data.prepare.readers.base import is_data_file

    inputs: list[Path] = []
    for name in args.inputs:
        p = Path(name)
        inputs.extend(sort_day_files([q for q in p.iterdir() if is_data_file(q)]) if p.is_dir() else [p])
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


def run_synth(args: argparse.Namespace) -> None:
    from recstack.data.config import synth_config
    from recstack.data.synth.generate import generate
    from recstack.typed_toml import parse_override

    values: dict = {"rows": args.rows, "seed": args.seed}
    for text in args.overrides:
        keys, value = parse_override(text)
        if len(keys) != 1:
            raise ConfigError(f"--set {text}: expected KEY=VALUE with a generator option (see SynthConfig) as KEY")
        values[keys[0]] = value
    cfg = synth_config(values)
    _check_out(Path(args.out), args.overwrite)
    out = generate(cfg, Path(args.out), overwrite=args.overwrite)
    print(f"wrote {cfg.rows} synthetic rows to {out}")


def _add_schema_prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schema", help="TOML schema (configs/schemas/*.toml): read Parquet, CSV/TSV or libFM input "
                                    "with it instead of Criteo's fixed layout")
    p.add_argument("--valid", nargs="+", action="extend", default=[], metavar="FILE",
                   help="with --schema: files of the validation split (written to OUT/valid)")
    p.add_argument("--test", nargs="+", action="extend", default=[], metavar="FILE",
                   help="with --schema: files of the test split (written to OUT/test)")
    p.add_argument("--stats-from", metavar="DIR",
                   help="with --schema: reuse the vocabularies and dense statistics of an earlier prepared "
                        "training directory instead of computing them")
    p.add_argument("--chunk-rows", type=int, default=65536,
                   help="with --schema: rows read and encoded at a time (bounds memory)")
    p.add_argument("--no-progress", action="store_true", help="with --schema: no progress bar")


def _run_schema_prepare(args: argparse.Namespace) -> None:
    from recstack.data.prepare.schema import load_schema
    from recstack.data.prepare.schema_prepare import prepare_dataset

    if not args.schema:
        raise ValueError("--valid, --test and --stats-from need --schema")
    if args.max_ind_range is not None or args.vocab_min_freq is not None:
        raise ValueError("--max-ind-range and --vocab-min-freq are Criteo options; with --schema, set hash_size "
                         "or min_freq per feature in the schema")
    report = prepare_dataset(
        load_schema(args.schema), args.inputs, args.out, valid_inputs=args.valid, test_inputs=args.test,
        stats_from=args.stats_from, skip_bad_rows=args.skip_bad_rows, overwrite=args.overwrite,
        chunk_rows=args.chunk_rows, progress=not args.no_progress,
    )
    for split, path in report.outputs.items():
        print(f"{split}: {report.rows[split]:,} rows -> {path}")
    print(f"prepared {report.total_rows:,} rows in {report.seconds:.1f}s ({report.rows_per_sec:,.0f} rows/s)")
    print("tables: " + ", ".join(f"{t} {n:,} rows" for t, n in report.tables.items()))
    if report.skipped:
        print(f"skipped {report.skipped} bad rows, first ones:")
        for bad in report.bad_rows[:20]:
            print(f"  {bad}")


def _add_inspect_parser(data: argparse._SubParsersAction) -> None:
    p = data.add_parser("inspect", help="statistics of a raw file (Parquet, CSV/TSV, libFM) or a prepared directory")
    p.add_argument("paths", nargs="+", metavar="FILE|DIR", help="raw files, a directory of Parquet parts, or a "
                                                                 "prepared directory")
    p.add_argument("--schema", help="read the file as this schema describes it ([source], [label])")
    p.add_argument("--format", choices=FORMATS, help="the input format when the file name does not tell it "
                                                     "(e.g. a libFM file named .txt); overrides the schema's")
    p.add_argument("--label", help="the label column (default: a column named like label, click, target, ...)")
    p.add_argument("--rows", type=int, default=0, help="look at the first N rows only (default: all)")
    p.add_argument("--infer-schema", metavar="OUT", help="write a schema inferred from the statistics to OUT "
                                                         "('-' prints it), for editing")
    p.add_argument("--max-table-size", type=int, default=0, help="prepared data: the model.max_table_size cap")
    p.add_argument("--embedding-dim", type=int, default=16, help="prepared data: for the table memory column")
    p.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> None:
    from recstack.cli.recipes import recipe_for_prepared, recipe_for_schema, recipe_line
    from recstack.data.prepare.infer import infer_schema
    from recstack.data.prepare.inspect import format_file_report, format_prepared_report, inspect_file, inspect_prepared
    from recstack.data.prepare.schema import LabelSpec, SourceSpec, load_schema, schema_to_toml

    first = Path(args.paths[0])
    if (first / "meta.json").is_file():
        if args.infer_schema:
            raise ValueError(f"{first} is prepared data: --infer-schema reads raw files")
        prepared = inspect_prepared(first, args.max_table_size, args.embedding_dim)
        print(format_prepared_report(prepared))
        print(recipe_line(recipe_for_prepared(prepared)))
        return
    if args.infer_schema and args.infer_schema != "-":  # unwritable: fail now, not after the work
        check_writable(args.infer_schema, directory=False)
    schema = load_schema(args.schema) if args.schema else None
    label = schema.label if schema else (LabelSpec(column=args.label) if args.label else None)
    source = schema.source if schema else SourceSpec()
    if args.format:
        source = dataclasses.replace(source, format=args.format)
    report = inspect_file(args.paths, source, label, args.rows)
    if args.infer_schema != "-":
        print(format_file_report(report))
        if schema is not None or report.label is not None:  # a layout to suggest a recipe for
            rows = None if args.rows and report.rows >= args.rows else report.rows  # None: only the first rows
            print(recipe_line(recipe_for_schema(schema or infer_schema(report, args.label)[0], rows)))
    if args.infer_schema:
        inferred, comments = infer_schema(report, args.label)
        header = (f"# Inferred by `recstack data inspect` from {', '.join(map(str, report.paths[:3]))}"
                  f" ({report.rows:,} rows). Check every choice before preparing.\n\n")
        text = header + schema_to_toml(inferred, comments)
        if args.infer_schema == "-":
            sys.stdout.write(text)
        else:
            atomic_write_text(args.infer_schema, text)
            print(f"\nwrote the inferred schema to {args.infer_schema}")
