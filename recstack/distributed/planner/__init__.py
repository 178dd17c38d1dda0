"""Sharding planner for hybrid-parallel training: per-table sharding type and ranks that minimise the
slowest rank's predicted step time (``cost.py``) under device memory limits (``partition.py``, over the options
of ``options.py`` with the search of ``search.py``), with shards kept in host memory or on SSD behind device
caches where device memory is short (``storage.py``, ``hit_rate.py``, ``tiers.py``). The planner's inputs are in
``inputs.py``, the plan it writes in ``plan.py`` and ``table_sharding.py``."""

from recstack.distributed.planner.cost import TERMS, CostConfig, CostModel, Estimate
from recstack.distributed.planner.inputs import PlanError, TableSpec, Topology
from recstack.distributed.planner.partition import plan_sharding
from recstack.distributed.planner.plan import PlanPlacements, ShardingPlan
from recstack.distributed.planner.report import render_plan
from recstack.distributed.planner.storage import TIERS, ShardStorage, TierBudgets
from recstack.distributed.planner.table_sharding import TableSharding

__all__ = [
    "TERMS", "TIERS", "CostConfig", "CostModel", "Estimate", "PlanError", "PlanPlacements", "ShardStorage",
    "ShardingPlan", "TableSharding", "TableSpec", "TierBudgets", "Topology", "plan_sharding", "render_plan",
]
