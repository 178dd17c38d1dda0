"""Turn a single-device DLRM into a hybrid-parallel one: sharded embeddings + DDP for the dense part."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from recstack.compression.base import Codec
from recstack.distributed.comm import CommStats
from recstack.distributed.config import DistConfig
from recstack.distributed.planner.inputs import PlanError, Topology
from recstack.distributed.planner.plan import PlanPlacements, ShardingPlan
from recstack.distributed.sharded_collection import LocalCollection, ShardedEmbeddingCollection, fused_local
from recstack.distributed.startup import job_store, join_job
from recstack.distributed.tiered_shards import row_bytes, tiered_local
from recstack.embedding.collection import TableConfig
from recstack.embedding.tiered.collection import TablePlacement
from recstack.embedding.tiered.config import MemoryConfig
from recstack.embedding.tiered.placement import memory_budgets_set
from recstack.errors import ConfigError
from recstack.io import read_text
from recstack.metrics import BinaryMetrics
from recstack.models.dlrm import DLRM

# What gloo and NCCL put in the errors of a collective whose peer died or timed out.
_PEER_SIGNS = ("gloo", "nccl", "connection", "peer", "timed out", "timeout", "broken pipe", "socket")


def is_peer_failure(e: BaseException) -> bool:
    """Whether an error raised during training came from a collective (a dead or silent peer) rather than from
    this rank's own computation (a bad index, a shape mismatch), which is reported as it is."""
    return isinstance(e, torch.distributed.DistError) or any(s in str(e).lower() for s in _PEER_SIGNS)


def init_distributed(d: DistConfig, device_name: str = "auto") -> tuple[int, int, torch.device]:
    """Join the job started by torchrun (env:// rendezvous) on the backend ``dist.backend`` picks
    (``choose_backend``), each rank on its device (``rank_device``: ``train.device``, a GPU of its own where
    there are enough). ``dist.timeout_s`` bounds every collective, so if a rank dies the others fail with an
    error instead of hanging (on the default group here; every group recstack makes later gets the same
    bound). NCCL enforces it with its watchdog: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (default 3) makes a rank
    whose collective timed out tear itself down, since the CPU may be blocked on the GPU stream where no Python
    error can reach it. -> (rank, world size, device)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    device = rank_device(device_name, local_rank)
    backend = choose_backend(d.backend, device, device_name, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # torch's default; 0 (no handling) would let a timed-out NCCL collective hang the rank for ever
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if not dist.is_initialized():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _ = job_store(d.timeout_s)
        join_job(store, world, d.timeout_s)  # a rank that failed before joining stops this one
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=d.timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def rank_device(device_name: str, local_rank: int) -> torch.device:
    """``train.device`` under torchrun -> this rank's device: auto = CUDA where there is one, else the CPU; a
    CUDA device without an index = GPU ``local_rank`` (modulo the GPUs here: ranks beyond them share them);
    ``cuda:N`` = that GPU for every rank."""
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return device


def choose_backend(backend: str, device: torch.device, device_name: str, local_world: int) -> str:
    """``dist.backend`` -> the backend started: auto = NCCL when every rank of this node has a GPU of its own,
    else gloo (which takes CUDA tensors too, so ranks can share a GPU: tests, the device check). NCCL refuses
    two ranks on one GPU, so asking for it then is a ConfigError naming the field."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    shared = device.type == "cuda" and local_world > 1 and (local_world > gpus or ":" in device_name)
    if backend == "auto":
        return "nccl" if device.type == "cuda" and not shared else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f'dist.backend = "nccl": needs a CUDA device, but the ranks run on {device} '
                          '(train.device, or no GPU here); use "gloo" or "auto"')
    if backend == "nccl" and shared:
        raise ConfigError(f'dist.backend = "nccl": the {local_world} ranks of this node share '
                          f'{"one GPU" if ":" in device_name else f"{gpus} GPU(s)"} and NCCL takes one GPU per '
                          'rank; use "gloo" (or "auto") to share')
    return backend


def shard_model(
    model: DLRM,
    placements: list[tuple[str, list[int]]],
    seed: int,
    device: torch.device,
    forward_codec: str | Codec = "fp32",
    backward_codec: str | Codec = "fp32",
    ranks_per_node: int | None = None,
    aggregate_gradients: bool = False,
    timeout_s: float | None = None,
    memory: MemoryConfig | None = None,
) -> DLRM:
    """Replace the model's collection (built on ``meta`` for this: ``build_model(tables_on_meta=True)``, or a
    real one, whose rows are not read) with a sharded one holding this rank's shards of the same initial rows.
    ``timeout_s``: the bound of the collection's collectives (``dist.timeout_s``). ``memory`` with budgets: each
    rank places its shards over memory tiers within them (``tiered_shards``)."""
    emb = model.embeddings
    local: LocalCollection = fused_local
    storage = plan_storage(placements, emb.tables, dist.get_rank())
    if storage is not None or (memory is not None and memory_budgets_set(memory)):
        opt = emb.optimizer.config
        dp = sum(t.num_embeddings * row_bytes(t.embedding_dim, opt)
                 for t, (kind, _) in zip(emb.tables, placements, strict=True) if kind == "data_parallel")
        local = tiered_local(memory or MemoryConfig(), dist.get_rank(), replicated_bytes=dp, storage=storage)
    model.embeddings = ShardedEmbeddingCollection(
        emb.tables, emb.optimizer.config, placements, seed, device, forward_codec, backward_codec, ranks_per_node,
        aggregate_gradients, local_collection=local, timeout_s=timeout_s,
    )
    return model


def plan_storage(placements: list[tuple[str, list[int]]], tables: list[TableConfig], rank: int
                 ) -> dict[str, TablePlacement] | None:
    """The tier of each of this rank's shards a plan file (``dist.plan``) decides: {``<table>.shard<i>``:
    placement}, the shards its ``storage`` entries do not name on the device; None when the plan has no
    ``storage`` entry at all (or the placements are not from a plan file): the ``[memory]`` budgets decide."""
    if not isinstance(placements, PlanPlacements) or not any(any(s) for s in placements.storage):
        return None
    out = {}
    for t, (kind, ranks), shards in zip(tables, placements, placements.storage, strict=True):
        if kind == "data_parallel":  # replicated, on the device
            continue
        for i, (r, st) in enumerate(zip(ranks, shards, strict=True)):
            if r == rank:
                out[f"{t.name}.shard{i}"] = TablePlacement(st.tier, st.cache_rows) if st else TablePlacement()
    return out


def wrap_ddp(model: DLRM, device: torch.device, stats: CommStats | None = None) -> DDP:
    """DDP over the dense parameters only: embedding buffers differ per rank and update themselves.
    With ``stats``, each gradient bucket's all-reduce is timed (launch to completion; it overlaps backward)."""
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        # each rank would keep running statistics of its own samples (SyncBatchNorm is CUDA-only in torch)
        raise ConfigError('model.mlp_norm: "batch" is not supported under torchrun (every rank would evaluate and '
                          'checkpoint running statistics of its own samples); use "layer"')
    ignore = [f"embeddings.{name}" for name, _ in model.embeddings.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False)
    if stats is not None:
        ddp.register_comm_hook(stats, _timed_allreduce)
    return ddp


def _timed_allreduce(stats, bucket):  # no annotations: DDP checks real, not string, annotations
    t0 = time.perf_counter()
    buf = bucket.buffer()
    nbytes = buf.numel() * buf.element_size()
    # mean over ranks, as DDP does by default (None: the default group, which torch's stubs do not admit)
    fut = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        stats.add("allreduce_dense", nbytes, time.perf_counter() - t0)
        return f.value()

    return fut.then(done)


def all_gather_metrics(metrics: BinaryMetrics) -> BinaryMetrics:
    """Merge every rank's evaluation accumulator (each rank scored its own slice of the rows)."""
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, {k: v.cpu() for k, v in metrics.state().items()})
    merged = BinaryMetrics.from_state(states[0])
    for s in states[1:]:
        merged.merge(BinaryMetrics.from_state(s))
    return merged


def placements_from_config(
    dist_cfg: DistConfig, table_names: list[str], world_size: int
) -> list[tuple[str, list[int]]]:
    """(sharding, ranks) per table: from the plan JSON when ``dist.plan`` is set, else ``dist.sharding`` for
    every table (table_wise tables dealt round-robin).

    A plan is checked with the planner's own validation (``ShardingPlan.validate``); a hand-written one may
    leave out what the planner derives (version, topology, batch size, rows and dim, memory estimates).
    Errors name the plan file, the table and the field. The checks that need the tables' sizes run when the
    sharded collection is built (``PlanPlacements.check``)."""
    if dist_cfg.plan:
        path = Path(dist_cfg.plan)
        text = read_text(path, PlanError)  # unreadable or not UTF-8: an error naming the file
        per_node = dist_cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        nodes, rest = divmod(world_size, per_node) if per_node > 0 else (0, 1)
        job = Topology(nodes, per_node) if nodes and not rest else Topology(1, world_size)
        plan = ShardingPlan.from_json(text, str(path), estimates=False, topology=job)
        return PlanPlacements(plan, table_names, world_size, str(path), job)
    everyone = list(range(world_size))
    if dist_cfg.sharding == "table_wise":
        return [("table_wise", [i % world_size]) for i in range(len(table_names))]
    return [(dist_cfg.sharding, everyone) for _ in table_names]
