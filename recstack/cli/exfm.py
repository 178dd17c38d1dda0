"""``recstack exfm run | movielens``: run an ExFM experiment; convert MovieLens to a prepared stream."""

from __future__ import annotations

import argparse
from pathlib import Path

from recstack.errors import ConfigError
from recstack.typed_toml import toml_value


def add_parser(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("exfm", help="foundation model -> vertical models distillation on streaming data")
    cmds = ex.add_subparsers(dest="exfm_command", required=True)
    r = cmds.add_parser("run", help="FM + DAS + VM arms over staleness and seeds; writes results and charts")
    r.add_argument("--config", required=True, help="TOML config (configs/exfm_*.toml)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set experiment.seeds=[0] (repeatable)")
    r.add_argument("--output-dir", help="default: runs/<config file name>")
    r.add_argument("--stream", metavar="DIR", help="read the windows from a directory stream: each partition "
                   "renamed into DIR is one window (data.source = 'stream', data.stream.dir)")
    r.add_argument("--schema", metavar="SCHEMA.toml", help="the partitions' format, with --stream "
                   "(data.stream.schema; [columns] carries vertical and example_id)")
    r.add_argument("--stream-idle-s", type=float, metavar="S", help="the stream ends when no partition arrived "
                   "for S seconds (data.stream.idle_s, default 60)")
    r.set_defaults(func=run)
    m = cmds.add_parser("movielens", help="MovieLens (u.data or RecBole layout) -> prepared stream")
    m.add_argument("path", help="directory with u.data/u.item[/u.user] or <name>.inter/.item[/.user]")
    m.add_argument("--out", required=True)
    m.add_argument("--layout", default="auto", choices=("auto", "udata", "recbole"))
    m.add_argument("--overwrite", action="store_true")
    m.set_defaults(func=movielens)


def run(args: argparse.Namespace) -> dict:
    from recstack.exfm.config import load_exfm_config
    from recstack.exfm.experiment import ExperimentRunner
    from recstack.serving.publish import make_publisher

    cfg = load_exfm_config(args.config, args.overrides + stream_overrides(args))
    out = Path(args.output_dir or Path("runs") / Path(args.config).stem)
    results = ExperimentRunner(cfg, out, publisher=make_publisher).run()
    print((out / "report.md").read_text())
    print(f"results: {out / 'results.json'}; charts: {out / 'ne_gain.png'}, {out / 'ne_by_window.png'} "
          f"({results['tasks_run']} tasks run in {results['seconds']:.0f} s, {results['tasks_reused']} reused)")
    return results


def stream_overrides(args: argparse.Namespace) -> list[str]:
    """``--stream DIR --schema S --stream-idle-s N`` as the ``--set`` overrides they stand for."""
    if args.stream is None:
        if args.schema is not None or args.stream_idle_s is not None:
            raise ConfigError("--schema and --stream-idle-s: only with --stream DIR")
        return []
    out = ['data.source="stream"', f"data.stream.dir={toml_value(args.stream)}"]
    if args.schema is not None:
        out.append(f"data.stream.schema={toml_value(args.schema)}")
    if args.stream_idle_s is not None:
        out.append(f"data.stream.idle_s={toml_value(args.stream_idle_s)}")
    return out


def movielens(args: argparse.Namespace) -> None:
    from recstack.data.prepared_dataset import PreparedDataset
    from recstack.exfm.movielens import MovieLensConfig, prepare_movielens

    out = prepare_movielens(MovieLensConfig(path=args.path, layout=args.layout), Path(args.out), args.overwrite)
    info = PreparedDataset(out).info
    print(f"wrote {info['rows']} ratings from {info['ratings_file']} to {out} (verticals {info['verticals']})")
