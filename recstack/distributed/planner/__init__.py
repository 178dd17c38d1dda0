"""Sharding planner for hybrid-parallel training: per-table sharding type and ranks that minimise the
slowest rank's predicted step time (``cost.py``) under device memory limits (``partition.py``)."""

from recstack.distributed.planner.cost import TERMS, CostConfig, CostModel, Estimate
from recstack.distributed.planner.partition import plan_sharding
from recstack.distributed.planner.report import render_plan
from recstack.distributed.planner.types import (
    PlanError,
    PlanPlacements,
    ShardingPlan,
    TableSharding,
    TableSpec,
    Topology,
)

__all__ = [
    "TERMS", "CostConfig", "CostModel", "Estimate", "PlanError", "PlanPlacements", "ShardingPlan", "TableSharding",
    "TableSpec", "Topology", "plan_sharding", "render_plan",
]
