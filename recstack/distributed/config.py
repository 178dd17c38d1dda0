"""``[dist]``: hybrid-parallel training under ``torchrun``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from recstack.errors import ConfigError

# fp32 | fp16 | bf16 | fp8 | int8 | eb (error-bounded, see [compression])
Codec = Literal["fp32", "fp16", "bf16", "fp8", "int8", "eb"]


@dataclass
class DistConfig:
    """Hybrid-parallel training under ``torchrun`` (ignored in a single process); each rank runs on
    ``train.device`` (auto: a GPU of its own where there are enough; ``parallelize.rank_device``).

    ``plan`` is a sharding-plan JSON (``recstack plan --out``); without one every table gets ``sharding``
    (table_wise tables are dealt round-robin over the ranks). ``train.batch_size`` is per rank.
    """

    plan: str = ""
    sharding: Literal["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise"] = "table_wise"
    forward_codec: Codec = "fp32"
    backward_codec: Codec = "fp32"
    aggregate_gradients: bool = False  # backward all-to-all: one row per distinct id of one-hot features
    timeout_s: float = 300.0
    ranks_per_node: int = 0  # 0 = LOCAL_WORLD_SIZE from torchrun
    pipeline: bool = True  # distribute the next batch's ids while the current batch computes
    # auto: NCCL where every rank of a node has a GPU of its own, else gloo (gloo takes CUDA tensors: ranks can
    # share a GPU); nccl: a ConfigError where it cannot start (no GPU, or ranks sharing one)
    backend: Literal["auto", "nccl", "gloo"] = "auto"

    def validate(self) -> None:
        """Ranges; each ConfigError names the field."""
        if self.ranks_per_node < 0:
            raise ConfigError(f"dist.ranks_per_node: must be >= 0, got {self.ranks_per_node}")
        if not 0.0 < self.timeout_s < math.inf:
            raise ConfigError(f"dist.timeout_s: must be finite and > 0, got {self.timeout_s}")
