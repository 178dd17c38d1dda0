"""What the trainer needs from recstack.compression: the codecs for ``dist.forward_codec`` /
``dist.backward_codec``, their per-chunk table map, the iteration, metrics, and payload capture.

Usage (``recstack.training.trainer``)::

    comp = CompressionRuntime(cfg.compression, cfg.dist.forward_codec, cfg.dist.backward_codec,
                              cfg.train.batch_size, output_dir, rank, world)
    fwd, bwd = comp.codecs()            # names, or configured EbCodec instances for "eb"
    shard_model(..., fwd, bwd, ...)     # the sharded collection hands them to every PooledExchange
    comp.attach(model)                  # chunk -> table map, compression.json, --dump-a2a hook
    comp.begin_step(iteration)          # before each training step
    values.update(comp.metrics(steps))  # at each log line
    state["compression"] = comp.state_dict()  # checkpoints: this rank's error-feedback residuals
    comp.load_state_dict(state.get("compression"), saved_world)  # on resume
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recstack.compression.analysis.capture import PayloadRecorder
from recstack.compression.base import ChunkKey
from recstack.compression.config import CompressionConfig
from recstack.compression.eb.bounds import DualLevelBound
from recstack.compression.eb.codec import EbCodec
from recstack.embedding.collection import EmbeddingCollection


def chunk_table_map(wire: list[list[tuple[int, int, int, int, int, int]]]) -> Callable[[ChunkKey], int | None]:
    """ChunkKey -> table index, from a collection's ``wire_layout()``: the chunk at position i of a message from
    (forward) or to (backward) owner rank r carries chunk i of ``wire[r]``."""
    tables = [[chunk[1] for chunk in per_rank] for per_rank in wire]

    def table_of(key: ChunkKey) -> int | None:
        owner = key.src if key.phase == "fwd_a2a" else key.dst
        per_rank = tables[owner] if 0 <= owner < len(tables) else []
        return per_rank[key.index] if key.index < len(per_rank) else None

    return table_of


class CompressionRuntime:
    """The codecs of one training run and their state: bound policies, counters, error-feedback residuals."""

    def __init__(self, compression: CompressionConfig, forward_codec: str, backward_codec: str, batch_size: int,
                 output_dir: str | Path | None, rank: int = 0, world: int = 1) -> None:
        """``forward_codec`` / ``backward_codec``: codec names (``dist.forward_codec`` / ``backward_codec``);
        ``batch_size``: per-rank batch rows, which fix the shape of every residual slot."""
        self.cfg = compression
        self.codec_names = (forward_codec, backward_codec)
        self.output_dir = Path(output_dir) if output_dir else None
        self.rank, self.world = rank, world
        self.batch_size = batch_size
        self.layout: str | None = None  # which chunk each residual slot holds (set by ``attach``)
        self.eb: dict[str, EbCodec] = {}  # metric prefix -> codec
        self.policies: dict[str, DualLevelBound] = {}
        self.recorder: PayloadRecorder | None = None
        if self.cfg.dump_dir:
            self.recorder = PayloadRecorder(self.cfg.dump_dir, self.cfg.dump_steps, rank, world)

    def codecs(self) -> tuple[str | EbCodec, str | EbCodec]:
        """-> (forward, backward) codec: the configured name, or an EbCodec for ``eb``."""
        out: list[str | EbCodec] = []
        for prefix, name in zip(("eb_fwd", "eb_bwd"), self.codec_names, strict=True):
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
        assert isinstance(emb, EmbeddingCollection)
        tables = [(t.name, t.num_embeddings) for t in emb.tables]
        wire = emb.wire_layout()  # per owner rank: (feature, table, row0, row1, col0, col1) of each chunk
        table_of = chunk_table_map(wire) if wire is not None else None
        if wire is not None:  # residual slot (phase, dst, i) holds chunk i of owner dst, [batch rows, dim]
            self.layout = json.dumps({"batch_size": self.batch_size, "pairs": wire})
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
        if self.eb:
            codecs, lossless = list(self.eb.values()), self.cfg.eval_lossless
            held: dict[int, dict[str, float]] = {}  # id(codec) -> its training counters while evaluating

            def track_mode(module: torch.nn.Module, inputs: tuple) -> None:
                # Evaluation traffic is not part of the training steps' figures (as for the exchange's own
                # byte counts): the first evaluation pass sets the training counters aside, and the next
                # training pass puts them back, dropping what the evaluation counted.
                for codec in codecs:
                    if lossless:
                        codec.lossless_now = not module.training
                    if not module.training and id(codec) not in held:
                        held[id(codec)] = codec.swap_counters({})
                    elif module.training and id(codec) in held:
                        codec.swap_counters(held.pop(id(codec)))

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

    # -- checkpoint state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's error-feedback residuals (``{prefix: {slot: [N, D] tensor}}``) and what they belong to:
        rank, world size and chunk layout. Rank-local: every rank saves its own."""
        residual = {prefix: codec.residual_state() for prefix, codec in self.eb.items() if codec.error_feedback}
        return {"rank": self.rank, "world_size": self.world, "layout": self.layout, "residual": residual}

    def load_state_dict(self, state: dict[str, Any] | None, saved_world: int | None = None,
                        device: torch.device | None = None) -> None:
        """Restore the residuals of ``state_dict`` (``saved_world``: the world size the checkpoint was written
        with, when known). Residuals are the compression errors of the chunks this rank sent; under another
        world size, rank or layout the same slot names another chunk (or none), so they are dropped with a
        message and error feedback starts again from zero, as at the start of a run."""
        codecs = {prefix: codec for prefix, codec in self.eb.items() if codec.error_feedback}
        for codec in codecs.values():
            codec.residual = {}
        saved = (state or {}).get("residual", {})
        if saved_world is None and state is not None:
            saved_world = state.get("world_size")
        if not codecs:
            if any(saved.values()):
                self._dropped("error feedback is off in this run")
            return
        if saved_world is not None and saved_world != self.world:
            if self.rank == 0:  # the same on every rank: say it once
                self._dropped(f"the checkpoint was written by {saved_world} ranks and this run has {self.world}; "
                              "residuals belong to the chunks each rank sent and cannot be mapped to another "
                              "world size", every_rank=True)
            return
        if state is None:
            self._dropped("the checkpoint holds none for this rank (written before residuals were saved)")
        elif state["rank"] != self.rank:
            self._dropped(f"the residuals found were saved by rank {state['rank']}")
        elif state.get("layout") != self.layout:
            self._dropped("the sharding layout or batch size changed, so the saved slots hold other chunks")
        else:
            for prefix, codec in codecs.items():
                codec.load_residual_state(saved.get(prefix, {}), device)

    def _dropped(self, reason: str, every_rank: bool = False) -> None:
        who = "every rank" if every_rank else f"rank {self.rank}"
        print(f"resume: error-feedback residuals of {who} start from zero: {reason}", flush=True)
