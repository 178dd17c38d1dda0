"""Payload capture: the pooled embeddings each feature puts into the batch, and their gradients, as .npy.

Under table-wise sharding the forward all-to-all carries exactly these [B, D] pieces (one per feature, from
the rank that owns the table to the rank that owns the samples) and the backward all-to-all carries their
gradients. ``recstack train --dump-a2a DIR`` saves them at chosen steps; ``recstack analyze-a2a DIR`` reads
them back. Files: ``DIR/meta.json`` and ``DIR/<fwd|bwd>_<feature>_s<step>_r<rank>.npy`` (float32 [B, D]).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recstack.embedding.collection import EmbeddingCollection

META = "meta.json"
_NAME = re.compile(r"^(fwd|bwd)_(.+)_s(\d+)_r(\d+)\.npy$")


@dataclass
class FeatureInfo:
    feature: str  # the feature's name (its table's name when the table has one feature)
    table: str
    rows: int  # table size: the table class of the adaptive bound depends on it
    dim: int


def features_of(collection: EmbeddingCollection) -> list[FeatureInfo]:
    """Feature order of an EmbeddingCollection's output [B, F, D], with each feature's table."""
    out: list[FeatureInfo | None] = [None] * collection.num_features
    for t in collection.tables:
        for f in t.features:
            name = t.name if len(t.features) == 1 else f"{t.name}.f{f}"
            out[f] = FeatureInfo(name, t.name, t.num_embeddings, t.embedding_dim)
    return [f for f in out if f is not None]


class PayloadRecorder:
    """Forward hook on an embedding collection that saves its output per feature (and, through a tensor
    hook, the gradient of it) when the step being run is one of ``steps`` (counted from 1)."""

    def __init__(self, out_dir: str | Path, steps: list[int], rank: int = 0, world: int = 1) -> None:
        self.out_dir = Path(out_dir)
        self.steps = set(steps)
        self.rank, self.world = rank, world
        self.step = 0
        self.features: list[FeatureInfo] = []
        self.saved = 0

    def attach(self, collection: EmbeddingCollection) -> None:
        self.features = features_of(collection)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            meta = {"world_size": self.world, "steps": sorted(self.steps),
                    "features": [f.__dict__ for f in self.features]}
            (self.out_dir / META).write_text(json.dumps(meta, indent=2))
        collection.register_forward_hook(self._hook)

    def set_step(self, step: int) -> None:
        """The step about to run (1 = the first)."""
        self.step = step

    def _save(self, direction: str, values: torch.Tensor, step: int) -> None:
        a = values.detach().to(torch.float32).cpu().numpy()  # [B, F, D]
        for f, info in enumerate(self.features):
            path = self.out_dir / f"{direction}_{info.feature}_s{step}_r{self.rank}.npy"
            np.save(path, np.ascontiguousarray(a[:, f]))
            self.saved += 1

    def _hook(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if not module.training or self.step not in self.steps:
            return
        step = self.step
        self._save("fwd", output, step)
        if output.requires_grad:
            output.register_hook(lambda grad: self._save("bwd", grad, step))


@dataclass
class Payload:
    """One captured (or raw) payload file."""

    path: Path
    direction: str  # fwd | bwd | raw
    feature: str
    table: str
    rows: int  # table size (0 when unknown)
    step: int
    rank: int

    def load(self, raw_shape: tuple[int, int] | None = None) -> np.ndarray:
        """-> float32 [N, D]. .npy files carry their shape; raw little-endian float32 files need ``raw_shape``."""
        if self.path.suffix == ".npy":
            a = np.load(self.path)
            if a.ndim != 2 or a.dtype != np.float32:
                raise ValueError(f"{self.path}: expected a float32 matrix, got {a.dtype} of shape {a.shape}")
            return a
        if raw_shape is None:
            raise ValueError(f"{self.path}: a raw float32 file needs --raw-shape NxD")
        size = self.path.stat().st_size
        if size % 4:  # np.fromfile would drop the trailing bytes: the file is not what the shape says
            raise ValueError(f"{self.path}: {size} bytes are not a whole number of float32 values")
        data = np.fromfile(self.path, dtype="<f4")
        n, d = raw_shape
        if data.size % d:
            raise ValueError(f"{self.path}: {data.size} float32 values are not rows of {d} (--raw-shape {n}x{d})")
        if n and data.size != n * d:
            raise ValueError(f"{self.path}: {data.size} float32 values, --raw-shape {n}x{d} needs {n * d}")
        return data.reshape(-1, d).astype(np.float32, copy=False)


def find_payloads(paths: Sequence[str | Path]) -> list[Payload]:
    """Files and directories -> payloads. Captured .npy files get their table from meta.json; any other file
    (raw float32 from other DLRM code) is one payload of unknown table."""
    out: list[Payload] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or directory")
        files = sorted(q for q in p.iterdir() if q.is_file() and q.name != META) if p.is_dir() else [p]
        meta_path = (p if p.is_dir() else p.parent) / META
        tables: dict[str, FeatureInfo] = {}
        if meta_path.is_file():
            try:
                meta = json.loads(meta_path.read_text())
                tables = {f["feature"]: FeatureInfo(**f) for f in meta["features"]}
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{meta_path}: not a payload capture description ({e})") from e
        for q in files:
            m = _NAME.match(q.name)
            if m:
                info = tables.get(m.group(2))
                out.append(Payload(q, m.group(1), m.group(2), info.table if info else m.group(2),
                                   info.rows if info else 0, int(m.group(3)), int(m.group(4))))
            else:
                out.append(Payload(q, "raw", q.stem, q.stem, 0, 0, 0))
    return out
