"""What the planner is given: the cluster :class:`Topology` and each embedding table's :class:`TableSpec`, and
:class:`PlanError`, the error of every request the planner cannot satisfy and every plan that does not check.

Sizes are bytes, bandwidths bytes per second. The plan the planner writes from these is in ``plan.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from recstack.distributed.planner.storage import TierBudgets
from recstack.errors import ConfigError
from recstack.units import format_bytes


class PlanError(ConfigError):
    """A request the planner cannot satisfy, or a plan that does not describe a valid sharding (a
    ``ValueError`` too, as it always was)."""


@dataclass(frozen=True)
class Topology:
    """``nodes`` hosts of ``devices_per_node`` devices; rank r lives on node r // devices_per_node.

    Defaults are the TorchRec planner's (HBM 32 GB, DDR 128 GB, 600 GB/s inside a node, 12.5 GB/s across
    nodes); ``hbm_bw`` is the device memory bandwidth used for lookups and updates (900 GB/s: V100 data
    sheet, the device class those memory defaults describe). ``inter_bw`` is each device's share of the
    scale-out network (ZionEX gives every GPU its own NIC).

    Storage tiers: ``ddr_bytes`` (host memory) and ``ssd_bytes`` (0: no SSD) are per host, split evenly
    between its devices' ranks (:meth:`budgets`). ``pcie_bw`` is each device's host<->device link (25 GB/s, a
    PCIe 4.0 x16 link in practice) and ``ssd_bw`` each rank's share of its host's SSD bandwidth (2 GB/s);
    both are assumptions of the cost model, not measured.
    """

    nodes: int = 1
    devices_per_node: int = 8
    hbm_bytes: int = 32 * 10**9
    ddr_bytes: int = 128 * 10**9
    intra_bw: float = 600e9
    inter_bw: float = 12.5e9
    hbm_bw: float = 900e9
    ssd_bytes: int = 0
    pcie_bw: float = 25e9
    ssd_bw: float = 2e9

    def __post_init__(self) -> None:
        whole = ("nodes", "devices_per_node", "hbm_bytes", "ddr_bytes", "ssd_bytes")
        for f in fields(self):
            value = getattr(self, f.name)
            optional = f.name in ("ddr_bytes", "ssd_bytes")  # 0: no host memory / SSD for tables
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    value >= 0 if optional else value > 0) or (value == math.inf and f.name in whole):
                kind = "non-negative" if optional else "positive"
                raise PlanError(f"topology: {f.name} must be a {kind} number, got {value!r}")
        for name in whole:
            if int(getattr(self, name)) != getattr(self, name):
                raise PlanError(f"topology: {name} must be an integer, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def budgets(self) -> TierBudgets:
        """Per-rank bytes of device memory, host memory and SSD: HBM, and each host's DDR and SSD split
        evenly between its ranks."""
        L = self.devices_per_node
        return TierBudgets(self.hbm_bytes, self.ddr_bytes // L, self.ssd_bytes // L)

    def explain_budgets(self) -> dict[str, str]:
        L = self.devices_per_node
        per_host = {"host": self.ddr_bytes, "ssd": self.ssd_bytes}
        return {"device": "HBM per rank", **{k: f"{format_bytes(v, decimal=True)} per host / {L} ranks"
                                             for k, v in per_host.items()}}

    def describe(self) -> str:
        hbm, ddr, intra, inter, mem = (format_bytes(b, decimal=True) for b in (
            self.hbm_bytes, self.ddr_bytes, self.intra_bw, self.inter_bw, self.hbm_bw))
        text = (f"{self.nodes} node(s) x {self.devices_per_node} devices, HBM {hbm}, DDR {ddr}/host, "
                f"links {intra}/s intra, {inter}/s inter, memory {mem}/s")
        if self.ssd_bytes:
            ssd, pcie, ssd_bw = (format_bytes(b, decimal=True) for b in (self.ssd_bytes, self.pcie_bw, self.ssd_bw))
            text += f"; SSD {ssd}/host, PCIe {pcie}/s, SSD {ssd_bw}/s per rank"
        return text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "topology") -> Topology:
        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {unknown} (known: {sorted(known)})")
        return cls(**d)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table. ``pooling`` is the mean number of ids per sample (1.0 for one-hot features; 0 for
    a feature that is always empty: the table still needs a place, and its bags still travel, empty).

    ``access_counts`` (optional) is a histogram of lookups over equal row ranges: entry j counts the ids
    that fall in rows [j*rows/n, (j+1)*rows/n). It tells the cost model how lookups split between row
    blocks and how many distinct rows a batch touches; without it ids are taken as uniform over the rows.
    ``zipf`` is the exponent of the ids' popularity law, which sets the hit rate of a cached shard
    (``hit_rate.py``).
    """

    name: str
    rows: int
    dim: int
    pooling: float = 1.0
    access_counts: tuple[float, ...] | None = None
    zipf: float | None = None  # Zipf exponent of the ids (cache hit rates); None: the cost config's

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"table name must be a non-empty string, got {self.name!r}")
        for name in ("rows", "dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PlanError(f"{where}: field '{name}' must be a positive integer, got {value!r}")
        if (isinstance(self.pooling, bool) or not isinstance(self.pooling, int | float)
                or not 0 <= self.pooling < math.inf):
            raise PlanError(f"{where}: field 'pooling' must be a non-negative number, got {self.pooling!r}")
        if self.access_counts is not None:
            counts = tuple(self.access_counts)
            if not counts or any(isinstance(c, bool) or not isinstance(c, int | float) or not c >= 0
                                 for c in counts) or not sum(counts) > 0:
                raise PlanError(f"{where}: field 'access_counts' must be a non-empty list of non-negative "
                                f"numbers with a positive sum")
            object.__setattr__(self, "access_counts", counts)
        if self.zipf is not None and (isinstance(self.zipf, bool) or not isinstance(self.zipf, int | float)
                                      or not 0 <= self.zipf < math.inf):
            raise PlanError(f"{where}: field 'zipf' must be a non-negative number, got {self.zipf!r}")
