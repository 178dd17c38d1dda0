"""The input stage of dynamic id tables: a batch's raw ids of the dynamic tables -> their rows.

``DynamicIds`` holds one ``DynamicIdMap`` per dynamic table (features sharing a table share its map) and turns a
``Batch`` whose dynamic features carry raw int64 ids into one whose ids are rows of the model's tables:
``remap_batch`` on the training path (admits and evicts, in the training thread, just before the step: the map
a checkpoint saves is then exactly the one the saved weights were trained with), ``lookup_batch`` on the
evaluation path (no admission: unknown ids score with the default row 0). A row given to a new id is
re-initialised and its optimizer state reset through ``EmbeddingCollection.reset_rows``, with values drawn from
a generator keyed by (seed, table, admission serial), so a resumed run draws the same values.

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
from recstack.embedding.collection import EmbeddingCollection
from recstack.embedding.dynamic import DynamicIdMap, DynamicIdsConfig
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
    for new ids are reset in ``collection`` (which must ``resets_rows``)."""

    def __init__(self, cfg: DynamicIdsConfig, feature_tables: list[str], collection: EmbeddingCollection | None,
                 seed: int = 0, world: int = 1) -> None:
        if world > 1:
            raise ConfigError(f"model.dynamic_ids: not supported under torchrun yet (world size {world}); train "
                              "dynamic id tables in one process")
        if collection is not None and not collection.resets_rows:
            raise ConfigError(f"model.dynamic_ids: the embedding collection {type(collection).__name__} cannot "
                              "re-initialise rows (memory tiers, sharded tables); not supported with dynamic ids yet")
        self.cfg, self.seed, self.collection = cfg, seed, collection
        self.features: dict[str, list[int]] = {}
        for f, name in enumerate(feature_tables):
            if cfg.applies_to(name):
                self.features.setdefault(name, []).append(f)
        names = list(dict.fromkeys(feature_tables))
        self.maps = {name: DynamicIdMap(cfg.capacity_of(name), cfg.admit_after, cfg.eviction, cfg.ttl_steps,
                                        cfg.max_candidates, self._resetter(name, names.index(name)))
                     for name in self.features}

    @property
    def dynamic_features(self) -> set[int]:
        """The features whose ids are raw ids of a dynamic table."""
        return {f for feats in self.features.values() for f in feats}

    def _resetter(self, name: str, index: int) -> Callable[[torch.Tensor, int], None]:
        def reset(rows: torch.Tensor, serial: int) -> None:
            if self.collection is None:
                return
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + index) * 1_000_000_007 + serial)
            self.collection.reset_rows(name, rows, g)
        return reset

    def _apply(self, batch: Batch, fn: Callable[[DynamicIdMap, torch.Tensor], torch.Tensor]) -> Batch:
        s = batch.sparse
        if not self.maps:
            return batch
        bounds = s.feature_bounds.tolist()  # [F + 1]
        ids = s.ids.clone()
        for name, feats in self.features.items():
            spans = [(bounds[f], bounds[f + 1]) for f in feats]
            raw = torch.cat([s.ids[a:b] for a, b in spans])  # every feature of the table: one call, one step
            rows = fn(self.maps[name], raw)
            at = 0
            for a, b in spans:
                ids[a:b] = rows[at : at + b - a]
                at += b - a
        return dataclasses.replace(batch, sparse=SparseFeatures(ids, s.offsets, s.num_features, s.weights))

    def remap_batch(self, batch: Batch) -> Batch:
        """Training: raw ids -> rows, admitting, evicting and resetting reused rows (one step of every map)."""
        return self._apply(batch, DynamicIdMap.remap)

    def lookup_batch(self, batch: Batch) -> Batch:
        """Evaluation / serving: raw ids -> rows, unknown ids -> row 0; the maps do not change."""
        return self._apply(batch, DynamicIdMap.lookup)

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
        saved = state.get("dynamic_ids")
        if saved is None or set(saved) != set(self.maps):
            have = "none" if saved is None else ", ".join(sorted(saved)) or "none"
            raise ConfigError(f"model.dynamic_ids: {state.get('path', 'the checkpoint')} holds id maps of tables "
                              f"[{have}], the config makes [{', '.join(sorted(self.maps))}] dynamic")
        for name, m in self.maps.items():
            m.load_state_dict(saved[name])
