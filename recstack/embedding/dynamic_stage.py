"""The input stage of dynamic id tables: a batch's raw ids of the dynamic tables -> their rows.

``DynamicIds`` holds one ``DynamicIdMap`` per dynamic table (features sharing a table share its map) and turns a
``Batch`` whose dynamic features carry raw int64 ids into one whose ids are rows of the model's tables:
``remap_batch`` on the training path (admits and evicts, in the training thread, just before the step: the map
a checkpoint saves is then exactly the one the saved weights were trained with), ``lookup_batch`` on the
evaluation path (no admission: unknown ids score with the default row 0). A row given to a new id is
re-initialised and its optimizer state reset through ``EmbeddingCollection.reset_rows``, with values keyed by
(seed, table, raw id) (``dynamic.id_values``), so a resumed run, and a sharded one whose ids land in other rows,
give an id the same initial vector. Under torchrun the maps are split over the ranks by id hash
(``recstack.distributed.dynamic_dist.ShardedDynamicIds``, a subclass that overrides ``_rows`` and the state).

A stream loop applies it the same way: ``batch = dynamic.remap_batch(batch)`` before each training step,
``dynamic.lookup_batch`` for progressive evaluation before training on a window, and ``dynamic`` as one more
``Stateful`` of the checkpoint (key ``dynamic_ids``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding.collection import EmbeddingCollection, init_bound
from recstack.embedding.dynamic import DynamicIdMap, DynamicIdsConfig, id_values
from recstack.errors import ConfigError


def dynamic_table_layout(cfg: DynamicIdsConfig, feature_tables: list[str], table_sizes: list[int],
                         caps: list[int] | None, zero_rows: list[int]
                         ) -> tuple[list[int], list[int] | None, list[int]]:
    """Per feature: (table sizes, loader caps, zero rows) with the dynamic tables at ``capacity`` rows, no modulo
    for their ids (cap 0: the raw id reaches the map) and their row 0 (the default row) at zero."""
    if not cfg.enabled:
        return table_sizes, caps, zero_rows
    cfg.check_table_names(feature_tables)
    dyn = [cfg.applies_to(name) for name in feature_tables]
    sizes = [cfg.capacity_of(t) if d else n for d, n, t in zip(dyn, table_sizes, feature_tables, strict=True)]
    out_caps = None if caps is None and not any(dyn) else [
        0 if d else (caps[i] if caps is not None else 0) for i, d in enumerate(dyn)]
    zeros = [max(1, z) if d else z for d, z in zip(dyn, zero_rows, strict=True)]
    return sizes, out_caps, zeros


class DynamicIds:
    """One ``DynamicIdMap`` per dynamic table of ``feature_tables`` (one table name per feature); rows reused
    for new ids are reset in ``collection`` (which must ``resets_rows``; None: lookups only)."""

    # Whether remap_batch / lookup_batch / stats / state_dict are collectives (sharded maps under torchrun): then
    # only the thread that issues the step's collectives may call them, never the loader's thread.
    collective: bool = False

    def __init__(self, cfg: DynamicIdsConfig, feature_tables: list[str], collection: EmbeddingCollection | None,
                 seed: int = 0) -> None:
        if collection is not None and not collection.resets_rows:
            raise ConfigError(f"model.dynamic_ids: the embedding collection {type(collection).__name__} cannot "
                              "re-initialise rows; not supported with dynamic ids")
        self.cfg, self.seed, self.collection = cfg, seed, collection
        self.features: dict[str, list[int]] = {}
        for f, name in enumerate(feature_tables):
            if cfg.applies_to(name):
                self.features.setdefault(name, []).append(f)
        names = list(dict.fromkeys(feature_tables))
        self.maps = {name: self._new_map(name, self._resetter(name, names.index(name))) for name in self.features}

    def _new_map(self, name: str, on_assign: Callable[[torch.Tensor, torch.Tensor], None]) -> DynamicIdMap:
        c = self.cfg
        return DynamicIdMap(c.capacity_of(name), c.admit_after, c.eviction, c.ttl_steps, c.max_candidates, on_assign)

    @property
    def dynamic_features(self) -> set[int]:
        """The features whose ids are raw ids of a dynamic table."""
        return {f for feats in self.features.values() for f in feats}

    def _table_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows [k] of ``name``'s map -> rows of the model's table (the same here; a rank's shard when sharded)."""
        return rows

    def _resetter(self, name: str, index: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        collection = self.collection
        if collection is None:
            return lambda rows, ids: None
        table = next(t for t in collection.tables if t.name == name)  # the whole table: its init bound
        key, dim, bound = self.seed * 1_000_003 + index, table.embedding_dim, init_bound(table)

        def reset(rows: torch.Tensor, ids: torch.Tensor) -> None:
            collection.reset_rows(name, self._table_rows(name, rows), id_values(ids, key, dim, bound))
        return reset

    def _rows(self, raw: dict[str, torch.Tensor], train: bool) -> dict[str, torch.Tensor]:
        """{table: its raw ids in the batch [n]} -> {table: their rows [n]}: one step of every map (``train``),
        else lookups."""
        return {name: (m.remap if train else m.lookup)(raw[name]) for name, m in self.maps.items()}

    def _apply(self, batch: Batch, train: bool) -> Batch:
        s = batch.sparse
        if not self.maps:
            return batch
        bounds = s.feature_bounds.tolist()  # [F + 1]
        spans = {name: [(bounds[f], bounds[f + 1]) for f in feats] for name, feats in self.features.items()}
        # every feature of a table: one call, one step
        rows = self._rows({name: torch.cat([s.ids[a:b] for a, b in sp]) for name, sp in spans.items()}, train)
        ids = s.ids.clone()
        for name, sp in spans.items():
            at = 0
            for a, b in sp:
                ids[a:b] = rows[name][at : at + b - a]
                at += b - a
        return dataclasses.replace(batch, sparse=SparseFeatures(ids, s.offsets, s.num_features, s.weights))

    def remap_batch(self, batch: Batch) -> Batch:
        """Training: raw ids -> rows, admitting, evicting and resetting reused rows (one step of every map)."""
        return self._apply(batch, True)

    def lookup_batch(self, batch: Batch) -> Batch:
        """Evaluation / serving: raw ids -> rows, unknown ids -> row 0; the maps do not change."""
        return self._apply(batch, False)

    def stats(self) -> dict[str, float]:
        """``dynamic_ids/<stat>`` summed over the tables (``DynamicIdMap.stats``), plus ``dynamic_ids/collisions``,
        0 by construction (checked: every admitted id has a row of its own)."""
        out: dict[str, float] = {}
        for m in self.maps.values():
            for k, v in m.stats().items():
                out[f"dynamic_ids/{k}"] = out.get(f"dynamic_ids/{k}", 0) + v
        out["dynamic_ids/collisions"] = sum(m.key_rows.numel() - int(m.key_rows.unique().numel())
                                            for m in self.maps.values())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"dynamic_ids": {name: m.state_dict() for name, m in self.maps.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = self.saved_maps(state)
        for name, m in self.maps.items():
            m.load_state_dict(saved[name])

    def saved_maps(self, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """A checkpoint's {table: id map state}, checked to hold exactly this config's dynamic tables."""
        saved = state.get("dynamic_ids")
        if saved is None or set(saved) != set(self.maps):
            have = "none" if saved is None else ", ".join(sorted(saved)) or "none"
            raise ConfigError(f"model.dynamic_ids: {state.get('path', 'the checkpoint')} holds id maps of tables "
                              f"[{have}], the config makes [{', '.join(sorted(self.maps))}] dynamic")
        return saved
