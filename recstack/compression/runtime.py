"""What the trainer needs from recstack.compression: the codecs for ``dist.forward_codec`` /
``dist.backward_codec``, their per-chunk table map, the iteration, metrics, and payload capture.

Usage (``recstack.trainer``)::

    comp = CompressionRuntime(cfg, output_dir, rank, world)
    fwd, bwd = comp.codecs()            # names, or configured EbCodec instances for "eb"
    shard_model(..., fwd, bwd, ...)     # the sharded collection hands them to every PooledExchange
    comp.attach(model)                  # chunk -> table map, compression.json, --dump-a2a hook
    comp.begin_step(iteration)          # before each training step
    values.update(comp.metrics(steps))  # at each log line
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from recstack.compression.bounds import DualLevelBound
from recstack.compression.capture import PayloadRecorder
from recstack.compression.codec import EbCodec
from recstack.distributed.codecs import ChunkKey


def chunk_table_map(collection: torch.nn.Module) -> Any:
    """ChunkKey -> table index for a ShardedEmbeddingCollection: the chunk at position i of a message from
    (forward) or to (backward) owner rank r carries pair i of ``collection.pairs[r]``."""
    tables = [[shard.table for _, shard in per_rank] for per_rank in collection.pairs]

    def table_of(key: ChunkKey) -> int | None:
        owner = key.src if key.phase == "fwd_a2a" else key.dst
        per_rank = tables[owner] if 0 <= owner < len(tables) else []
        return per_rank[key.index] if key.index < len(per_rank) else None

    return table_of


class CompressionRuntime:
    def __init__(self, cfg: Any, output_dir: str | Path | None, rank: int = 0, world: int = 1) -> None:
        """``cfg``: a recstack Config (its ``dist`` and ``compression`` sections are read)."""
        self.cfg, self.dist = cfg.compression, cfg.dist
        self.output_dir = Path(output_dir) if output_dir else None
        self.rank, self.world = rank, world
        self.eb: dict[str, EbCodec] = {}  # metric prefix -> codec
        self.policies: dict[str, DualLevelBound] = {}
        self.recorder: PayloadRecorder | None = None
        if self.cfg.dump_dir:
            self.recorder = PayloadRecorder(self.cfg.dump_dir, self.cfg.dump_steps, rank, world)

    def codecs(self) -> tuple[Any, Any]:
        """-> (forward, backward) codec: the configured name, or an EbCodec for ``eb``."""
        out = []
        for prefix, name in (("eb_fwd", self.dist.forward_codec), ("eb_bwd", self.dist.backward_codec)):
            if name == "eb":
                codec = EbCodec(self.cfg.base_bound, self.cfg.bound_mode == "rel", self.cfg.lossless,
                                error_feedback=self.cfg.error_feedback and prefix == "eb_bwd")
                self.eb[prefix] = codec
                out.append(codec)
            else:
                out.append(name)
        return out[0], out[1]

    def attach(self, model: torch.nn.Module) -> None:
        """After the model is built (and sharded): bind table maps and bound policies, write
        ``compression.json`` (rank 0), and hook payload capture."""
        emb = model.embeddings
        tables = [(t.name, t.num_embeddings) for t in emb.tables]
        table_of = chunk_table_map(emb) if hasattr(emb, "pairs") else None
        for prefix, codec in self.eb.items():
            scale = self.cfg.backward_scale if prefix == "eb_bwd" else 1.0
            policy = DualLevelBound(self.cfg, tables, scale)
            self.policies[prefix] = policy
            codec.policy = policy
            if table_of is not None:
                codec.bind(table_of)
        if self.eb and self.output_dir is not None and self.rank == 0:
            info = {"bound_mode": self.cfg.bound_mode, "schedule": self.cfg.schedule, "c": self.cfg.schedule_c,
                    "stage": self.cfg.schedule_stage, "error_feedback": self.cfg.error_feedback,
                    "tables": {p.removeprefix("eb_"): pol.describe() for p, pol in self.policies.items()}}
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "compression.json").write_text(json.dumps(info, indent=2))
        if self.eb and self.cfg.eval_lossless:
            codecs = list(self.eb.values())

            def track_mode(module: torch.nn.Module, inputs: tuple) -> None:
                for codec in codecs:
                    codec.lossless_now = not module.training

            emb.register_forward_pre_hook(track_mode)
        if self.recorder is not None:
            self.recorder.attach(emb)

    def begin_step(self, iteration: int) -> None:
        """Before training step ``iteration`` (0 = the first)."""
        for codec in self.eb.values():
            codec.set_iteration(iteration)
        if self.recorder is not None:
            self.recorder.set_step(iteration + 1)

    def metrics(self, steps: int) -> dict[str, float]:
        """Per-step codec figures over the last ``steps`` steps and the bounds in force (for metrics.jsonl)."""
        out: dict[str, float] = {}
        for prefix, codec in self.eb.items():
            out.update(codec.pop_metrics(prefix, steps))
        return out
