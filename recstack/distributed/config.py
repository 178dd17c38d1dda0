"""``[dist]``: hybrid-parallel training under ``torchrun``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DistConfig:
    """Hybrid-parallel training under ``torchrun`` (ignored in a single process).

    ``plan`` is a sharding-plan JSON (``recstack plan --out``); without one every table gets ``sharding``
    (table_wise tables are dealt round-robin over the ranks). ``train.batch_size`` is per rank.
    """

    plan: str = ""
    sharding: str = "table_wise"
    forward_codec: str = "fp32"  # fp32 | fp16 | bf16 | fp8 | int8 | eb (error-bounded, see [compression])
    backward_codec: str = "fp32"
    aggregate_gradients: bool = False  # backward all-to-all: one row per distinct id of one-hot features
    timeout_s: float = 300.0
    ranks_per_node: int = 0  # 0 = LOCAL_WORLD_SIZE from torchrun
    pipeline: bool = True  # distribute the next batch's ids while the current batch computes
