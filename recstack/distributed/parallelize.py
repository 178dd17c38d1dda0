"""Turn a single-device DLRM into a hybrid-parallel one: sharded embeddings + DDP for the dense part."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
from recstack.metrics import BinaryMetrics
from recstack.models.dlrm import DLRM


def init_distributed(timeout_s: float = 300.0) -> tuple[int, int, torch.device]:
    """Join the job started by torchrun (env:// rendezvous): NCCL with one GPU per process when CUDA is
    available, gloo on CPU otherwise. ``timeout_s`` bounds every collective, so if a rank dies the others
    fail with an error instead of hanging. -> (rank, world size, device)."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return dist.get_rank(), dist.get_world_size(), device


def shard_model(
    model: DLRM,
    placements: list[tuple[str, list[int]]],
    seed: int,
    device: torch.device,
    forward_codec: str = "fp32",
    backward_codec: str = "fp32",
    ranks_per_node: int | None = None,
) -> DLRM:
    """Replace the model's local collection with a sharded one holding the same initial rows."""
    emb = model.embeddings
    model.embeddings = ShardedEmbeddingCollection(
        emb.tables, emb.optimizer.config, placements, seed, device, forward_codec, backward_codec, ranks_per_node
    )
    return model


def wrap_ddp(model: DLRM, device: torch.device) -> DDP:
    """DDP over the dense parameters only: embedding buffers differ per rank and update themselves."""
    ignore = [f"embeddings.{name}" for name, _ in model.embeddings.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)


def all_gather_metrics(metrics: BinaryMetrics) -> BinaryMetrics:
    """Merge every rank's evaluation accumulator (each rank scored its own slice of the rows)."""
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, {k: v.cpu() for k, v in metrics.state().items()})
    merged = BinaryMetrics.from_state(states[0])
    for s in states[1:]:
        merged.merge(BinaryMetrics.from_state(s))
    return merged
