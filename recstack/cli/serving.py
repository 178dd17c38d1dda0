"""``recstack export`` (a checkpoint -> a serving artifact) and ``recstack serve`` (an HTTP scoring server)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recstack.cli.args import positive_int, thread_count
from recstack.errors import ConfigError
from recstack.io import check_writable


def _cmd_export(args: argparse.Namespace) -> None:
    from recstack.serving.artifact import read_manifest
    from recstack.serving.export import export_checkpoint

    check_writable(args.out, directory=True, inside=True)  # before reading and quantizing the tables
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Every serving command: ``export`` here; ``serve`` (``add_serve_parser``) is added beside it."""
    add_export_parser(sub)
    add_serve_parser(sub)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """``recstack serve MODEL_DIR``: the HTTP scoring service (``recstack.serving.server``)."""
    s = sub.add_parser("serve", help="score requests over HTTP (POST /v1/score) with a model from recstack export")
    s.add_argument("model_dir", metavar="MODEL_DIR",
                   help="an artifact of recstack export, or a versions directory (its newest version is served)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--workers", type=positive_int, default=1,
                   help="server processes sharing the port and the loaded model (forked after loading; "
                        "default 1)")
    s.add_argument("--threads", type=thread_count, default=1,
                   help="torch threads per worker (default 1: small batches gain nothing from more, and the "
                        "event loop needs a core; scale with --workers)")
    s.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda or cuda:N")
    s.add_argument("--max-batch", type=positive_int, default=2048, help="rows per model call at most (default 2048)")
    s.add_argument("--max-wait-us", type=int, default=0,
                   help="how long a batch may wait for requests already received but still being read, "
                        "microseconds (default 0: never; a request alone is scored at once in any case)")
    s.add_argument("--max-rows", type=positive_int, help="rows (or candidates) per request at most "
                                                        "(default --max-batch)")
    s.add_argument("--max-body-bytes", type=positive_int, default=4 << 20,
                   help="request body size limit; larger ones get 413 (default 4 MiB)")
    s.add_argument("--watch", metavar="DIR", help="versions directory to poll for newer exported versions "
                                                  "(hot swap)")
    s.add_argument("--watch-interval", type=float, default=1.0, metavar="S", help="poll every S seconds (default 1)")
    s.add_argument("--model-name", default="recstack",
                   help="the model's name in the Open Inference Protocol routes, /v2/models/NAME (default recstack)")
    s.add_argument("--body-timeout", type=float, default=10.0, metavar="S",
                   help="a request body that has not fully arrived after S seconds gets 408 (default 10)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM / SIGINT: not ready, keep answering until nothing is in flight, at most S "
                        "seconds (default 30)")
    s.add_argument("--compile", choices=["aoti", "none"], default="aoti",
                   help="aoti (default): compile each served version's dense program with AOTInductor in a child "
                        "process and switch to it once checked against the graph (faster small batches; needs a "
                        "C++ compiler, else the graph serves); none: always run the exported graph")
    s.add_argument("--compile-cache", metavar="DIR", default="",
                   help="where compiled programs are kept (default ~/.cache/recstack/compiled)")
    s.set_defaults(func=run_serve)



def run_serve(args: argparse.Namespace) -> None:
    """``recstack serve``: check the flags, load (and verify) the model to serve, run until SIGTERM / SIGINT."""
    from recstack.serving.artifact import MANIFEST, ArtifactError, list_versions
    from recstack.serving.compile import CompileSpec
    from recstack.serving.model import ServingModel
    from recstack.serving.server import ServeOptions, serve
    from recstack.serving.watch import load_newest
    from recstack.training.config import check_device_name

    check_device_name(args.device, check_available=True, field="--device")
    if args.max_wait_us < 0:
        raise ConfigError(f"--max-wait-us {args.max_wait_us}: must be >= 0")
    for flag, value in (("--body-timeout", args.body_timeout), ("--drain-timeout", args.drain_timeout),
                        ("--watch-interval", args.watch_interval)):
        if not value > 0:
            raise ConfigError(f"{flag} {value}: must be > 0")
    root = Path(args.model_dir)
    model = None
    if (root / MANIFEST).is_file():
        model_dir = root
    elif versions := list_versions(root):  # the newest version, a delta applied on the versions it needs
        model_dir, model = root / str(versions[-1]), load_newest(root, args.device)
    elif args.watch:  # nothing yet: not ready until the watcher finds a version
        model_dir = None
    else:
        raise ArtifactError(f"{root}: no serving artifact (no {MANIFEST}, no <version>/ with one)")
    # Loaded (and verified) here first, so that a broken artifact stops the command with its message.
    if model_dir is not None and model is None:
        model = ServingModel.load(model_dir, args.device)
    opts = ServeOptions(
        model_dir=str(model_dir or ""), device=args.device, max_batch=args.max_batch, max_wait_us=args.max_wait_us,
        max_rows=args.max_rows or args.max_batch, max_body_bytes=args.max_body_bytes, watch=args.watch,
        watch_interval_s=args.watch_interval, threads=args.threads, body_timeout_s=args.body_timeout,
        drain_timeout_s=args.drain_timeout, model_name=args.model_name,
        compile=CompileSpec(args.compile, args.compile_cache),
    )
    code = serve(opts, model, args.host, args.port, args.workers)  # --workers N: forked with the model loaded
    if code:
        raise SystemExit(code)
