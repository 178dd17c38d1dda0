"""One rank of ``bench/dist_throughput.py``: builds the models, then times interleaved windows.

Every rank runs the same sequence (model construction, windows, byte passes all issue collectives), so the
case list and the steps per window are decided once (rank 0, broadcast) and followed by all.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.train_throughput import kaggle_config
from recstack.config import Config
from recstack.data.batch import Batch
from recstack.data.format import capped_table_sizes
from recstack.data.loader import BatchLoader, LoaderPosition
from recstack.data.prepared_dataset import PreparedDataset
from recstack.training.trainer import Trainer

CODECS = ("fp32", "fp16", "bf16", "fp8", "int8")
SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


@dataclass(frozen=True)
class Case:
    """One timed configuration. ``model``: d16 (Kaggle reference) or d64 (same tables, Terabyte MLPs)."""

    impl: str  # recstack | torchrec
    model: str
    sharding: str
    codec: str  # both directions
    pipeline: bool

    @property
    def name(self) -> str:
        tail = " pipelined" if self.pipeline else ""
        return f"{self.impl} {self.model} {self.sharding} {self.codec}{tail}"

    def model_key(self) -> tuple:
        """Cases with the same key share one model: recstack switches codec and pipelining per window;
        TorchRec fixes its comms precision at sharding time and rewrites the model for its pipeline."""
        if self.impl == "recstack":
            return ("recstack", self.model, self.sharding)
        return ("torchrec", self.model, self.sharding, self.codec, self.pipeline)


def recstack_config(spec: dict[str, Any], model: str, sharding: str, plan: str) -> Config:
    cfg = kaggle_config()
    if model == "d64":  # Terabyte MLPs
        cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 64, [512, 256, 64], [512, 512, 256, 1]
    cfg.model.max_table_size = spec["max_rows"]
    cfg.data.train, cfg.data.eval_fraction = spec["data"], 0.0
    cfg.train.batch_size, cfg.train.threads, cfg.train.progress = spec["batch"], 1, False
    cfg.train.log_every = 10**9
    cfg.dist.sharding, cfg.dist.plan, cfg.dist.timeout_s = sharding, plan, 600.0
    if hasattr(cfg.dist, "pipeline"):
        cfg.dist.pipeline = True  # the trainer installs its routing transform; windows turn it on or off
    return cfg


def dp_plan(path: Path, sizes: list[int], names: list[str], max_rows: int, world: int) -> str:
    """data_parallel for the tables of at most ``max_rows`` rows, table-wise round-robin for the others."""
    tables, big = [], 0
    for name, rows in zip(names, sizes, strict=True):
        if rows <= max_rows:
            tables.append({"name": name, "sharding": "data_parallel", "ranks": list(range(world))})
        else:
            tables.append({"name": name, "sharding": "table_wise", "ranks": [big % world]})
            big += 1
    # Every rank writes the same plan to the same path (the ranks must name the same plan: the trainer checks that
    # they agree), each through its own temporary file and an atomic rename, so none reads a half-written one.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"world_size": world, "tables": tables}))
    os.replace(tmp, path)
    return str(path)


class RecstackModel:
    """A Trainer built under the distributed launch; a step is ``Trainer.train_step``."""

    def __init__(self, cfg: Config) -> None:
        self.trainer = Trainer(cfg)
        self.emb = self.trainer.model.embeddings
        self.route = self.trainer.train_loader.transform  # the pipelined input distribution, if any

    def loader(self, start: int, n: int, transform: Any = None) -> BatchLoader:
        """The trainer's loader, limited to ``n`` global batches from global batch ``start``, so that every
        rank's prefetch thread routes exactly as many batches as the window consumes."""
        ld = copy.copy(self.trainer.train_loader)
        gb = ld.global_batch_size
        ld.start, ld.end, ld.position, ld.transform = start * gb, (start + n) * gb, LoaderPosition(), transform
        return ld

    def steps(self, case: Case, start: int, n: int) -> Iterator[float]:
        if case.pipeline and self.route is None:
            raise RuntimeError("the trainer installed no pipelined input distribution")
        self.emb.forward_codec = self.emb.backward_codec = case.codec
        batches = self.loader(start, n, self.route if case.pipeline else None).iterate_epoch()
        if case.pipeline:  # the loader's thread prepares each batch's ids, the training thread distributes them
            batches = self.trainer.input_pipeline.batches(batches)
        for batch in batches:
            yield self.trainer.train_step(batch)

    def pop_stats(self) -> dict[str, float]:
        return self.emb.stats.pop()


class TorchRecModel:
    """TorchRec's DLRM on the same data, read through the table-wise recstack trainer's loader (no transform).
    Non-pipelined windows call its step per batch; the pipelined case drives ``TrainPipelineSparseDist``."""

    def __init__(self, spec: dict[str, Any], case: Case, template: RecstackModel) -> None:
        from bench.torchrec_dlrm import TorchRecDLRM

        ds = template.trainer.train_ds
        cfg = template.trainer.cfg.model
        self.template = template
        self.data_batches = spec["data_batches"]
        self.model = TorchRecDLRM(
            capped_table_sizes(ds.table_sizes, spec["max_rows"]), ds.table_names, cfg.embedding_dim,
            len(ds.dense_features), cfg.bottom_mlp, cfg.top_mlp, spec["batch"], template.trainer.cfg.optim.sparse_lr,
            case.sharding, case.codec,
        )
        self._pipe: Iterator[float] | None = None

    def _endless(self) -> Iterator[Batch]:
        while True:
            yield from self.template.loader(0, self.data_batches).iterate_epoch()

    def steps(self, case: Case, start: int, n: int) -> Iterator[float]:
        if not case.pipeline:
            for batch in self.template.loader(start, n).iterate_epoch():
                yield self.model.step(batch)
            return
        if self._pipe is None:  # TorchRec's pipeline keeps batches in flight across windows
            self._pipe = self.model.pipelined(self._endless())
        for _ in range(n):
            yield next(self._pipe)

    def pop_stats(self) -> dict[str, float]:
        return {}


class Bench:
    def __init__(self, rank: int, world: int, spec: dict[str, Any]) -> None:
        self.rank, self.world, self.spec = rank, world, spec
        self.cases = [Case(**c) for c in spec["cases"]]
        self.cursor = 0  # next global batch of the data set
        self.models: dict[tuple, Any] = {}
        self.build_s: dict[str, float] = {}

    def build(self, tmp: Path) -> None:
        ds = PreparedDataset(self.spec["data"])
        sizes = capped_table_sizes(ds.table_sizes, self.spec["max_rows"])
        for case in self.cases:  # same order on every rank: constructors run collectives
            key = case.model_key()
            if key in self.models:
                continue
            t0 = time.perf_counter()
            if case.impl == "recstack":
                plan = ""
                if case.sharding == "data_parallel":
                    plan = dp_plan(tmp / "dp_plan.json", sizes, ds.table_names,
                                   self.spec["dp_max_rows"], self.world)
                sharding = "table_wise" if case.sharding == "data_parallel" else case.sharding
                self.models[key] = RecstackModel(recstack_config(self.spec, case.model, sharding, plan))
            else:
                self.models[key] = TorchRecModel(self.spec, case, self.models[("recstack", case.model, "table_wise")])
            self.build_s[" ".join(map(str, key))] = round(time.perf_counter() - t0, 2)

    def window(self, case: Case, n: int, warmup: int) -> tuple[float, float, dict[str, float]]:
        """-> (wall seconds per step over ``n`` timed steps after ``warmup`` untimed ones, this process's CPU
        seconds per step (all its threads: compute, prefetch, gloo), this rank's stats per step)."""
        model = self.models[case.model_key()]
        total = warmup + n
        if self.cursor + total > self.spec["data_batches"]:
            self.cursor = 0
        it = model.steps(case, self.cursor, total)
        self.cursor += total
        for _ in range(warmup):
            next(it)
        model.pop_stats()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            next(it)
        dist.barrier()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        for _ in it:  # the loader is exhausted: lets its prefetch thread finish
            pass
        stats = model.pop_stats()
        return dt / n, cpu / n, {k: v / n for k, v in stats.items()}

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def byte_pass(self) -> dict[str, Any]:
        """Exact bytes sent per step, per rank, for every recstack model and codec (2 steps, same batches)."""
        out: dict[str, Any] = {}
        for key, model in self.models.items():
            if key[0] != "recstack":
                continue
            for codec in CODECS:
                case = Case("recstack", key[1], key[2], codec, False)
                model.pop_stats()
                for _ in model.steps(case, 0, 2):
                    pass
                stats = {k: v / 2 for k, v in model.pop_stats().items() if k.startswith("bytes_")}
                out[f"{key[1]} {key[2]} {codec}"] = self.gather(stats)
        return out

    def run(self, tmp: Path) -> dict[str, Any]:
        spec, warmup = self.spec, self.spec["warmup"]
        self.build(tmp)
        bytes_sent = self.byte_pass()
        steps: list[int] = []
        for case in self.cases:  # warm-up, then size each case's window to about window_s
            self.window(case, 2, warmup)
            est, _, _ = self.window(case, 3, 0)
            steps.append(max(3, min(spec["data_batches"] - warmup, round(spec["window_s"] / est))))
        box = [steps]
        dist.broadcast_object_list(box, src=0)  # rank 0's sizes, so every rank runs the same steps
        steps = box[0]
        rounds: dict[str, list[float]] = {c.name: [] for c in self.cases}
        cpu: dict[str, list[float]] = {c.name: [] for c in self.cases}
        breakdown: dict[str, list[dict[str, float]]] = {c.name: [] for c in self.cases}
        k = len(self.cases)
        for r in range(spec["rounds"]):
            for i in [(r + j) % k for j in range(k)]:  # rotated order
                case = self.cases[i]
                step_s, cpu_s, stats = self.window(case, steps[i], warmup)
                rounds[case.name].append(step_s)
                cpu[case.name].append(cpu_s)
                breakdown[case.name].append({n: v for n, v in stats.items() if n.startswith("time_")})
        per_rank = self.gather(breakdown)
        cpu_all = self.gather(cpu)
        return {
            "build_s": self.build_s,
            "bytes": bytes_sent,
            "cases": [
                {"name": c.name, "steps_per_window": steps[i], "step_s_rounds": rounds[c.name],
                 "cpu_s_rounds": [sum(x) for x in zip(*(r[c.name] for r in cpu_all), strict=True)],
                 "time_breakdown": _mean_breakdown([b[c.name] for b in per_rank])}
                for i, c in enumerate(self.cases)
            ],
        }


def _mean_breakdown(per_rank: list[list[dict[str, float]]]) -> dict[str, float]:
    """Seconds per step in each phase, averaged over ranks and rounds."""
    sums: dict[str, float] = {}
    n = 0
    for windows in per_rank:
        for w in windows:
            n += 1
            for k, v in w.items():
                sums[k] = sums.get(k, 0.0) + v
    return {k: v / n for k, v in sorted(sums.items())} if n else {}


def worker(rank: int, world: int, spec: dict[str, Any], out: str, init_file: str) -> None:
    """Entry point of each spawned rank; rank 0 writes the results to ``out``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        result = Bench(rank, world, spec).run(Path(out).parent)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
