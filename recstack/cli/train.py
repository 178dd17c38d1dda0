"""``recstack train``: parse the config, build a Trainer, train, print the summary."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from recstack.config import Config, load_config
from recstack.errors import ConfigError, RecstackError
from recstack.io import check_writable

if TYPE_CHECKING:
    from recstack.training.stream import StreamTrainer
    from recstack.training.trainer import Trainer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("--config", help="TOML config file (configs/*.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set model.embedding_dim=32 (repeatable)")
    p.add_argument("--output-dir", help="metrics.jsonl, summary.json, TensorBoard, checkpoints, curves.png")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    p.add_argument("--resume-on-new-data", action="store_true",
                   help="--resume even when the data differs from what the checkpoint trained on (another "
                        "prepared set, other [data.synth] options: generated again); without it that is an error")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an --output-dir that holds an earlier run (its checkpoints and metrics "
                        "are removed)")
    p.add_argument("--dump-a2a", metavar="DIR", help="save the pooled embeddings and gradients the all-to-all "
                   "carries, per table, at --dump-steps (for recstack analyze-a2a)")
    p.add_argument("--dump-steps", default="1", metavar="S1,S2", help="steps to capture (default 1)")
    p.add_argument("--stream", metavar="DIR", help="train on the partitions arriving in DIR, each once in name "
                   "order (hidden and temporary names are ignored until renamed), evaluating each before training "
                   "on it (docs/streaming.md); raw Criteo TSV unless --schema")
    p.add_argument("--stream-idle-s", type=float, default=60.0, metavar="S",
                   help="with --stream: stop when no new partition arrived for S seconds (default 60)")
    p.add_argument("--schema", metavar="SCHEMA.toml", help="with --stream: the partitions' format (Parquet, "
                   "CSV/TSV, libFM; hash or identity encodings)")
    p.add_argument("--publish", metavar="MODEL_ROOT", help="with --stream: export the model into MODEL_ROOT as the "
                   "next version after the first partition, then every --publish-every-s (a full artifact, then "
                   "deltas of the changed rows), and at the end; `recstack serve MODEL_ROOT --watch MODEL_ROOT` "
                   "follows it (docs/streaming.md)")
    p.add_argument("--publish-every-s", type=float, default=60.0, metavar="T",
                   help="with --publish: seconds between published versions (default 60; 0: every partition)")
    p.set_defaults(func=run)


def _config(args: argparse.Namespace) -> Config:
    """The config of ``recstack train ARGS`` (file, --set, --dump-a2a); --output-dir checked."""
    if args.dump_a2a:  # the capture settings live in [compression]; the flags are shorthands for them
        try:
            steps = [int(v) for v in args.dump_steps.split(",") if v.strip()]
        except ValueError as e:
            raise ConfigError(f"--dump-steps {args.dump_steps!r}: expected comma-separated step numbers") from e
        args.overrides += [f"compression.dump_dir={json.dumps(args.dump_a2a)}", f"compression.dump_steps={steps}"]
    cfg = load_config(args.config, args.overrides)
    if args.output_dir:  # a read-only or full place for the run fails now, not at its first checkpoint
        check_writable(args.output_dir, directory=True, inside=True)
    return cfg


def run(args: argparse.Namespace) -> dict:
    from recstack.training.evaluate import figures as _figures
    from recstack.training.trainer import Trainer

    if args.stream and not args.schema and not args.config:
        # A raw Criteo stream without a config: every table keyed by the raw ids it carries (dynamic ids, as many
        # rows as the hashed default would have); --set model.dynamic_ids.enabled=false hashes them instead.
        from recstack.data.stream.partition import DEFAULT_TABLE_ROWS
        args.overrides = ["model.dynamic_ids.enabled=true", f"model.dynamic_ids.capacity={DEFAULT_TABLE_ROWS}",
                          *args.overrides]
    try:
        cfg = _config(args)
    except RecstackError as e:  # a rank of a job: the others stop with this, not at a timeout
        from recstack.distributed.startup import report_startup_failure
        report_startup_failure(e)
        raise
    if not args.output_dir and cfg.train.checkpoint_every and os.environ.get("RANK", "0") == "0":
        # Not an error: a config written for real runs (configs/demo.toml) is also tried without
        # an output directory. But the user asked for checkpoints, and none will be written: say so
        # before the work.
        every = cfg.train.checkpoint_every
        print(f"recstack train: warning: train.checkpoint_every={every} but no "
              "--output-dir: no checkpoint (nor metrics.jsonl or summary.json) is saved; pass "
              "--output-dir DIR to keep them", file=sys.stderr)
    if args.stream:
        trainer: Trainer = _stream_trainer(args, cfg)
    else:
        if args.publish:
            raise ConfigError("--publish: only with --stream (a finished run is exported with recstack export)")
        if args.schema:
            raise ConfigError("--schema: only with --stream (a fixed set is prepared first: recstack data prepare "
                              "--schema)")
        trainer = Trainer(cfg, args.output_dir, resume=args.resume, overwrite=args.overwrite,
                          resume_on_new_data=args.resume_on_new_data)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if not trainer.is_main:
        return summary
    print(json.dumps(summary, indent=2))
    if args.stream:
        print(f"stream: {summary['partitions']} partitions, progressive {_figures(_progressive(summary))}")
        return summary
    if summary.get("auc") is None:  # no evaluation rows
        print("final eval: none (no evaluation rows)")
        return summary
    line = f"final eval: {_figures(summary)}"
    if "oracle_auc" in summary:
        line += f"  (generator's oracle AUC {summary['oracle_auc']:.4f})"
    print(line)
    if summary.get("best_step") is not None:  # train.early_stopping: the checkpoint eval/predict use
        print(f"best eval: step {summary['best_step']}  {_figures(summary['best'])}")
    return summary


def _stream_trainer(args: argparse.Namespace, cfg: Config) -> StreamTrainer:
    """The trainer of ``--stream``; a partition hook (a publisher) is added here with ``trainer.add_hook``."""
    from recstack.data.stream import DirectoryStream, partition_reader
    from recstack.training.stream import StreamTrainer

    if args.resume_on_new_data:
        raise ConfigError("--resume-on-new-data: not for a stream (--resume continues after the last partition)")
    source = DirectoryStream(args.stream, args.stream_idle_s)
    source.check()  # a missing directory: an error now, not after the model is built
    reader = partition_reader(args.schema, cfg.model.max_table_size)
    if args.publish and not args.publish_every_s >= 0:
        raise ConfigError(f"--publish-every-s: must be >= 0, got {args.publish_every_s:g}")
    trainer = StreamTrainer(cfg, source, reader, args.output_dir, resume=args.resume, overwrite=args.overwrite)
    if args.publish:
        from recstack.serving.publish import Publisher
        trainer.add_hook(Publisher(args.publish, args.publish_every_s))
    return trainer


def _progressive(summary: dict) -> dict:
    return {k: summary.get(f"progressive_{k}") for k in ("auc", "logloss", "ne")}
