"""A VM's stream: its vertical's rows of each window, joined with the FM labels the DAS logged for them.

A VM run is one (vertical, arm, staleness). Every arm of a vertical starts from the same warm-up: the VM
trained alone on windows [0, vm_start), before FM labels flow (``phase = "warmup"``). From ``vm_start`` on the
arm trains on its vertical's rows of each window with the FM logit joined by example id from the DAS store.
An example without its FM label is never trained on silently: the VM waits ``das_wait_s`` for the DAS to
commit the window, then stops with ``MissingFMLabels`` (``on_missing = "error"``) or leaves the unlabelled
examples out of training and reports how many (``on_missing = "drop"``). Progressive evaluation reports the
serving head, and for distillation arms the FM labels themselves (``fm``: how good the possibly stale FM is
on this vertical) and the Student Adapter (``adapter``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recstack.data.batch import Batch
from recstack.data.loader import RowSet
from recstack.embedding.dynamic_stage import DynamicIds
from recstack.exfm.config import DistillConfig, NetSpec, StreamConfig, StreamSourceSpec
from recstack.exfm.fm import build_net, table_caps
from recstack.exfm.source import FeatureLayout, WindowRowsIndex
from recstack.exfm.store import DasStore
from recstack.exfm.stream import StreamTrainer
from recstack.exfm.stream_windows import open_windows
from recstack.exfm.vm import FM_LOGIT, VerticalModel
from recstack.exfm.vm_publish import VMRun, WindowHooks
from recstack.exfm.windows import Window, row_batches
from recstack.io import atomic_write_text
from recstack.metrics import BinaryMetrics
from recstack.models.dlrm import DLRM
from recstack.training.checkpoint.single import latest_checkpoint
from recstack.training.hooks import PartitionHook
from recstack.training.step import build_dense_optimizer
from recstack.typed_toml import fill

EVAL_BATCH = 4096


@dataclass
class VMJob:
    """One VM run. ``phase``: ``warmup`` (windows [0, vm_start), alone) or ``arm`` (windows [vm_start, end)
    starting from the warm-up's final state in ``warm_dir``). ``store``: the DAS store of this staleness.
    The windows: those of the prepared set ``data``, or with ``source.dir`` the partitions of a directory stream
    as the FM's ``manifest`` lists them (waited for up to ``das_wait_s``)."""

    data: str = ""
    source: StreamSourceSpec = field(default_factory=StreamSourceSpec)
    manifest: str = ""
    out_dir: str = ""
    phase: str = "arm"
    vertical: int = 0
    arm: str = "alone"
    staleness: int = -1  # -1: no FM labels
    store: str = ""
    warm_dir: str = ""
    seed: int = 0
    vm: NetSpec = field(default_factory=NetSpec)
    distill: DistillConfig = field(default_factory=DistillConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    das_wait_s: float = 1800.0
    on_missing: str = "error"
    threads: int = 1
    distill_head_init: str = "serving"  # serving: a copy of the warm serving head; random: fresh init
    # publishing the serving head while the arm trains (experiment.publish_vm): model root ("" = off), cadence
    publish_root: str = ""
    publish_every_s: float = 0.0
    publish_tables: str = "fp32"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(values: dict[str, Any]) -> VMJob:
        job = VMJob()
        fill(job, values, "VMJob")
        return job


class VerticalSource:
    """Batches of one vertical's rows per window, with FM logits joined from ``store`` (if any). ``ds``: the
    rows (a prepared set, or a ``WindowSource``'s ``data``); ``index``: which of them a window's vertical holds
    and their example ids (a ``VerticalIndex``, or the ``WindowSource``)."""

    def __init__(self, ds: RowSet, index: WindowRowsIndex, vertical: int, batch_size: int,
                 caps: torch.Tensor | None, store: DasStore | None, wait_s: float, on_missing: str) -> None:
        self.ds, self.index, self.vertical = ds, index, vertical
        self.batch_size, self.caps = batch_size, caps
        self.store, self.wait_s, self.on_missing = store, wait_s, on_missing
        self._joined: dict[int, tuple[np.ndarray, np.ndarray | None, dict[str, Any]]] = {}

    def joined(self, w: Window) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        """-> (rows [n], FM logits [n] or None, info) for window ``w``; rows without a label are dropped
        (``on_missing = "drop"``) or raise ``MissingFMLabels``."""
        if w.index in self._joined:
            return self._joined[w.index]
        rows = self.index.rows(w, self.vertical)
        if self.store is None or len(rows) == 0:
            out: tuple[np.ndarray, np.ndarray | None, dict[str, Any]] = (rows, None, {})
        else:
            ids = self.index.example_ids(rows)
            logits, found, version = self.store.lookup(w.index, ids, self.wait_s, partial=self.on_missing == "drop")
            out = (rows[found], logits[found], {"fm_version": version, "fm_missing": int((~found).sum())})
        self._joined = {w.index: out}  # one window at a time: training follows the evaluation of the same one
        return out

    def batches(self, w: Window, batch_size: int):
        rows, logits, _ = self.joined(w)
        return row_batches(self.ds, rows, batch_size, caps=self.caps,
                           columns={FM_LOGIT: logits} if logits is not None else None)


def _load_body(model: VerticalModel, warm_dir: Path, dynamic: DynamicIds | None) -> None:
    """The warm-up's final body, and its id maps (the arm goes on with the rows the warm-up admitted)."""
    state = latest_checkpoint(warm_dir / "checkpoints")
    if state is None:
        raise FileNotFoundError(f"{warm_dir}/checkpoints: no warm-up checkpoint to start the arm from")
    body = {k.removeprefix("body."): v for k, v in state["model"].items() if k.startswith("body.")}
    model.body.load_state_dict(body)
    if dynamic is not None:
        dynamic.load_state_dict(state)


def vm_body(job: VMJob, ds: FeatureLayout, device: torch.device | str = "cpu") -> DLRM:
    """The VM's body (the serving head) as every arm of ``job``'s vertical and seed starts it, with its dynamic
    id maps (``body.dynamic_ids``) when ``vm.model.dynamic_ids`` is on."""
    body = build_net(job.vm, ds, job.seed * 1009 + job.vertical, device)  # the same body for every arm
    if job.vm.model.dynamic_ids.enabled:
        body.dynamic_ids = DynamicIds(job.vm.model.dynamic_ids, ds.table_names, body.embeddings,
                                      job.seed * 1009 + job.vertical)
    return body


def load_serving_head(out_dir: str | Path, device: torch.device | str = "cpu") -> DLRM:
    """A finished (or checkpointed) VM task's serving head in eval mode, with its id maps: what a vertical
    serves, and what ``experiment.publish_vm`` published last."""
    out = Path(out_dir)
    job = VMJob.from_dict(json.loads((out / "job.json").read_text()))
    body = vm_body(job, open_windows(job.data, job.stream, job.source, job.manifest, 0.0).features, device)
    model = VerticalModel(body, job.arm if job.phase == "arm" else "alone", job.distill)
    state = latest_checkpoint(out / "checkpoints")
    if state is None:
        raise FileNotFoundError(f"{out}/checkpoints: no checkpoint of this VM")
    model.load_state_dict(state["model"])
    if body.dynamic_ids is not None:
        body.dynamic_ids.load_state_dict(state)
    return body.eval()


def run_vm_stream(job: VMJob, device: torch.device | str = "cpu", hooks: Sequence[PartitionHook] = ()
                  ) -> dict[str, Any]:
    """Run (or resume) one VM job; -> {"records", "summary"} (and ``published``: the ``publish`` records of
    ``hooks``, called at every window end of the job); also written to ``out_dir/result.json``."""
    torch.set_num_threads(job.threads)
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "job.json", json.dumps(job.to_dict(), indent=1))
    windows = open_windows(job.data, job.stream, job.source, job.manifest, job.das_wait_s)
    start = job.stream.vm_start
    if job.phase == "warmup":
        first, stop, arm = 0, start, "alone"
    elif job.phase == "arm":
        first, stop, arm = start, None, job.arm  # to the end of the stream
    else:
        raise ValueError(f"VMJob.phase: {job.phase!r} is not warmup or arm")
    body = vm_body(job, windows.features, device)
    dynamic = body.dynamic_ids
    model = VerticalModel(body, arm, job.distill).to(device)
    if job.phase == "arm":
        _load_body(model, Path(job.warm_dir), dynamic)
        if job.distill_head_init == "serving":
            model.init_distill_head_from_serving()
    optimizer = build_dense_optimizer(job.vm.optim, model.dense_param_groups(job.vm.optim.dense_lr),
                                      model.body.embeddings)
    store = DasStore(job.store) if model.needs_fm else None
    if model.needs_fm and not job.store:
        raise ValueError(f"VMJob: arm {arm!r} needs a DAS store")
    source = VerticalSource(windows.data, windows, job.vertical, job.vm.batch_size,
                            table_caps(job.vm, windows.features), store, job.das_wait_s, job.on_missing)

    trained_rows: dict[int, int] = {}  # window -> the rows trained on (what its publication reports)

    def train_batches(w: Window) -> Iterator[Batch]:
        trained_rows[w.index] = len(source.joined(w)[0])
        batches = source.batches(w, job.vm.batch_size)
        # admission and eviction in order, just before each step: the maps a checkpoint saves are the trained ones
        return map(dynamic.remap_batch, batches) if dynamic is not None else batches

    def evaluate(w: Window) -> dict[str, BinaryMetrics]:
        if window_hooks is not None:
            window_hooks.window_started(w.index)
        groups = {"serving": BinaryMetrics()}
        if model.needs_fm:
            groups["fm"] = BinaryMetrics()
        if model.adapter is not None:
            groups["adapter"] = BinaryMetrics()
        for batch in source.batches(w, EVAL_BATCH):
            batch = (dynamic.lookup_batch(batch) if dynamic is not None else batch).to(device)  # no admission
            groups["serving"].update(model(batch), batch.labels)
            if model.needs_fm:
                fm = batch.extras[FM_LOGIT]
                groups["fm"].update(fm, batch.labels)
                if model.adapter is not None:
                    groups["adapter"].update(model.adapter(fm), batch.labels)
        return groups

    def describe(w: Window) -> dict[str, Any]:
        return {**source.joined(w)[2], **(dynamic.stats() if dynamic is not None else {})}

    window_hooks: WindowHooks | None = None
    trainer = StreamTrainer(
        model, model.loss, optimizer, windows.window, train_batches, evaluate,
        device=device, first=first, eval_from=start, ckpt_dir=out / "checkpoints", log_dir=out,
        describe=describe, states=[dynamic] if dynamic is not None else [],
        on_window_end=lambda t: window_hooks.window_end(t) if window_hooks is not None else None,
    )
    if hooks:
        raw = [job.vm.model.dynamic_ids.enabled and job.vm.model.dynamic_ids.applies_to(t)
               for t in windows.features.table_names]
        run = VMRun(body, job.vm, windows.describe(raw), out / "publish", trainer.next_window)
        window_hooks = WindowHooks(run, hooks, lambda t: trained_rows.get(t, 0))
    records = trainer.run(until=stop)
    result: dict[str, Any] = {"job": job.to_dict(), "records": records, "summary": trainer.summary()}
    if window_hooks is not None:
        result["published"] = window_hooks.close()
    # whole or absent after a crash
    atomic_write_text(out / "result.json", json.dumps(result, indent=1))
    return result
