"""Publishing while training: the trainer's current model into a versions directory that ``recstack serve ROOT
--watch ROOT`` follows, as a full artifact first and then as deltas (``recstack.serving.delta``).

    publisher = Publisher(model_root, every_s=30.0, spec=PublishSpec(tables="fp32"))
    publisher.after_partition(trainer, info)  # a PartitionHook: publishes when every_s passed since the last one
    publisher.close(trainer)                  # at the end: publishes the final state (unless already published)
    publisher.publish(trainer)                # now, whatever the cadence -> Published

What it takes from the trainer (a ``recstack.training.hooks.TrainingRun``: the ``Trainer``, or an ExFM vertical
model's stream): ``trainer.model`` (the DLRM, one process: its tables whole), ``trainer.cfg`` (the
root Config, recorded in the manifest), ``trainer.data_description()`` (the prepared set or the stream whose
description gives the feature transforms; ``data=`` overrides it), ``trainer.step`` and ``trainer.logger`` (a
``publish`` record: seconds, bytes, delta_fraction, version, full).
The model is put back into the train/eval mode it had.

When a full artifact is written instead of a delta (``PublishSpec``): the first version; after ``full_every``
deltas in a chain; when more than ``max_delta_fraction`` of all rows changed (a delta would be about as large);
when the deltas since the last full artifact add up to more than ``chain_bytes_ratio`` times its bytes (a server
starting on the newest version reads at most about 1 + that ratio full artifacts); when the table layout changed.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recstack.data.format import DataDescription
from recstack.errors import ConfigError
from recstack.serving.artifact import MANIFEST, write_artifact
from recstack.serving.delta import IdMap, changed_rows, write_delta_id_maps, write_delta_tables
from recstack.serving.export import (
    PROGRAM_FILE,
    TableLayout,
    artifact_manifest,
    dynamic_id_arrays,
    export_program,
    parse_table_widths,
    quantize_tables,
    table_layout,
    write_transforms,
)
from recstack.serving.quantized import GroupArrays
from recstack.serving.transforms import transforms_from_data
from recstack.training.hooks import PartitionInfo, TrainingRun
from recstack.training.inference import check_data


@dataclass(frozen=True)
class PublishSpec:
    """How versions are written: ``tables`` / ``table_widths`` as ``recstack export --tables / --table``; the
    full-artifact rule's ``full_every`` (deltas in a chain at most), ``max_delta_fraction`` (of all rows) and
    ``chain_bytes_ratio`` (the chain's bytes against its full artifact's)."""

    tables: str = "fp32"
    table_widths: tuple[str, ...] = ()
    full_every: int = 20
    max_delta_fraction: float = 0.25
    chain_bytes_ratio: float = 1.0


@dataclass(frozen=True)
class Published:
    """One version written: its directory, number, kind, bytes on disk, seconds taken, the fraction of table rows
    it carries (1.0 for a full artifact) and the changed rows' fraction (what the delta rule looked at)."""

    path: Path
    version: int
    full: bool
    bytes: int
    seconds: float
    delta_fraction: float


class Publisher:
    """A ``PartitionHook`` (``recstack.training.hooks``) that publishes every ``every_s`` seconds (the first
    partition at once) and at ``close``. See the module docstring."""

    def __init__(self, model_root: str | Path, every_s: float, spec: PublishSpec = PublishSpec(),
                 data: DataDescription | None = None, clock: Callable[[], float] = time.time) -> None:
        if not every_s >= 0:
            raise ValueError(f"publish every_s={every_s}: must be >= 0")
        if spec.full_every < 0 or not 0 <= spec.max_delta_fraction <= 1 or not spec.chain_bytes_ratio >= 0:
            raise ValueError(f"{spec}: full_every and chain_bytes_ratio must be >= 0, max_delta_fraction in [0, 1]")
        self.root, self.every_s, self.spec, self.data, self.clock = Path(model_root), every_s, spec, data, clock
        self.root.mkdir(parents=True, exist_ok=True)  # a versions directory: versions 1, 2, ... inside
        self.newest_arrival: float | None = None  # of the partitions trained on so far
        self.newest_partition: str | None = None
        self._published_at: float | None = None  # clock() of the last publication
        self._published_step: int | None = None
        # The last published version, what a delta applies to: its number, manifest checksum, layout and rows.
        self._base: tuple[int, str] | None = None
        self._layout: TableLayout | None = None
        self._arrays: GroupArrays = {}
        self._transforms_sha: str | None = None
        self._id_maps: dict[str, IdMap] = {}
        self._full_version, self._chain, self._chain_bytes, self._full_bytes = 0, 0, 0, 0

    # -- the PartitionHook -----------------------------------------------------------------------------
    def after_partition(self, trainer: TrainingRun, info: PartitionInfo) -> None:
        if self.newest_arrival is None or info.arrived_at >= self.newest_arrival:
            self.newest_arrival, self.newest_partition = info.arrived_at, info.name
        if self._published_at is None or self.clock() - self._published_at >= self.every_s:
            self.publish(trainer)

    def close(self, trainer: TrainingRun) -> None:
        if self._published_step != trainer.step:
            self.publish(trainer)

    # -- publishing ------------------------------------------------------------------------------------
    def publish(self, trainer: TrainingRun, full: bool = False) -> Published:
        """Write the trainer's current model as the next version (full or delta by the rule; ``full``: a full
        artifact whatever the rule says) and log it."""
        if trainer.world > 1:
            raise ConfigError(f"publishing to {self.root}: needs the tables whole in one process, this run has "
                              f"{trainer.world} ranks (publish from a single-process run)")
        start = time.perf_counter()
        model, cfg = trainer.model, trainer.cfg
        data = self.data if self.data is not None else trainer.data_description()
        check_data(cfg, model, data)
        emb = model.embeddings
        widths = parse_table_widths(self.spec.tables, list(self.spec.table_widths), [t.name for t in emb.tables])
        layout = table_layout(emb, widths)
        arrays: GroupArrays = {}
        for key, f in layout.files.items():
            codes = np.zeros(f["data_shape"], np.dtype(f["data_dtype"]))
            arrays[key] = (codes, np.zeros((len(codes), 2), np.float16) if f["scale_bias"] else None)
        quantize_tables(emb, layout, arrays)
        doc, t_arrays = transforms_from_data(data)
        t_sha = _transforms_digest(doc, t_arrays)
        # dynamic id tables: their maps, whole in a full version, the rows whose owner changed in a delta
        id_maps = {name: m.arrays() for name, m in model.dynamic_ids.maps.items()} if model.dynamic_ids else {}
        capacity = {t.name: t.num_embeddings for t in emb.tables}
        total = sum(len(c) for c, _ in arrays.values())
        same_layout = self._layout is not None and self._layout.files == layout.files \
            and self._layout.entries == layout.entries
        changed = changed_rows(arrays, self._arrays) if same_layout else {}
        n_changed = sum(len(r) for r in changed.values())
        spec = self.spec
        full = (full or not same_layout or self._base is None or self._chain >= spec.full_every
                or n_changed > spec.max_delta_fraction * total
                or self._chain_bytes > spec.chain_bytes_ratio * self._full_bytes)
        freshness = {"arrived_at": self.newest_arrival, "partition": self.newest_partition}
        was_training = model.training

        def fill(tmp: Path, version: int) -> dict[str, Any]:
            export_program(model, tmp / PROGRAM_FILE)
            manifest = artifact_manifest(cfg, model, data, layout, {"step": trainer.step})
            manifest.update(freshness=freshness, publish={"step": trainer.step, "full": full})
            if full:
                (tmp / "tables").mkdir()
                for key, f in layout.files.items():
                    codes, sb = arrays[key]
                    np.save(tmp / f["data"], codes, allow_pickle=False)
                    if sb is not None:
                        np.save(tmp / f["scale_bias"], sb, allow_pickle=False)
                write_transforms(tmp, doc, {**t_arrays, **dynamic_id_arrays(model)})
                return manifest
            assert self._base is not None
            own_transforms = t_sha != self._transforms_sha
            if own_transforms:
                write_transforms(tmp, doc, t_arrays)
            manifest["dynamic_ids"] = write_delta_id_maps(tmp, id_maps, self._id_maps, capacity)
            manifest["delta"] = {
                "base": {"version": self._base[0], "manifest_sha256": self._base[1]},
                "full": self._full_version, "chain": self._chain + 1,
                **write_delta_tables(tmp, arrays, changed, layout.entries),
                "changed_rows": n_changed, "total_rows": total, "transforms": "own" if own_transforms else "base"}
            return manifest

        try:
            model.eval()
            path, version = write_artifact(self.root, fill)
        finally:
            model.train(was_training)
        manifest_bytes = (path / MANIFEST).read_bytes()
        size = len(manifest_bytes) + sum(e["bytes"] for e in json.loads(manifest_bytes)["files"].values())
        self._base = (version, hashlib.sha256(manifest_bytes).hexdigest())
        self._layout, self._arrays, self._transforms_sha, self._id_maps = layout, arrays, t_sha, id_maps
        if full:
            self._full_version, self._chain, self._chain_bytes, self._full_bytes = version, 0, 0, size
        else:
            self._chain, self._chain_bytes = self._chain + 1, self._chain_bytes + size
        self._published_at, self._published_step = self.clock(), trainer.step
        out = Published(path, version, full, size, time.perf_counter() - start, 1.0 if full else n_changed / total)
        record = {"publish_seconds": out.seconds, "publish_bytes": out.bytes, "delta_fraction": out.delta_fraction,
                  "changed_fraction": n_changed / total if same_layout else 1.0, "version": version, "full": full}
        if self.newest_arrival is not None:  # the trainer's side of freshness: arrival -> version on disk
            record["published_after_arrival_s"] = max(self.clock() - self.newest_arrival, 0.0)
        trainer.logger.log(trainer.step, "publish", record)
        return out


def make_publisher(model_root: str, every_s: float, tables: str = "fp32") -> Publisher:
    """A ``Publisher`` with the default rule and ``tables`` widths: a plain function (picklable by name), for a
    caller that builds the hook in another process (``recstack.exfm.experiment.ExperimentRunner``)."""
    return Publisher(model_root, every_s, PublishSpec(tables=tables))


def _transforms_digest(doc: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(json.dumps(doc, sort_keys=True, allow_nan=False).encode())
    for rel in sorted(arrays):
        h.update(rel.encode())
        h.update(np.ascontiguousarray(arrays[rel]).data)
    return h.hexdigest()
