"""Dynamic id tables under torchrun: the id maps split over the ranks by id hash, each rank's rows in its row shard.

Rank k of W owns the raw ids with ``id_owner(id, W) == k`` (a hash: any id range spreads evenly) and keeps their
``DynamicIdMap`` of n = C / W rows (C the table's capacity, which W must divide). Its map's row r > 0 is row
k * n + r of the table, held by the table's row-wise shard k: a dynamic table is sharded ``row_wise`` over every
rank in rank order, whatever ``dist.sharding`` or a plan would choose (``dynamic_placements``). Per training step
(``remap_batch``, in the training thread, before the step's input distribution):

1. every rank sends the raw ids of its samples' dynamic features to their owners (one variable-size all-to-all of
   int64 on the collection's id group, every dynamic table in one message);
2. each owner takes one step of each of its maps over the ids it got from every rank: admission, eviction, and the
   reused rows' values and optimizer state reset in its own shard (values keyed by the raw id: an id starts with
   the vector one process would give it);
3. the owners send the table rows back (a second all-to-all, of sizes both sides know), and the batch goes on to
   the ordinary row-wise lookup, which takes each id to the rank holding its row: its owner.

Evaluation (``lookup_batch``) runs the same exchange with lookups; it is a collective, so the evaluating (training)
thread applies it, not the loader's thread. Ids without a row get row 0 of the table, the single default row one
process has (rank 0's map row 0): each rank k > 0 leaves its map's reserved row 0 (table row k * n) unused, so the
tables hold up to C - W ids (one process: C - 1). Under capacity every id of a step gets a row as in one process,
so a run matches the single-process run on the same global batches; under pressure each rank evicts within its
own n rows (each rank's ``max_candidates`` is ceil(max_candidates / W)).

Checkpoints hold the maps merged into one map of C rows in table rows (``merge_maps``), the format one process
writes: ``recstack eval``, ``predict`` and ``export`` read a torchrun run's maps as theirs (the union of the ranks'
maps, unknown ids -> row 0). A resume splits it again (``split_map``), with the same number of ranks only: another
would move ids to other owners, and their rows with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from recstack.distributed.comm import all_to_all_variable
from recstack.distributed.planner.plan import PlanPlacements
from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
from recstack.embedding.dynamic import DynamicIdMap, DynamicIdsConfig, id_owner
from recstack.embedding.dynamic_stage import DynamicIds
from recstack.errors import ConfigError

_I64 = torch.int64


def check_capacities(cfg: DynamicIdsConfig, names: list[str], world: int) -> None:
    """ConfigError naming the key unless every dynamic table's capacity splits into ``world`` maps of >= 2 rows."""
    for name in dict.fromkeys(names):
        if not cfg.applies_to(name):
            continue
        rows = cfg.capacity_of(name)
        key = f"model.dynamic_ids.table_capacity.{name}" if name in cfg.table_capacity else "model.dynamic_ids.capacity"
        if rows % world or rows // world < 2:
            raise ConfigError(f"{key}: {rows} rows of table {name!r} must split evenly over the {world} ranks, "
                              f"at least 2 rows each (each rank owns the ids hashing to it, in its own row shard)")


def dynamic_placements(cfg: DynamicIdsConfig, names: list[str], placements: list[tuple[str, list[int]]],
                       world: int, plan: str = "") -> list[tuple[str, list[int]]]:
    """Each dynamic table placed ``row_wise`` over ranks 0..W-1 in order (its even split: rank k's shard holds rank
    k's ids): so without a plan file; a plan file (``plan``) must already say so (ConfigError naming it)."""
    check_capacities(cfg, names, world)
    want = ("row_wise", list(range(world)))
    storage = placements.storage if isinstance(placements, PlanPlacements) else None  # a plan's per-shard tiers
    for t, name in enumerate(names):
        if not cfg.applies_to(name):
            continue
        kind, ranks = placements[t]
        if plan and ((kind, list(ranks)) != want or (storage is not None and any(storage[t]))):
            raise ConfigError(f"dist.plan: {plan}: table {name!r} is a dynamic id table (model.dynamic_ids): it must "
                              f"be row_wise over ranks {want[1]} in that order on the device, the plan gives {kind} "
                              f"on {list(ranks)}{' with storage' if storage is not None and any(storage[t]) else ''} "
                              "(recstack plan --dynamic-capacity places it so)")
        if not plan:
            placements[t] = want
    return placements


class ShardedDynamicIds(DynamicIds):
    """``DynamicIds`` over the ranks of a sharded collection (module docstring); every method but ``_table_rows``
    is a collective of all ranks (on the collection's id group)."""

    collective = True

    def __init__(self, cfg: DynamicIdsConfig, feature_tables: list[str], collection: ShardedEmbeddingCollection,
                 seed: int = 0) -> None:
        self.rank, self.world = collection.rank, collection.world
        self.group, self.stats_sink, self.device = collection.ids_group, collection.stats, collection.device
        check_capacities(cfg, feature_tables, self.world)
        for t, tc in enumerate(collection.tables):
            shards = collection.shards[t]
            if cfg.applies_to(tc.name) and ([s.rank for s in shards] != list(range(self.world))
                                            or shards[0].combine != "sum"):
                raise ValueError(f"dynamic table {tc.name!r} is not row_wise over every rank in order "
                                 "(dynamic_placements)")
        super().__init__(cfg, feature_tables, collection, seed)

    def _new_map(self, name: str, on_assign: Callable[[torch.Tensor, torch.Tensor], None]) -> DynamicIdMap:
        c, w = self.cfg, self.world
        bound = -(-(c.max_candidates or c.capacity_of(name)) // w)
        return DynamicIdMap(c.capacity_of(name) // w, c.admit_after, c.eviction, c.ttl_steps, bound, on_assign)

    def _table_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """This rank's map rows [k] -> table rows: row 0 the table's default row, row r > 0 row k * n + r."""
        return torch.where(rows > 0, rows + self.rank * self.maps[name].capacity, 0)

    def _rows(self, raw: dict[str, torch.Tensor], train: bool) -> dict[str, torch.Tensor]:
        names, w = list(self.maps), self.world
        device = next(iter(raw.values())).device
        flat = {name: raw[name].reshape(-1).to(_I64).cpu() for name in names}
        orders, counts = {}, {}
        for name in names:
            owner = id_owner(flat[name], w)
            orders[name] = torch.sort(owner, stable=True)[1]  # grouped by owner, in batch order within
            counts[name] = torch.bincount(owner, minlength=w)  # [W]
        grouped = {name: flat[name][orders[name]].split(counts[name].tolist()) for name in names}  # [W] each
        sends = [torch.cat([torch.stack([counts[name][r] for name in names]), *(grouped[name][r] for name in names)]
                           ).to(self.device) for r in range(w)]  # [T counts, then each table's ids]
        recv = [m.cpu() for m in all_to_all_variable(sends, self.group, self.stats_sink, "dynamic_ids")]
        got = [m[: len(names)].tolist() for m in recv]  # [W][T] ids each rank sent here
        pieces = [m[len(names) :].split(got[r]) for r, m in enumerate(recv)]  # [W][T]
        replies: list[list[torch.Tensor]] = [[] for _ in range(w)]
        for i, name in enumerate(names):
            m = self.maps[name]
            rows = self._table_rows(name, (m.remap if train else m.lookup)(torch.cat([p[i] for p in pieces])))
            for r, part in enumerate(rows.split([g[i] for g in got])):
                replies[r].append(part)
        sent = [int(sum(counts[name][r] for name in names)) for r in range(w)]
        back = all_to_all_variable([torch.cat(x).to(self.device) for x in replies], self.group, self.stats_sink,
                                   "dynamic_ids", recv_numel=sent)
        out = {}
        per_rank = [b.cpu().split([int(counts[name][r]) for name in names]) for r, b in enumerate(back)]
        for i, name in enumerate(names):
            rows = torch.empty_like(flat[name])
            rows[orders[name]] = torch.cat([per_rank[r][i] for r in range(w)])
            out[name] = rows.view(raw[name].shape).to(device)
        return out

    def stats(self) -> dict[str, float]:
        """``DynamicIds.stats`` summed over the ranks, and ``dynamic_ids/rank_rows_in_use_max``: the most rows one
        rank's maps hold (each map holds at most C / W - 1)."""
        mine = super().stats()
        keys = sorted(mine)
        sums = torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64, device=self.device)
        most = torch.tensor([float(max((m.stats()["rows_in_use"] for m in self.maps.values()), default=0))],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.group)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        out = {k: float(v) for k, v in zip(keys, sums.tolist(), strict=True)}
        out["dynamic_ids/rank_rows_in_use_max"] = float(most.item())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Every rank's maps merged into one-process maps of the whole tables (``merge_maps``): every rank gets it,
        rank 0 writes it."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, {name: m.state_dict() for name, m in self.maps.items()}, group=self.group)
        return {"dynamic_ids": {name: merge_maps([g[name] for g in gathered]) for name in self.maps}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, where = self.saved_maps(state), str(state.get("path", "the checkpoint"))
        for name, m in self.maps.items():
            if int(saved[name]["capacity"]) != m.capacity * self.world:
                raise ConfigError(f"model.dynamic_ids.capacity: {where} holds an id map of {saved[name]['capacity']} "
                                  f"rows for table {name!r}, the config gives {m.capacity * self.world}")
            m.load_state_dict(split_map(saved[name], self.rank, self.world, where))


def merge_maps(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The W ranks' map states of one table (n rows each) -> the one-process state of a map of W * n table rows:
    ids with their table rows, each rank's per-row arrays at its rows, candidates together, counters summed
    (and kept per rank, with ``world``, for ``split_map``)."""
    n, w = int(states[0]["capacity"]), len(states)
    out: dict[str, Any] = {}
    keys = torch.cat([s["keys"] for s in states])
    rows = torch.cat([torch.where(s["key_rows"] > 0, s["key_rows"] + k * n, 0) for k, s in enumerate(states)])
    order = torch.argsort(keys)
    out["keys"], out["key_rows"] = keys[order], rows[order]
    for part in ("row_id", "last_used", "hits"):
        out[part] = torch.cat([s[part] for s in states])
    cand = torch.cat([s["cand_keys"] for s in states])
    order = torch.argsort(cand)
    out["cand_keys"] = cand[order]
    for part in ("cand_count", "cand_seen"):
        out[part] = torch.cat([s[part] for s in states])[order]
    counters = [dict(s["counters"]) for s in states]
    out.update(step=int(states[0]["step"]), capacity=n * w, world=w, rank_counters=counters,
               counters={k: sum(c[k] for c in counters) for k in counters[0]})
    return out


def split_map(state: dict[str, Any], rank: int, world: int, where: str) -> dict[str, Any]:
    """``merge_maps``' result -> rank ``rank``'s own map state (``world`` ranks, as the ranks that saved it)."""
    saved_world = int(state.get("world", 1))
    if saved_world != world:
        raise ConfigError(f"model.dynamic_ids: {where} holds id maps dealt to {saved_world} rank(s) by id hash; resume "
                          f"it with {saved_world} (this run has {world}): ids would move to other ranks and rows")
    n = int(state["capacity"]) // world
    lo = rank * n
    mine = id_owner(state["keys"], world) == rank
    cand = id_owner(state["cand_keys"], world) == rank
    out = {"keys": state["keys"][mine], "key_rows": state["key_rows"][mine] - lo,
           **{p: state[p][lo : lo + n] for p in ("row_id", "last_used", "hits")},
           **{p: state[p][cand] for p in ("cand_keys", "cand_count", "cand_seen")},
           "step": state["step"], "counters": state["rank_counters"][rank], "capacity": n}
    return out
