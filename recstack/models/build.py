"""Build a DLRM and its dense optimizer from the model's config sections and the data set's shape."""

from __future__ import annotations

import os
from typing import TextIO

import torch

from recstack.embedding import (
    EmbeddingCollection,
    FusedEmbeddingBagCollection,
    SparseOptimizer,
    SparseOptimizerConfig,
    TableConfig,
)
from recstack.embedding.mixed import MixedDimEmbeddingCollection
from recstack.embedding.qr import QRSplit
from recstack.embedding.tiered.config import MemoryConfig
from recstack.embedding.tiered.placement import build_collection, memory_budgets_set
from recstack.errors import ConfigError
from recstack.models.config import ModelConfig
from recstack.models.dlrm import DLRM
from recstack.units import format_bytes


def table_configs(table_sizes: list[int], dim: int, names: list[str] | None = None,
                  dims: dict[str, int] | None = None, zero_rows: list[int] | None = None,
                  init_bound: float = 0.0) -> list[TableConfig]:
    """``table_sizes``, ``names`` and ``zero_rows`` have one entry per sparse feature: the table it looks up, and
    the rows [0, k) of it that start at zero (the prepared set's ``reserved_rows``). Features that name the same
    table share it (a schema's ``table = ...``), so their sizes must agree. Tables have ``dim`` columns, those
    named in ``dims`` their own; ``init_bound`` > 0 is every table's uniform init bound (``TableConfig``)."""
    dims = dims or {}
    names = names or [f"t{i}" for i in range(len(table_sizes))]
    features: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        features.setdefault(name, []).append(i)
    tables = []
    for name, feats in features.items():
        sizes = {table_sizes[i] for i in feats}
        if len(sizes) != 1:
            raise ValueError(f"table {name!r} is shared by features {feats} with different sizes {sorted(sizes)}")
        reserved = min(max((zero_rows or [0] * len(table_sizes))[i] for i in feats), table_sizes[feats[0]])
        tables.append(TableConfig(name, table_sizes[feats[0]], dims.get(name, dim), tuple(feats), reserved,
                                  init_bound))
    return tables


def device_memory(device: torch.device) -> int:
    """The bytes of memory ``device`` has in all: the GPU's, or the machine's physical memory for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def check_tables_fit(tables: list[TableConfig], optimizer: SparseOptimizerConfig, device: torch.device) -> None:
    """Before allocating: the tables held in memory on ``device`` (float32 rows and the ``optimizer``'s float32
    state with each: S = 0, 1 or 2 D + 1 values per row) must fit in its memory; a ConfigError naming the largest
    table and the bytes needed and there otherwise (an absurd table size would end in an allocator error
    without either)."""
    if not tables:
        return
    width = SparseOptimizer(optimizer).state_width
    per_row = [4 * (t.embedding_dim + width(t.embedding_dim)) for t in tables]
    need = [t.num_embeddings * b for t, b in zip(tables, per_row, strict=True)]
    have = device_memory(device)
    if sum(need) <= have:
        return
    big = max(range(len(tables)), key=need.__getitem__)
    t = tables[big]
    raise ConfigError(
        f"table {t.name!r}: {t.num_embeddings:,} rows x {t.embedding_dim} need {format_bytes(need[big])} "
        f"({format_bytes(sum(need))} for all {len(tables)} tables), more than the {format_bytes(have)} of memory "
        f"on {device}; cap the tables (model.max_table_size), hash the feature into fewer rows, key it by "
        "raw ids in a table of fixed capacity (model.dynamic_ids), or keep them in "
        "memory tiers ([memory] budgets)")


def check_mlps_fit(model: ModelConfig, num_dense: int, batch_size: int,
                   device: torch.device) -> None:
    """Before allocating: both MLPs must fit in ``device``'s memory, counting 8 bytes per weight
    (the float32 weight and its gradient; an optimizer's state comes on top) and, with
    ``batch_size`` > 0, 8 per unit and row of a batch (the activation and its gradient). The top
    MLP's input (the interaction's width, known only once built) counts as 1 wide: a lower bound,
    enough to catch an absurd width (``model.top_mlp=[100000000, 1]`` would otherwise end in an
    allocator error naming neither the key nor the size). A ConfigError naming the key and the
    widest layer otherwise."""
    mlps = {"top_mlp": [1, *model.top_mlp]}
    if num_dense:
        mlps["bottom_mlp"] = [num_dense, *model.bottom_mlp]
    need = {name: [(a * b + b) * 8 + batch_size * b * 8
                   for a, b in zip(w[:-1], w[1:], strict=True)]
            for name, w in mlps.items()}
    total, have = sum(map(sum, need.values())), device_memory(device)
    if total <= have:
        return
    name = max(need, key=lambda n: max(need[n], default=0))
    layer = max(range(len(need[name])), key=need[name].__getitem__)
    raise ConfigError(
        f"model.{name}: layer {layer + 1} of {mlps[name][layer + 1]:,} units needs "
        f"{format_bytes(need[name][layer])} ({format_bytes(total)} for both MLPs: weights and "
        f"gradients, and the activations of a batch of {batch_size} rows), more than the "
        f"{format_bytes(have)} of memory on {device}")


def build_model(
    model: ModelConfig,
    sparse_optim: SparseOptimizerConfig,
    num_dense: int,
    table_sizes: list[int],
    *,
    seed: int,
    device: torch.device | str = "cpu",
    names: list[str] | None = None,
    memory: MemoryConfig | None = None,
    log: TextIO | None = None,
    tables_on_meta: bool = False,
    zero_rows: list[int] | None = None,
    batch_size: int = 0,
) -> DLRM:
    """Dense layers are initialised from torch's global RNG (seeded by the caller), tables from per-table
    generators seeded by ``seed``, so the same seeds give the same model on any placement. With ``memory``
    budgets the placement of tables over memory tiers is printed to ``log`` (standard output by default).
    ``tables_on_meta``: the embedding collection is built on the ``meta`` device, shapes without values, for a
    model whose tables will be sharded (``recstack.distributed.parallelize.shard_model`` builds the shards);
    the dense layers are on ``device`` all the same, drawn in the same order. ``zero_rows`` (one per feature):
    rows [0, k) of its table start at zero (``PreparedDataset.reserved_rows``; not in quotient-remainder tables,
    whose rows are shared by many ids). ``batch_size``: the rows of a training batch, counted with
    the MLPs' weights in the memory check before anything is allocated (0: the weights only, for a
    model that is loaded)."""
    model.check_dense(num_dense)  # the bottom MLP's widths, now that the data's dense features are known
    check_mlps_fit(model, num_dense, batch_size, torch.device(device))
    names = names or [f"t{i}" for i in range(len(table_sizes))]
    model.check_table_names(names)
    tables = table_configs(table_sizes, model.table_width, names, model.table_dims, zero_rows,
                           model.embedding_init_bound)
    qr = QRSplit.build(tables, model.qr_collisions, model.qr_threshold, model.qr_operation)
    if qr is not None:  # the collection holds the quotient and remainder tables
        tables = list(qr.tables)
    emb: EmbeddingCollection
    mixed = len({t.embedding_dim for t in tables}) > 1
    budgets = memory is not None and memory_budgets_set(memory)
    if budgets and mixed:
        raise ConfigError("model.table_dims: tables of different dims cannot be placed over memory tiers "
                          "([memory] budgets); give every table model.embedding_dim or drop the budgets")
    if not budgets and not tables_on_meta:  # (sharded tables: each rank builds its shards, planned to fit)
        check_tables_fit(tables, sparse_optim, torch.device(device))
    if budgets and not tables_on_meta:  # tables that do not fit get cached tiers (plan printed); sharded, each
        # rank places its own shards instead (``recstack.distributed.tiered_shards``)
        assert memory is not None
        emb = build_collection(memory, tables, sparse_optim, seed, device, log)
    elif mixed:  # one fused collection per dim
        emb = MixedDimEmbeddingCollection(tables, sparse_optim, seed=seed, device="meta" if tables_on_meta else device)
    else:
        emb = FusedEmbeddingBagCollection(tables, sparse_optim, seed=seed, device="meta" if tables_on_meta else device)
    net = DLRM(model, num_dense, emb, qr)
    for name, child in net.named_children():  # the collection was built where it belongs
        if name != "embeddings":
            child.to(device)
    return net

