"""An EmbeddingCollection whose tables are sharded over processes (model parallel) or replicated.

Per step, on every rank (B = local batch, F features, W ranks):
  1. input distribution: each (feature, shard) pair's ids of the local samples go to the shard's rank
     (row-wise shards get only the ids in their rows), one variable-size all-to-all with the local B;
  2. the owner looks up all pairs it holds for the global batch with fused local tables;
  3. output all-to-all: each rank gets back the pooled [B_r, d] pieces of its own samples, through a codec
     (fp32, fp16, bf16, fp8, int8, or an error-bounded one), and rebuilds [B, F, D] (sum of row shards,
     concatenation of column shards); replicated tables are looked up locally;
  4. backward: the gradients of those pieces travel back the same way (own codec; with
     ``aggregate_gradients`` one row per distinct id of one-hot features) and the owner applies the fused
     sparse optimizer; replicated tables all-reduce their gradient and update every replica.
Gradients are scaled by 1/W to match DDP's averaging of the dense part, so W ranks with batch B reproduce
one process with batch W*B. A rank may have no samples (B = 0: the last, short evaluation batch) and still
takes part in every collective; a row shard may hold no rows (row blocks of ceil(rows / k) rows leave the
last ones empty for small tables): it gets no ids and its partial sums are zero.

Step 1 is ``input_dist`` (-> ``RoutedIds``: ``prepare_input``, local, then ``exchange_input``, the collective;
``recstack.distributed.input_dist``); forward runs it itself unless the input pipeline
(``recstack.distributed.pipeline``) ran it a batch ahead for this very batch and handed the result over with
``use_routed`` (TorchRec's input_dist / compute / output_dist split). The local shards live in collections made
by a factory (``local_collection``; fused in memory by default) and drawn with the rows the whole tables have
there (``init_block``), one chunk at a time: the model's own collection can be a shape-only one on the
``meta`` device, and no rank ever holds rows it does not own.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

from recstack.compression.base import Codec
from recstack.data.batch import SparseFeatures
from recstack.distributed import agreement
from recstack.distributed.comm import CommStats, PooledExchange
from recstack.distributed.input_dist import PreparedInput, RoutedIds, exchange_input, prepare_input
from recstack.distributed.planner.inputs import TableSpec
from recstack.distributed.planner.plan import PlanPlacements
from recstack.distributed.sharding import Shard, table_shards
from recstack.embedding.collection import EmbeddingCollection, TableConfig, init_block
from recstack.embedding.fused import FusedEmbeddingBagCollection, TableInit
from recstack.embedding.sparse_optim import SparseOptimizerConfig
from recstack.embedding.tiered.collection import TieredEmbeddingCollection
from recstack.errors import ConfigError

# One group of a rank's local shards (one per shard dim): its tables, and init(i, out) writing table i's initial
# rows into ``out`` [rows, dim].
LocalGroup = tuple[list[TableConfig], TableInit]
# (every group of this rank, optimizer, device) -> the collection holding each group, in order. The factory gets
# every group at once, so that it can place them together (memory budgets are per rank): how the shards are held
# (in memory, or in cached tiers: ``recstack.distributed.tiered_shards``) is the factory's.
LocalCollection = Callable[[list[LocalGroup], SparseOptimizerConfig, torch.device], list[EmbeddingCollection]]


def fused_local(groups: list[LocalGroup], optimizer: SparseOptimizerConfig,
                device: torch.device) -> list[EmbeddingCollection]:
    """The default local collections: every local shard in memory on ``device``."""
    return [FusedEmbeddingBagCollection(tables, optimizer, device=device, init=init) for tables, init in groups]


class _GatherPieces(torch.autograd.Function):
    """Pooled group outputs [B_g, n_g, d_g] -> one flat buffer of the pieces ``(group, row0, row1, slot)``
    (pooled[group][row0:row1, slot], [row1 - row0, d_g] each), in order; gradients scaled by ``scale``.

    Autograd through per-piece slicing would give every piece a backward that allocates a zero tensor of its
    whole group and adds into it (52 of 1.7 MB per step for the Kaggle model on 2 ranks). The pieces tile
    every group exactly once, so backward writes each piece's gradient into one uninitialised buffer."""

    @staticmethod
    def forward(ctx, pieces: list[tuple[int, int, int, int]], scale: float,
                *pooled: torch.Tensor) -> torch.Tensor:
        ctx.pieces, ctx.scale, ctx.shapes = pieces, scale, [p.shape for p in pooled]
        ctx.tiled = sum((r1 - r0) * pooled[g].shape[2] for g, r0, r1, _ in pieces) == sum(p.numel() for p in pooled)
        if not pieces:
            return pooled[0].new_zeros(0)
        return torch.cat([pooled[g][r0:r1, s].reshape(-1) for g, r0, r1, s in pieces])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        make = grad.new_empty if ctx.tiled else grad.new_zeros
        grads = [make(shape) for shape in ctx.shapes]
        pos = 0
        for g, r0, r1, s in ctx.pieces:
            n = (r1 - r0) * ctx.shapes[g][2]
            grads[g][r0:r1, s] = grad[pos : pos + n].view(r1 - r0, ctx.shapes[g][2])
            pos += n
        if ctx.scale != 1.0:
            for x in grads:
                x.mul_(ctx.scale)
        return None, None, *grads


class ReplicatedEmbeddingBagCollection(FusedEmbeddingBagCollection):
    """Data-parallel tables: the dense table gradient is all-reduced (mean over ranks) before the update, so
    every replica stays identical. Only sensible for small tables."""

    def __init__(self, tables: list[TableConfig], optimizer: SparseOptimizerConfig, init: TableInit,
                 device: torch.device | str, group: dist.ProcessGroup | None, stats: CommStats) -> None:
        super().__init__(tables, optimizer, device=device, init=init)
        self.group, self.stats = group, stats

    def apply_gradients(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        t0 = time.perf_counter()
        dense = torch.zeros_like(self.weight)
        dense.index_add_(0, rows, grads)  # [R, D]
        dist.all_reduce(dense, group=self.group)
        dense /= dist.get_world_size(self.group)
        self.stats.add("allreduce_emb", dense.numel() * dense.element_size(), time.perf_counter() - t0)
        touched = dense.abs().sum(1).nonzero().squeeze(1)  # rows no rank touched keep their state
        self.optimizer.step(self.weight, self.optimizer_state(), touched, dense[touched])


class ShardedEmbeddingCollection(EmbeddingCollection):
    # Tables of several dims (``model.table_dims``): the local shards are grouped by dim anyway, and the pooled
    # output is then flat, [B, sum of feature dims] (see ``EmbeddingCollection.forward``).
    holds_mixed_dims = True

    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: SparseOptimizerConfig,
        placements: list[tuple[str, list[int]]],
        seed: int = 0,
        device: torch.device | str = "cpu",
        forward_codec: str | Codec = "fp32",
        backward_codec: str | Codec = "fp32",
        ranks_per_node: int | None = None,
        aggregate_gradients: bool = False,
        local_collection: LocalCollection = fused_local,
        timeout_s: float | None = None,
    ) -> None:
        """placements[t] = (sharding type, ranks) for table t, as in a ShardingPlan. ``aggregate_gradients``:
        the backward exchange sends one row per distinct id of one-hot features (grad_aggregation.py).
        ``local_collection`` builds the collections of this rank's shards (one per shard dim); the tables'
        rows come from ``init_table`` with ``seed``, only the shards of this rank are ever drawn. ``timeout_s``:
        the bound of every collective of the collection's process groups (``dist.timeout_s``; None: torch's
        default, 30 minutes), so a stopped peer makes them fail instead of waiting that long."""
        super().__init__(tables, optimizer)
        if len(placements) != len(tables):
            raise ValueError(f"{len(placements)} placements for {len(tables)} tables")
        if isinstance(placements, PlanPlacements):  # from a plan file: check it against these tables' sizes,
            # on every rank alike and before the first collective
            placements.check([TableSpec(t.name, t.num_embeddings, t.embedding_dim) for t in tables])
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device)
        # Separate groups so that embedding collectives never interleave with DDP's or each other's.
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        self.ids_group = dist.new_group(timeout=timeout)
        self.out_group = dist.new_group(timeout=timeout)
        self.dp_group = dist.new_group(timeout=timeout)
        self.stats = CommStats()
        self.forward_codec, self.backward_codec = forward_codec, backward_codec
        self.aggregate_gradients = aggregate_gradients
        self._routed: RoutedIds | None = None  # handed over by the input pipeline for the next forward
        self.shards: list[list[Shard]] = [
            table_shards(i, t.num_embeddings, t.embedding_dim, kind, list(ranks), self.world, ranks_per_node)
            for i, (t, (kind, ranks)) in enumerate(zip(tables, placements, strict=True))
        ]
        self.sharding = [kind for kind, _ in placements]
        # (feature, shard) pairs served over the network, grouped by owner, in a global canonical order.
        self.pairs: list[list[tuple[int, Shard]]] = [[] for _ in range(self.world)]
        for f, t in enumerate(self.feature_table):
            for s in self.shards[t]:
                if s.combine != "local":
                    self.pairs[s.rank].append((f, s))
        self._build_local_tables(seed, local_collection)

    def _build_local_tables(self, seed: int, local_collection: LocalCollection) -> None:
        mine = self.pairs[self.rank]
        by_dim: dict[int, list[int]] = {}  # shard dim -> indices into ``mine``
        for i, (_, s) in enumerate(mine):
            by_dim.setdefault(s.dim, []).append(i)
        self.groups = torch.nn.ModuleDict()
        self.group_pairs: dict[str, list[int]] = {}
        self.pair_slot: list[tuple[str, int]] = [("", 0)] * len(mine)  # pair -> (group, local feature index)
        specs: list[LocalGroup] = []
        for dim, idxs in sorted(by_dim.items()):
            shard_ids: dict[tuple[int, int], list[int]] = {}  # one local table per shard, shared by its pairs
            for local_f, i in enumerate(idxs):
                s = mine[i][1]
                shard_ids.setdefault((s.table, s.index), []).append(local_f)
            local_tables, held = [], []
            for (t, si), feats in shard_ids.items():
                s = self.shards[t][si]
                local_tables.append(TableConfig(f"{self.tables[t].name}.shard{si}", s.rows, dim, tuple(feats)))
                held.append(s)

            def init(i: int, out: torch.Tensor, held: list[Shard] = held) -> None:  # the whole table's rows
                s = held[i]
                init_block(self.tables[s.table], seed, s.table, (s.row0, s.row1), (s.col0, s.col1), out=out)

            key = f"d{dim}"
            specs.append((local_tables, init))
            self.group_pairs[key] = idxs
            for local_f, i in enumerate(idxs):
                self.pair_slot[i] = (key, local_f)
        error: Exception | None = None
        colls: list[EmbeddingCollection] = []
        try:
            colls = local_collection(specs, self.optimizer.config, self.device)
        except Exception as e:  # decided together below: a rank that raised alone would leave the rest waiting
            error = e
        agreement.fail_together(error, "build its embedding shards")
        for key, coll in zip(self.group_pairs, colls, strict=True):
            self.groups[key] = coll
        dp_tables = [t for t, kind in enumerate(self.sharding) if kind == "data_parallel"]
        self.dp_features = [f for f, t in enumerate(self.feature_table) if t in dp_tables]
        self.replicated: ReplicatedEmbeddingBagCollection | None = None
        if dp_tables:
            dp_dims = {self.tables[t].embedding_dim for t in dp_tables}
            if len(dp_dims) > 1:  # the replicas live in one fused weight of one dim
                low = min(dp_dims)
                odd = next(self.tables[t] for t in dp_tables if self.tables[t].embedding_dim != low)
                raise ConfigError(f"model.table_dims: data_parallel table {odd.name!r} has dim {odd.embedding_dim}, "
                                  f"other data_parallel tables {low}: replicated tables share one weight of one "
                                  "dim (give them one dim, or shard them table_wise / row_wise)")
            remap = {f: i for i, f in enumerate(self.dp_features)}
            cfgs = [TableConfig(self.tables[t].name, self.tables[t].num_embeddings, self.tables[t].embedding_dim,
                                tuple(remap[f] for f in self.tables[t].features)) for t in dp_tables]

            def whole(i: int, out: torch.Tensor) -> None:
                t = self.tables[dp_tables[i]]
                init_block(t, seed, dp_tables[i], (0, t.num_embeddings), (0, t.embedding_dim), out=out)

            self.replicated = ReplicatedEmbeddingBagCollection(cfgs, self.optimizer.config, whole, self.device,
                                                               self.dp_group, self.stats)
        self.resets_rows = all(cast(EmbeddingCollection, m).resets_rows for m in self.groups.values())

    @torch.no_grad()
    def reset_rows(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Rows [k] of table ``name`` (numbered in the whole table, all held by this rank's shards: dynamic ids'
        rows are reset by their owner) get ``values`` [k, dim] and a new row's optimizer state."""
        t = next(i for i, tc in enumerate(self.tables) if tc.name == name)
        done = torch.zeros(rows.numel(), dtype=torch.bool)
        for m in self.groups.values():
            group = cast(EmbeddingCollection, m)
            for tc in group.tables:
                if tc.name.startswith(f"{name}.shard"):
                    s = self.shards[t][int(tc.name.rsplit("shard", 1)[1])]
                    mine = (rows >= s.row0) & (rows < s.row1)
                    group.reset_rows(tc.name, rows[mine] - s.row0, values[mine][:, s.col0 : s.col1])
                    done |= mine
        if not bool(done.all()):
            raise ValueError(f"reset_rows: rank {self.rank} holds no shard of table {name!r} with rows "
                             f"{rows[~done].tolist()}")

    # -- forward -----------------------------------------------------------------------------------------
    def prepare_input(self, sparse: SparseFeatures) -> PreparedInput:
        """What this rank sends in the input distribution of ``sparse`` (``input_dist.prepare_input``): local
        work, no collective; the input pipeline runs it in the loader's thread, a batch ahead."""
        return prepare_input(sparse, self.pairs)

    def exchange_input(self, prep: PreparedInput) -> RoutedIds:
        """Collective on ``ids_group``, from the training thread only (every rank issues its collectives in one
        program order): send each pair's ids of this rank's samples to the pair's owner. The gradient groups
        (``aggregate_gradients``) are made only with grad enabled, so evaluation batches get none."""
        groups = self.aggregate_gradients and torch.is_grad_enabled()
        return exchange_input(prep, self.pairs, self.ids_group, self.stats, groups)

    def input_dist(self, sparse: SparseFeatures) -> RoutedIds:
        """Both halves at once (``prepare_input``, then ``exchange_input``): what forward does without the
        input pipeline."""
        return self.exchange_input(self.prepare_input(sparse))

    def _group_inputs(self, routed: RoutedIds) -> dict[str, SparseFeatures]:
        """The input of each local collection: the ids of its pairs over every rank's samples."""
        out = {}
        for key, idxs in self.group_pairs.items():
            ids = torch.cat([routed.pairs[i][0] for i in idxs])
            lens = torch.cat([routed.pairs[i][1] for i in idxs])
            offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
            pw = routed.weights
            w = (torch.cat([x for i in idxs if (x := pw[i]) is not None])  # all or none are weighted
                 if pw and pw[0] is not None else None)
            out[key] = SparseFeatures(ids, offsets, len(idxs), w)
        return out

    def announce(self, routed: RoutedIds) -> None:
        """A training batch routed ahead (``input_dist`` in the input pipeline): its local collections learn
        their coming ids, so that cached tiers fetch the rows this rank owns while the batch before computes."""
        hooks = {key: h for key, m in self.groups.items() if (h := cast(EmbeddingCollection, m).ids_hook())}
        if hooks:
            for key, sparse in self._group_inputs(routed).items():
                if key in hooks:
                    hooks[key](sparse)

    def use_routed(self, routed: RoutedIds) -> None:
        """The next forward's batch was distributed ahead (``input_dist``): forward uses ``routed`` once instead
        of communicating. The main thread hands it over right before that forward."""
        if self._routed is not None:
            raise RuntimeError("routed ids handed over twice: the previous batch's were never used by a forward")
        self._routed = routed

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        if sparse.num_features != self.num_features:
            raise ValueError(f"got {sparse.num_features} sparse features, collection has {self.num_features}")
        b = sparse.batch_size
        routed, self._routed = self._routed, None  # consumed once
        if routed is None:
            routed = self.input_dist(sparse)
        elif routed.ids is not sparse.ids:
            raise RuntimeError("the routed ids handed over were distributed for another batch than this forward's")
        batch_sizes, grad_groups = routed.batch_sizes, routed.grad_groups
        pooled = {key: self.groups[key](sp) for key, sp in self._group_inputs(routed).items()}  # [Bg, n_group, d]
        # Output all-to-all: rank r gets rows [start_r, end_r) of every owned pair.
        bounds = [0]
        for br in batch_sizes:
            bounds.append(bounds[-1] + br)
        mine = self.pairs[self.rank]
        keys = list(pooled)
        group_index = {k: g for g, k in enumerate(keys)}
        pieces = [(group_index[self.pair_slot[i][0]], bounds[r], bounds[r + 1], self.pair_slot[i][1])
                  for r in range(self.world) for i in range(len(mine))]
        # gradients scaled by 1/W to match DDP's mean over ranks
        gathered = (_GatherPieces.apply(pieces, 1.0 / self.world, *(pooled[k] for k in keys)) if keys
                    else torch.zeros(0, device=self.device))
        anchor = torch.zeros(0, device=self.device, requires_grad=torch.is_grad_enabled() and self.training)
        send_flat = torch.cat([anchor, gathered])  # the anchor: every rank joins the backward exchange
        send_shapes = [[(batch_sizes[r], s.dim) for _, s in mine] for r in range(self.world)]
        recv_shapes = [[(b, s.dim) for _, s in self.pairs[r]] for r in range(self.world)]
        exchange = PooledExchange(send_shapes, recv_shapes, self.out_group, self.forward_codec,
                                  self.backward_codec, self.stats)
        exchange.grad_groups = grad_groups if anchor.requires_grad else None
        recv = exchange(send_flat) if any(self.pairs) else send_flat
        received: dict[tuple[int, int, int], torch.Tensor] = {}
        owners = [(f, s) for r in range(self.world) for f, s in self.pairs[r]]
        # one split (its backward is one cat) rather than a slice per piece (a zero-filled buffer each)
        for (f, s), piece in zip(owners, torch.split(recv, [b * s.dim for _, s in owners]), strict=True):
            received[(f, s.table, s.index)] = piece.view(b, s.dim)
        local = None
        if self.replicated is not None:
            local = self.replicated(sparse.select(self.dp_features))  # [B, F_dp, D]
        outs = []
        dp_pos = {f: i for i, f in enumerate(self.dp_features)}
        for f, t in enumerate(self.feature_table):
            shards = self.shards[t]
            kind = shards[0].combine
            if kind == "local":  # a data-parallel table: looked up above
                assert local is not None
                outs.append(local[:, dp_pos[f]])
            elif kind == "concat":
                outs.append(torch.cat([received[(f, t, s.index)] for s in shards], dim=1))
            elif kind == "sum":
                acc = received[(f, t, 0)]
                for s in shards[1:]:
                    acc = acc + received[(f, t, s.index)]
                outs.append(acc)
            else:
                outs.append(received[(f, t, 0)])
        return torch.cat(outs, dim=1) if self.mixed_dims else torch.stack(outs, dim=1)  # [B, sum d_f] / [B, F, D]

    # -- capabilities of the collection interface ------------------------------------------------------------
    def defer_updates(self) -> None:
        """Collective: every rank defers, or every rank raises (a rank with shards in cached tiers refuses)."""
        error: Exception | None = None
        try:
            for c in [*self.groups.values(), *([self.replicated] if self.replicated is not None else [])]:
                cast(EmbeddingCollection, c).defer_updates()
        except Exception as e:  # decided together: a rank that raised alone would leave the rest waiting
            error = e
        agreement.fail_together(error, "defer its embedding updates (optim.max_grad_norm)")

    def deferred_sq_norm(self) -> float:
        """Collective: each element of a sharded table lives on one rank, so the shards' sums add up over the
        ranks (one all-reduce of a scalar); the replicated tables' rows, equal on every rank, count once."""
        owned = sum((cast(EmbeddingCollection, m).deferred_sq_norm() for m in self.groups.values()), 0.0)
        total = torch.tensor([owned], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.dp_group)
        return float(total) + (self.replicated.deferred_sq_norm() if self.replicated is not None else 0.0)

    def apply_deferred(self, scale: float) -> None:
        for c in [*self.groups.values(), *([self.replicated] if self.replicated is not None else [])]:
            cast(EmbeddingCollection, c).apply_deferred(scale)

    def pop_counters(self) -> dict[str, float]:
        """Bytes and seconds per collective, and this rank's local collections' counters (the cache requests,
        hits and fetch seconds of shards in cached tiers) summed over them."""
        out = self.stats.pop()
        for m in self.groups.values():
            for k, v in cast(EmbeddingCollection, m).pop_counters().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def wire_layout(self) -> list[list[tuple[int, int, int, int, int, int]]]:
        return [[(f, s.table, s.row0, s.row1, s.col0, s.col1) for f, s in per_rank] for per_rank in self.pairs]

    # -- inspection ----------------------------------------------------------------------------------------
    def local_shards(self) -> list[tuple[str, Shard, torch.Tensor, dict[str, torch.Tensor]]]:
        """(table name, shard, weight [rows, d], optimizer state {part: [rows] or [rows, d]}) of every shard this
        rank holds: the model-parallel ones in group order, then each replicated table as one whole-table shard
        (table index -1, on this rank). In-memory shards give views: writing into them writes the rows (a
        checkpoint load). Shards in cached tiers give CPU copies of their rows (their caches flushed into their
        stores first); to load rows into them, write into the copies, then hand them to ``store_local_shards``."""
        out = []
        for m in self.groups.values():
            group = cast(EmbeddingCollection, m)
            for i, tc in enumerate(group.tables):
                name, si = tc.name.rsplit(".shard", 1)
                t = next(j for j, x in enumerate(self.tables) if x.name == name)
                state: dict[str, torch.Tensor] = {}
                if isinstance(group, TieredEmbeddingCollection):
                    weight, acc = group.table_state(tc.name)
                    if acc is not None:
                        state["accumulator"] = acc
                elif isinstance(group, FusedEmbeddingBagCollection):
                    lo, hi = int(group.table_offsets[i]), int(group.table_offsets[i + 1])
                    weight = group.weight[lo:hi]
                    state = {k: v[lo:hi] for k, v in group.optimizer_state().items()}
                else:
                    raise NotImplementedError(f"local_shards: cannot read the rows of a {type(group).__name__}")
                out.append((name, self.shards[t][int(si)], weight, state))
        if self.replicated is not None:
            rep = self.replicated
            for i, tc in enumerate(rep.tables):
                lo, hi = int(rep.table_offsets[i]), int(rep.table_offsets[i + 1])
                full = Shard(-1, 0, self.rank, 0, tc.num_embeddings, 0, tc.embedding_dim, "local")
                out.append((tc.name, full, rep.weight[lo:hi],
                            {k: v[lo:hi] for k, v in rep.optimizer_state().items()}))
        return out

    def store_local_shards(self, shards: list[tuple[str, Shard, torch.Tensor, dict[str, torch.Tensor]]]) -> None:
        """Load the rows written into the copies ``local_shards`` gave (in its order) into the shards held in
        cached tiers (their caches start empty); in-memory shards were written through their views already."""
        at = 0
        for m in self.groups.values():
            group = cast(EmbeddingCollection, m)  # a ModuleDict of local collections: torch types its values Module
            mine, at = shards[at : at + len(group.tables)], at + len(group.tables)
            if group.stores_rows_in_files:
                weight = torch.cat([w for _, _, w, _ in mine])
                accs = [st["accumulator"] for _, _, _, st in mine if "accumulator" in st]
                group.restore_tensors(weight, torch.cat(accs) if accs else None)

    def table_weight(self, name: str) -> torch.Tensor:
        """The full table, gathered from its shards (a collective: every rank must call it)."""
        t = next(i for i, tc in enumerate(self.tables) if tc.name == name)
        if self.sharding[t] == "data_parallel":
            assert self.replicated is not None  # it holds every data-parallel table
            return self.replicated.table_weight(name).clone()
        parts = []
        for m in self.groups.values():
            coll = cast(EmbeddingCollection, m)  # a ModuleDict of local collections: torch types its values Module
            for tc in coll.tables:
                if tc.name.startswith(f"{name}.shard"):
                    si = int(tc.name.rsplit("shard", 1)[1])
                    parts.append((si, coll.table_weight(tc.name).detach().cpu()))
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, parts)
        full = torch.zeros(self.tables[t].num_embeddings, self.tables[t].embedding_dim)
        for rank_parts in gathered:
            for si, w in rank_parts:
                s = self.shards[t][si]
                full[s.row0 : s.row1, s.col0 : s.col1] = w
        return full
