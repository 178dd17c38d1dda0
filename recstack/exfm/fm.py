"""The foundation model (FM): a larger DLRM trained on the stream of every vertical, publishing snapshots.

The FM trains window after window (``StreamTrainer``) and, after every ``publish_every`` windows, publishes a
snapshot whose version is the number of windows it has trained on. Snapshots are ``recstack.training.checkpoint.single``
files (written to a temporary name, fsynced and renamed), so the DAS, polling the directory from another
process, sees a version whole or not at all. Each snapshot carries what is needed to rebuild the model.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from recstack.data.format import capped_table_sizes
from recstack.data.loader import BatchLoader
from recstack.embedding.dynamic_stage import dynamic_table_layout
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.exfm.config import NetSpec
from recstack.exfm.source import FeatureLayout, WindowSource
from recstack.exfm.stream import StreamTrainer
from recstack.exfm.windows import Window
from recstack.metrics import BinaryMetrics
from recstack.models.build import build_model
from recstack.models.dlrm import DLRM
from recstack.training.checkpoint.single import checkpoint_path, load_checkpoint, save_checkpoint
from recstack.training.step import build_dense_optimizer, seed_everything
from recstack.typed_toml import fill

EVAL_BATCH = 4096


def build_net(spec: NetSpec, ds: FeatureLayout, seed: int, device: torch.device | str = "cpu") -> DLRM:
    """A DLRM of ``spec`` for ``ds``'s features (a prepared set, or a stream's ``WindowSource.features``); dense
    layers from torch's RNG seeded with ``seed``. Dynamic id tables (``model.dynamic_ids``) have their capacity
    in rows, their default row 0 at zero."""
    seed_everything(seed)
    sizes = capped_table_sizes(ds.table_sizes, spec.model.max_table_size)
    sizes, _, zeros = dynamic_table_layout(spec.model.dynamic_ids, ds.table_names, sizes, None, [0] * len(sizes))
    return build_model(spec.model, sparse_optimizer_config(spec.optim), len(ds.dense_features), sizes, seed=seed,
                       device=device, names=ds.table_names, zero_rows=zeros if any(zeros) else None)


def table_caps(spec: NetSpec, ds: FeatureLayout) -> torch.Tensor | None:
    """[F] what ids are taken modulo: the capped table sizes when ``model.max_table_size`` is set, 0 for the
    features of dynamic id tables (their raw ids go to the id map); None when no id is changed."""
    dyn = spec.model.dynamic_ids
    if spec.model.max_table_size <= 0 and not dyn.enabled:
        return None
    sizes = capped_table_sizes(ds.table_sizes, spec.model.max_table_size)
    caps = sizes if spec.model.max_table_size > 0 else [0] * len(sizes)  # 0: ids as they are
    caps = dynamic_table_layout(dyn, ds.table_names, sizes, caps, [0] * len(sizes))[1] or caps
    return torch.tensor(caps, dtype=torch.int64)


def publish_snapshot(snap_dir: Path, version: int, model: DLRM, spec: NetSpec, ds: FeatureLayout) -> Path:
    """Write snapshot ``version`` atomically; -> its path."""
    state = {
        "model": model.state_dict(),
        "spec_json": json.dumps(asdict(spec)),
        "table_sizes": ds.table_sizes,
        "table_names": ds.table_names,
        "num_dense": len(ds.dense_features),
        "published_at": time.time(),
    }
    return save_checkpoint(snap_dir, version, state)


def snapshot_file(snap_dir: Path, version: int) -> Path:
    return checkpoint_path(Path(snap_dir), version)


def load_snapshot(snap_dir: Path, version: int, device: torch.device | str = "cpu") -> tuple[DLRM, NetSpec]:
    """Snapshot ``version`` as an eval-mode model (and its spec)."""
    state = load_checkpoint(snapshot_file(snap_dir, version), device)
    spec = NetSpec()
    fill(spec, json.loads(state["spec_json"]), f"{snapshot_file(snap_dir, version)}: spec")
    sizes = capped_table_sizes(list(state["table_sizes"]), spec.model.max_table_size)
    model = build_model(spec.model, sparse_optimizer_config(spec.optim), int(state["num_dense"]), sizes, seed=0,
                        device=device, names=list(state["table_names"]))
    model.load_state_dict(state["model"])
    return model.eval(), spec


def wait_for_snapshot(snap_dir: Path, version: int, timeout_s: float, poll_s: float = 0.05) -> Path:
    """Block until snapshot ``version`` is published (or raise TimeoutError after ``timeout_s``)."""
    path = snapshot_file(snap_dir, version)
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path}: FM snapshot version {version} not published after {timeout_s:.0f} s")
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 1.0)
    return path


def run_fm_windows(
    source: WindowSource,
    spec: NetSpec,
    seed: int,
    out_dir: Path,
    publish_every: int,
    eval_from: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Train the FM through every window of ``source`` until it ends (resuming from ``out_dir/checkpoints``),
    publishing snapshots to ``out_dir/snapshots``; -> {"records": per window, "summary": pooled metrics per
    vertical group (the verticals seen up to each window)}."""
    out_dir = Path(out_dir)
    snap_dir = out_dir / "snapshots"
    ds, features = source.data, source.features
    model = build_net(spec, features, seed, device)
    optimizer = build_dense_optimizer(spec.optim, model.dense_parameters(), model.embeddings)
    caps = table_caps(spec, features)

    def train_batches(w: Window):
        loader = BatchLoader(ds, spec.batch_size, (w.start, w.end), drop_last=False, table_caps=caps.tolist()
                             if caps is not None else None, prefetch=0)
        return loader.iterate_epoch()

    def evaluate(w: Window) -> dict[str, BinaryMetrics]:
        verticals = source.verticals()
        groups = {"fm": BinaryMetrics()}
        groups.update({f"fm_v{v}": BinaryMetrics() for v in verticals})
        if w.rows == 0:
            return groups
        loader = BatchLoader(ds, EVAL_BATCH, (w.start, w.end), drop_last=False, extras=("vertical",),
                             table_caps=caps.tolist() if caps is not None else None, prefetch=0)
        for batch in loader.iterate_epoch():
            batch = batch.to(device)
            logits = model(batch)
            groups["fm"].update(logits, batch.labels)
            vert = batch.extras.get("vertical", torch.zeros_like(batch.labels, dtype=torch.int64))
            for v in verticals:
                m = vert == v
                if bool(m.any()):
                    groups[f"fm_v{v}"].update(logits[m], batch.labels[m])
        return groups

    def publish(t: int) -> None:
        if (t + 1) % publish_every == 0:
            publish_snapshot(snap_dir, t + 1, model, spec, features)

    trainer = StreamTrainer(
        model, lambda b: torch.nn.functional.binary_cross_entropy_with_logits(model(b), b.labels), optimizer,
        source.window, train_batches, evaluate, device=device, eval_from=eval_from, ckpt_dir=out_dir / "checkpoints",
        log_dir=out_dir, on_window_end=publish,
    )
    records = trainer.run()
    return {"records": records, "summary": trainer.summary()}
