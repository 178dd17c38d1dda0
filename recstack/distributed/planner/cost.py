"""Cost model: predicted seconds per training step on each rank, and the memory each shard needs.

Symbols. W ranks, L devices per node, N = W / L nodes; B per-rank batch, G = B * W global batch. A table
has R rows, D columns and pooling P (mean ids per sample). A shard holds ``rows_s`` rows and ``c`` columns
and receives a fraction f of the table's ids (1 for table-wise and column-wise; for a row block, its share
of ``access_counts``, or rows_s / R when ids are uniform); u is the expected number of distinct rows it sees
per step. Element sizes in bytes (:class:`CostConfig`): w weight (4, fp32), s optimizer state per row
(row-wise Adagrad keeps one fp32 per row: 4; SGD none: 0), i id (8, int64), a / g one element of the
forward / backward all-to-all (4 for fp32; 2 with the fp16 / bf16 codecs; 1 with fp8 / int8) and h_a / h_g
the bytes the codec adds to every row it sends (0; fp8 one fp32 scale: 4; int8 min and scale: 8), so a row
of c columns is c*a + h_a bytes. Bandwidths (bytes/s) come from
:class:`Topology`: ``hbm_bw`` device memory, ``intra_bw`` per-device link inside a node, ``inter_bw`` each
device's share of the network between nodes.

A rank talks to L-1 peers inside its node and W-L outside, so moving x bytes to (or from) every peer costs
    link(x) = (L-1) * x / intra_bw + (W-L) * x / inter_bw      (the two kinds of link are not overlapped)

Terms for a model-parallel shard (table_wise, column_wise, row_wise, table_row_wise), in seconds:
    input_dist  = link(B * (P*f + 1) * i)         ids of its rows plus one bag length per sample, per peer;
                                                  every column block needs all ids: k times the id traffic
    lookup      = G * (P*f + 1) * c * w / hbm_bw  read P*f rows per sample, write the pooled [G, c]
    output_dist = link(B * (c*a + h_a))           each peer's pooled [B, c]; row shards send partial sums
                                                  of the full width D, so k row shards move k times the
                                                  bytes of one table-wise table
    grad_dist   = link(B * (c*g + h_g))           the gradients of those outputs, back to the shard
    backward    = (G*(P*f + 1)*c*w + u*(2*c*w + 2*s)) / hbm_bw
                                                  read output grads, accumulate them per id, read + write
                                                  each touched row and its optimizer state (fused update)
table_row_wise (k ranks of one node) first reduce-scatters the partial sums inside the node,
(k-1)/k * G * (D*a + h_a) / intra_bw, then each shard sends its 1/k of the summed outputs:
link(B * (D*a/k + h_a)).
Across nodes the table thus moves what one table-wise shard would, spread over k ranks; gradients mirror it
(an all-gather inside the node).

data_parallel, on every rank, for its own B samples:
    lookup    = B * (P + 1) * D * w / hbm_bw
    allreduce = 2*(L-1)/L * S / intra_bw + 2*(N-1)/N * (S/L) / inter_bw, S = R * D * w: hierarchical
                all-reduce of the dense table gradient (reduce-scatter and all-gather inside the node, an
                all-reduce of each 1/L slice between nodes): the whole table every step, so small tables only
    backward  = (B*(P + 1)*D*w + 2*R*D*w + u*(2*D*w + 2*s)) / hbm_bw
                scatter local grads into the dense buffer, zero and scan it, update the rows touched
                anywhere in the global batch

Memory (HBM) per shard: rows_s * (c*w + s); data_parallel also keeps the dense gradient buffer, R * D * w.

Storage tiers (``storage.py``). A ``host-cached`` or ``ssd-cached`` shard keeps C = cache_rows rows in HBM,
C * (c*w + s) bytes, and all rows_s * (c*w + s) in host memory or on SSD. Its lookup and backward terms stay
(the cache is in HBM) and one term joins them:
    cache_miss = m * 2 * (c*w + s) / pcie_bw   (+ m * 2 * (c*w + s) / ssd_bw for an ssd-cached shard)
m is the expected number of distinct rows a step requests that are not resident (``hit_rate.py``: Zipf ids of
the table's exponent, the cache's policy, G * P ids of the table per step, the shard's rows_s / R share of the
rows); each miss reads the row and its optimizer state and, training having updated every row it read, writes
back the row it evicts: two rows over the host link, and over the SSD for an SSD shard (the two transfers are
not overlapped). ``pcie_bw`` and ``ssd_bw`` are the topology's (assumptions: 25 GB/s per device, 2 GB/s per rank).
data_parallel tables always stay on the device.

u: ids are independent draws. A bucket of r rows that receives n ids (uniform inside the bucket) has
r * (1 - exp(-n / r)) distinct rows touched in expectation; a shard sums this over the access-count buckets
it overlaps, with n = G * P * (bucket's share of the counts).

Each shard's cost is charged to the rank that holds it: that rank's memory and links carry the whole
batch's volume for the shard, while every peer carries a B-sized slice. The slices each rank receives are
left out, as are latencies and the overlap of the next batch's input distribution with compute: the model
ranks plans, it is not a timer.

Prefetching the next batch's rows overlaps cache misses with compute in training; the model charges them in
full, like the other terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from recstack.distributed.planner.hit_rate import POLICIES, SYNTH_ZIPF_EXPONENT, CacheEstimate, estimate_cache
from recstack.distributed.planner.inputs import PlanError, TableSpec, Topology
from recstack.distributed.planner.storage import (
    BUDGETS,
    OPTIMIZER_STATE_BYTES,
    ShardStorage,
    row_bytes,
    shard_bytes,
)
from recstack.distributed.planner.table_sharding import TableSharding
from recstack.distributed.sharding import SHARDING_TYPES, shard_blocks

TERMS = ("input_dist", "lookup", "output_dist", "grad_dist", "backward", "allreduce", "cache_miss")
COMM_TERMS = ("input_dist", "output_dist", "grad_dist", "allreduce")


@dataclass(frozen=True)
class CostConfig:
    """Element sizes in bytes and the sparse optimizer (its per-row state is stored with each shard).
    ``fwd_row_bytes`` / ``bwd_row_bytes``: what the all-to-all codec adds to every row (fp8's scale, int8's
    min and scale), on top of ``*_comm_bytes`` per element. ``cache_policy`` and ``zipf_exponent`` (of
    tables whose spec gives none) set the hit rates of cached shards."""

    weight_bytes: int = 4
    fwd_comm_bytes: int = 4
    bwd_comm_bytes: int = 4
    index_bytes: int = 8
    optimizer: str = "rowwise_adagrad"
    fwd_row_bytes: int = 0
    bwd_row_bytes: int = 0
    cache_policy: str = "lru"
    zipf_exponent: float = SYNTH_ZIPF_EXPONENT

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlanError(f"optimizer {self.optimizer!r}: expected one of {sorted(OPTIMIZER_STATE_BYTES)}")
        if self.cache_policy not in POLICIES:
            raise PlanError(f"cache policy {self.cache_policy!r}: expected one of {', '.join(POLICIES)}")
        if not 0 <= self.zipf_exponent < float("inf"):
            raise PlanError(f"Zipf exponent must be a non-negative number, got {self.zipf_exponent!r}")
        for name in ("weight_bytes", "fwd_comm_bytes", "bwd_comm_bytes", "index_bytes"):
            if getattr(self, name) <= 0:
                raise PlanError(f"cost config: {name} must be positive")
        for name in ("fwd_row_bytes", "bwd_row_bytes"):
            if getattr(self, name) < 0:
                raise PlanError(f"cost config: {name} must be non-negative")

    @property
    def state_bytes(self) -> int:
        return OPTIMIZER_STATE_BYTES[self.optimizer]


@dataclass(frozen=True)
class Estimate:
    """The k shards of one table under one sharding type, in shard order (data_parallel: one per rank)."""

    terms: np.ndarray  # [k, len(TERMS)] seconds per step, on the shard's rank
    hbm: np.ndarray    # [k] bytes of device memory
    host: np.ndarray | None = None  # [k] bytes of host memory (None: none)
    ssd: np.ndarray | None = None   # [k] bytes of SSD
    hit_rate: np.ndarray | None = None  # [k] predicted cache hit rate per distinct row (nan: a device shard)
    storage: tuple[ShardStorage | None, ...] = field(default=())  # per shard; () = all on the device

    @property
    def cost(self) -> np.ndarray:
        """[k] seconds per step of each shard."""
        return self.terms.sum(axis=1)

    def memory(self) -> np.ndarray:
        """[len(BUDGETS), k] bytes of device memory, host memory and SSD of each shard."""
        zero = np.zeros_like(self.hbm)
        return np.stack([self.hbm, zero if self.host is None else self.host, zero if self.ssd is None else self.ssd])


@lru_cache(maxsize=4096)
def _cache(rows: int, exponent: float, cache_rows: int, ids: float, policy: str, fraction: float) -> CacheEstimate:
    return estimate_cache(rows, exponent, cache_rows, ids, policy, fraction)


def row_access(table: TableSpec, blocks: Sequence[tuple[int, int]], n_ids: float) -> tuple[np.ndarray, np.ndarray]:
    """Row blocks [(lo, hi)] of ``table`` and ``n_ids`` ids per step -> (share of ids per block [k],
    expected distinct rows touched per block [k])."""
    counts = np.asarray(table.access_counts or (1.0,), dtype=np.float64)
    p = counts / counts.sum()  # [nb]
    edges = np.linspace(0.0, table.rows, len(p) + 1)
    width = np.diff(edges)
    lo = np.array([b[0] for b in blocks], dtype=np.float64)[:, None]
    hi = np.array([b[1] for b in blocks], dtype=np.float64)[:, None]
    overlap = np.clip(np.minimum(hi, edges[1:]) - np.maximum(lo, edges[:-1]), 0.0, None)  # [k, nb]
    share = (overlap / width) @ p
    distinct = (overlap * -np.expm1(-n_ids * p / width)).sum(axis=1)
    return share, distinct


class CostModel:
    """Per-shard estimates for a topology, per-rank batch size and :class:`CostConfig`."""

    def __init__(self, topology: Topology, batch_size_per_rank: int, config: CostConfig | None = None) -> None:
        if batch_size_per_rank <= 0:
            raise PlanError(f"batch size per rank must be positive, got {batch_size_per_rank}")
        self.topology = topology
        self.batch = batch_size_per_rank
        self.config = config or CostConfig()

    def link(self, bytes_per_peer: Any) -> Any:
        """Seconds to move ``bytes_per_peer`` to or from every other rank (a float, or elementwise over an
        array of per-shard bytes)."""
        t = self.topology
        return ((t.devices_per_node - 1) * bytes_per_peer / t.intra_bw
                + (t.world_size - t.devices_per_node) * bytes_per_peer / t.inter_bw)

    def allreduce(self, nbytes: float) -> float:
        """Hierarchical all-reduce of ``nbytes`` (seconds per rank)."""
        t = self.topology
        L, N = t.devices_per_node, t.nodes
        return 2 * (L - 1) / L * nbytes / t.intra_bw + 2 * (N - 1) / N * (nbytes / L) / t.inter_bw

    def reduce_in_node(self, nbytes: float, k: int) -> float:
        """Reduce-scatter (or all-gather) of ``nbytes`` among k ranks of one node (seconds per rank)."""
        return (k - 1) / k * nbytes / self.topology.intra_bw

    def estimate(self, table: TableSpec, sharding: str, k: int,
                 storage: Sequence[ShardStorage | None] | None = None) -> Estimate:
        """Cost and memory of the k shards of ``table`` under ``sharding`` (formulas: module docstring), each
        on the device or as ``storage`` says (per shard, in shard order). table_wise takes k = 1 and
        data_parallel k = W whatever ``k`` says."""
        est = self._device(table, sharding, k)
        if storage is None or not any(storage):
            return est
        if sharding == "data_parallel":
            raise PlanError(f"table {table.name!r}: data_parallel tables stay on the device")
        if len(storage) != len(est.hbm):
            raise PlanError(f"table {table.name!r}: {len(storage)} storage entries for {len(est.hbm)} shards")
        return self._tiered(table, sharding, est, tuple(storage))

    def cache_estimate(self, rows: int, exponent: float, cache_rows: int, ids: float, fraction: float) -> CacheEstimate:
        """``hit_rate.estimate_cache`` under this config's cache policy (memoised: many tables share a shape)."""
        return _cache(rows, float(exponent), int(cache_rows), float(ids), self.config.cache_policy, float(fraction))

    def _tiered(self, table: TableSpec, sharding: str, est: Estimate,
                storage: tuple[ShardStorage | None, ...]) -> Estimate:
        cfg, topo = self.config, self.topology
        rects = shard_blocks(sharding, table.rows, table.dim, len(storage))
        ids = self.batch * topo.world_size * table.pooling
        exponent = cfg.zipf_exponent if table.zipf is None else table.zipf
        terms, mem = est.terms.copy(), est.memory().copy()
        hit = np.full(len(storage), np.nan)
        for j, ((r0, r1, c0, c1), st) in enumerate(zip(rects, storage, strict=True)):
            if st is None:
                continue
            rows, rb = r1 - r0, row_bytes(c1 - c0, cfg.weight_bytes, cfg.state_bytes)
            c = self.cache_estimate(table.rows, exponent, st.cache_rows, ids, rows / table.rows)
            moved = c.misses * 2 * rb
            terms[j, TERMS.index("cache_miss")] = moved / topo.pcie_bw + (moved / topo.ssd_bw if st.tier ==
                                                                           "ssd-cached" else 0.0)
            used = shard_bytes(rows, c1 - c0, st, cfg.weight_bytes, cfg.state_bytes)
            mem[:, j] = [used[b] for b in BUDGETS]
            hit[j] = c.hit_rate
        return Estimate(terms, mem[0], mem[1], mem[2], hit, storage)

    def _device(self, table: TableSpec, sharding: str, k: int) -> Estimate:
        cfg, topo, B = self.config, self.topology, self.batch
        G, R, D, P = B * topo.world_size, table.rows, table.dim, table.pooling
        w, s, bw = cfg.weight_bytes, cfg.state_bytes, topo.hbm_bw
        if sharding == "data_parallel":
            W = topo.world_size
            _, touched = row_access(table, [(0, R)], G * P)
            terms = _terms(W, lookup=B * (P + 1) * D * w / bw, allreduce=self.allreduce(R * D * w),
                           backward=(B * (P + 1) * D * w + 2 * R * D * w + touched[0] * (2 * D * w + 2 * s)) / bw)
            return Estimate(terms, np.full(W, R * (D * w + s) + R * D * w))
        k = 1 if sharding == "table_wise" else k
        if sharding not in SHARDING_TYPES or k < 1:
            raise PlanError(f"no cost for sharding {sharding!r} over {k} ranks")
        if sharding == "column_wise" and D % k:
            raise PlanError(f"table {table.name!r}: dim {D} does not split into {k} column blocks")
        rects = shard_blocks(sharding, R, D, k)
        blocks, cols = [(r0, r1) for r0, r1, _, _ in rects], rects[0][3] - rects[0][2]
        share, touched = row_access(table, blocks, G * P)  # [k], [k]
        rows = np.array([hi - lo for lo, hi in blocks], dtype=np.int64)
        codecs = ((cfg.fwd_comm_bytes, cfg.fwd_row_bytes), (cfg.bwd_comm_bytes, cfg.bwd_row_bytes))
        if sharding == "table_row_wise":
            fwd, bwd = (self.reduce_in_node(G * (D * nbytes + head), k) + self.link(B * (D * nbytes / k + head))
                        for nbytes, head in codecs)
        else:  # a codec's per-row bytes count once per pooled row, however narrow the column block
            fwd, bwd = (self.link(B * (cols * nbytes + head)) for nbytes, head in codecs)
        terms = _terms(
            k,
            input_dist=self.link(B * (P * share + 1) * cfg.index_bytes),
            lookup=G * (P * share + 1) * cols * w / bw,
            output_dist=fwd,
            grad_dist=bwd,
            backward=(G * (P * share + 1) * cols * w + touched * (2 * cols * w + 2 * s)) / bw,
        )
        return Estimate(terms, rows * (cols * w + s))

    def plan_cost(self, tables: Sequence[TableSpec], entries: Sequence[TableSharding]) -> dict[str, Any]:
        """The ``cost`` section of a plan: per-rank totals (seconds per step), max, mean, imbalance = max /
        mean, compute and communication per rank, each term per rank, HBM bytes per rank."""
        W = self.topology.world_size
        terms = np.zeros((W, len(TERMS)))
        memory = np.zeros((len(BUDGETS), W), dtype=np.int64)
        specs = {t.name: t for t in tables}
        for e in entries:
            est = self.estimate(specs[e.name], e.sharding, len(e.ranks), e.shard_storage())
            np.add.at(terms, e.ranks, est.terms)
            for i, m in enumerate(est.memory()):
                np.add.at(memory[i], e.ranks, m)
        out = _summarize(terms, memory[0], self.config)
        out["host_bytes_per_rank"] = [int(b) for b in memory[1]]
        out["ssd_bytes_per_rank"] = [int(b) for b in memory[2]]
        return out


def _summarize(terms: np.ndarray, hbm: np.ndarray, config: CostConfig) -> dict[str, Any]:
    """terms [W, len(TERMS)] seconds, hbm [W] bytes -> the plan's cost dictionary (the cache-miss traffic
    counts as compute: it is not the network's)."""
    per_rank = terms.sum(axis=1)
    comm = terms[:, [TERMS.index(n) for n in COMM_TERMS]].sum(axis=1)
    mx, mean = float(per_rank.max()), float(per_rank.mean())
    return {
        "per_rank": per_rank.tolist(),
        "max": mx,
        "mean": mean,
        "imbalance": mx / mean if mean > 0 else 1.0,
        "compute_per_rank": (per_rank - comm).tolist(),
        "comm_per_rank": comm.tolist(),
        "breakdown": {name: terms[:, i].tolist() for i, name in enumerate(TERMS)},
        "hbm_bytes_per_rank": [int(b) for b in hbm],
        "units": "seconds per training step; bytes",
        "config": asdict(config),
    }


def _terms(k: int, **values: float | np.ndarray) -> np.ndarray:
    """Named terms (scalars or [k] arrays; absent ones are zero) -> [k, len(TERMS)]."""
    out = np.zeros((k, len(TERMS)))
    for name, value in values.items():
        out[:, TERMS.index(name)] = value
    return out
