"""The training loop: one Trainer for a fixed data set, resumable at any step.

Steps: read a batch -> forward -> BCE loss -> backward (embedding rows are updated inside backward by the
collection's fused optimizer) -> dense optimizer step (``step.py``). Metrics go to ``metrics.jsonl`` and
TensorBoard, checkpoints to ``<output_dir>/checkpoints`` (``checkpoint/``), the final evaluation to
``summary.json`` and ``curves.png`` (``evaluate.py``). The rows come from ``recstack.data.sources``. The loop
only orders the components: the log window (``logger.MetricsWindow``), the checkpoint cadence
(``Checkpointer.maybe_save``) and what follows from losses and evaluations (``validate.Validator``: the divergence
guard, ``train.target_auc``, the ``early_stopping.Monitor`` with the best checkpoint in ``checkpoints/best/``).
``stream.StreamTrainer`` is this Trainer with a stream of partitions as its data (it overrides the ``_data*``,
``_total_steps``, ``_attach_transforms``, ``_resume_steps`` and ``_train`` steps).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from tqdm import tqdm

from recstack.compression.runtime import CompressionRuntime
from recstack.config import Config
from recstack.data.batch import Batch
from recstack.data.format import DataDescription, capped_table_sizes
from recstack.data.loader import BatchLoader
from recstack.data.sources import prepare_data
from recstack.distributed import agreement, parallelize
from recstack.distributed.dynamic_dist import ShardedDynamicIds, dynamic_placements
from recstack.distributed.pipeline import InputPipeline
from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
from recstack.embedding.dynamic_stage import DynamicIds, dynamic_table_layout
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.errors import ConfigError, PeerFailure
from recstack.io import atomic_write_text
from recstack.models.build import build_model
from recstack.models.dlrm import DLRM
from recstack.training.checkpoint.checkpointer import Checkpointer, any_checkpoint
from recstack.training.checkpoint.data_record import NEW_DATA_FLAG, DataRecord, data_record
from recstack.training.checkpoint.resume import claim_output_dir
from recstack.training.checkpoint.state import (
    CompressionState,
    Keyed,
    LoaderState,
    ModelState,
    RNGState,
    RunInfo,
    Stateful,
)
from recstack.training.divergence import DivergenceGuard
from recstack.training.early_stopping import Monitor
from recstack.training.evaluate import evaluate_loader, oracle_auc, summarize, write_summary
from recstack.training.logger import MetricsLogger, MetricsWindow
from recstack.training.lr_schedule import LRScaler, LRSchedule
from recstack.training.step import (
    Progress,
    build_dense_optimizer,
    dense_autocast,
    optimizer_step,
    resolve_device,
    seed_everything,
    set_tf32,
)
from recstack.training.validate import Validator


class Trainer:
    def __init__(self, cfg: Config, output_dir: str | Path | None = None, resume: bool = False,
                 overwrite: bool = False, resume_on_new_data: bool = False) -> None:
        """``resume``: continue from the newest checkpoint in ``output_dir``; otherwise the run starts at step 0,
        and an earlier run's checkpoints and metrics there are an error unless ``overwrite`` removes them.
        ``resume_on_new_data`` (implies ``resume``): continue even on other data than the checkpoint trained on
        (``checkpoint/data_record.py``)."""
        self.cfg, t = cfg, cfg.train
        resume = resume or resume_on_new_data
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        seed_everything(t.seed)
        set_tf32(t.tf32)
        self.rank, self.world, self.device = 0, 1, resolve_device(t.device)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun
            self.rank, self.world, self.device = parallelize.init_distributed(cfg.dist, t.device)
        self.is_main = self.rank == 0
        self.output_dir = Path(output_dir) if output_dir else None
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            resume = True  # torchrun --max-restarts started us again after a failure: continue, do not redo
        if self.world > 1:  # before any collective of the run: the same job on every rank, or an error
            agreement.check_job(cfg.to_dict(), cfg.dist, self.world, resume, resume_on_new_data,
                                self.output_dir, overwrite)
        if self.output_dir and not resume:
            claim_output_dir(self.output_dir, overwrite, self.is_main)
        if self.output_dir and self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self._data(resume and not resume_on_new_data)
        # Sharded runs build the tables on "meta" (shapes only); _parallelize builds this rank's shards.
        self.model: DLRM = build_model(
            cfg.model, sparse_optimizer_config(cfg.optim), self.num_dense, self.table_sizes, seed=t.seed,
            device=self.device, names=self.table_names, memory=cfg.memory, tables_on_meta=self.world > 1,
            batch_size=t.batch_size, zero_rows=self.zero_rows)
        self.compression = CompressionRuntime(cfg.compression, cfg.dist.forward_codec, cfg.dist.backward_codec,
                                              cfg.train.batch_size, self.output_dir, self.rank, self.world)
        self.net: torch.nn.Module = self.model  # what the step calls: the model, or DDP around it
        self._parallelize()
        self.compression.attach(self.model)  # eb codecs learn which table each chunk carries; --dump-a2a hook
        self.optimizer = build_dense_optimizer(cfg.optim, self.model.dense_parameters(), self.model.embeddings)
        o = cfg.optim
        self.monitor = Monitor(t.early_stopping, o)
        schedule = LRSchedule(o.lr_warmup_steps, o.lr_decay_start_step, o.lr_decay_steps)
        active = schedule.active or o.plateau_patience > 0
        self.lr = LRScaler(schedule, self.optimizer, self.model) if active else None
        self.total_steps = self._total_steps()
        self.progress = Progress()
        self.guard = DivergenceGuard(t.divergence_factor, t.divergence_window, self.world, self.device)
        self._reliability: dict[str, list[Any]] | None = None  # of the latest evaluation
        # The monitor's state is in the checkpoint only when it is used: other runs' checkpoints stay as they were.
        selection: list[Stateful] = [self.monitor] if self.monitor.active else []
        selection += [self.dynamic] if self.dynamic is not None else []
        data, position = self._data_states(resume_on_new_data)
        self.checkpointer = Checkpointer(
            self.output_dir / "checkpoints" if self.output_dir else None, self.model.embeddings, self.world,
            self.device, keep=t.keep_checkpoints, every=t.checkpoint_every,
            replicated=[*data, ModelState(self.model, self.world > 1, self.device),
                        Keyed("dense_optimizer", self.optimizer), *position, self.progress, RNGState(),
                        RunInfo(cfg.to_dict(), self.model.num_dense, self.table_sizes, self.table_names, self.world),
                        self.guard, *selection],
            rank_local=[CompressionState(self.compression, self.device)],
        )
        self.validator = Validator(t.target_auc, self.guard, self.monitor, self.lr, self.progress,
                                   self.checkpointer, self.model, self.is_main)
        self.checkpointer.before_save = self.validator.check_weights
        if resume:
            self._resume()
        if self.output_dir and self.is_main:  # after the resume check: a refused resume leaves the run as it was
            atomic_write_text(self.output_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
        # A resumed run drops what the stopped run logged after its checkpoint (it is about to be redone).
        self.logger = MetricsLogger(self.output_dir if self.is_main else None,
                                    resume_step=self.step if resume else None)

    def _data(self, keep_data: bool) -> None:
        """The training and evaluation sets and their loaders (this rank's slice of every global batch).
        ``keep_data``: resuming on the checkpoint's data, so a ``[data.synth]`` set there that checkpoints trained
        on is not generated again with other options (a refused resume leaves the run directory as it was)."""
        cfg, t = self.cfg, self.cfg.train
        keep = None
        if keep_data and self.output_dir and any_checkpoint(self.output_dir / "checkpoints"):
            keep = (f"the checkpoints in {self.output_dir / 'checkpoints'} trained on it, and --resume continues "
                    f"only on the data its checkpoint trained on: restore the options, or pass {NEW_DATA_FLAG} to "
                    "generate it again and continue on the new rows")
        on_rank0 = functools.partial(agreement.on_rank0, timeout_s=cfg.dist.timeout_s) if self.world > 1 else None
        self.train_ds, self.eval_ds, eval_range = prepare_data(cfg.data, self.output_dir, t.progress, on_rank0, keep)
        self.has_eval = eval_range[1] > eval_range[0]
        if not self.has_eval:
            why = (f"data.eval {self.eval_ds.path} has no rows" if self.eval_ds is not self.train_ds else
                   f"data.eval_fraction={cfg.data.eval_fraction:g} of {len(self.train_ds)} training rows holds no row")
            if t.target_auc:
                raise ValueError(f"train.target_auc={t.target_auc:g} needs evaluation rows, but {why}")
            if self.is_main:
                print(f"no evaluation: {why}; training without it (summary.json gets no eval metrics)",
                      file=sys.stderr)
        train_range = (0, eval_range[0]) if self.eval_ds is self.train_ds else (0, len(self.train_ds))
        self.data_record = data_record(cfg.data, self.train_ds, train_range)
        self.num_dense, self.table_names = len(self.train_ds.dense_features), self.train_ds.table_names
        table_sizes = capped_table_sizes(self.train_ds.table_sizes, cfg.model.max_table_size)
        caps = table_sizes if cfg.model.max_table_size > 0 else None
        self.table_sizes, caps, self.zero_rows = dynamic_table_layout(  # dynamic tables: capacity rows, raw ids
            cfg.model.dynamic_ids, self.table_names, table_sizes, caps,
            [s.reserved_rows for s in self.train_ds.sparse_features])
        self.train_loader = BatchLoader(self.train_ds, t.batch_size, train_range, shuffle=t.shuffle, seed=t.seed,
                                        drop_last=t.drop_last, table_caps=caps, rank=self.rank, world_size=self.world,
                                        shuffle_window=t.shuffle_window)
        if len(self.train_loader) == 0:
            raise ValueError(f"{self.train_ds.path}: {train_range[1] - train_range[0]} training rows give no "
                             f"{'full ' if t.drop_last else ''}batch of {t.batch_size}")
        rows, gb = train_range[1] - train_range[0], self.train_loader.global_batch_size
        if cfg.model.mlp_norm == "batch" and not t.drop_last and rows % gb == 1:  # batch norm needs 2 rows a batch
            raise ConfigError(f"model.mlp_norm = \"batch\": the {rows} training rows end each epoch with a batch of "
                              f"one row (global batch {gb}), which batch normalisation cannot train on; set "
                              "train.drop_last = true or another train.batch_size")
        self.eval_loader = BatchLoader(self.eval_ds, t.eval_batch_size, eval_range, drop_last=False, table_caps=caps,
                                       extras=("probability",), rank=self.rank, world_size=self.world)

    def _data_states(self, resume_on_new_data: bool) -> tuple[list[Stateful], list[Stateful]]:
        """The checkpointed state of the data: what the run trains on (checked first on a resume) and where it
        is in it (loaded after the model and optimizer)."""
        return ([DataRecord(self.data_record, resume_on_new_data, self.is_main)],
                [LoaderState(self.train_loader, self.cfg.train.shuffle, self.is_main)])

    def _total_steps(self) -> int:
        t = self.cfg.train
        return t.max_steps or t.epochs * len(self.train_loader)

    def _parallelize(self) -> None:
        """Under torchrun, the tables sharded by the plan (or ``dist.sharding``) and the dense part in DDP; then,
        for any world size, the loaders' transforms, set once (``recstack.distributed.pipeline``): the
        quotient-remainder split, the cached tiers' prefetch hook and (a GPU) the staging copy in the loader
        thread, and with ``dist.pipeline`` the id messages built there (exchanged in this thread, a batch ahead)."""
        d, dyn, seed = self.cfg.dist, self.cfg.model.dynamic_ids, self.cfg.train.seed
        if self.world > 1:
            self._shard()
        self.dynamic: DynamicIds | None = None
        if dyn.enabled:  # under torchrun the maps are split by id hash over the dynamic tables' row shards
            emb = self.model.embeddings
            self.dynamic = (ShardedDynamicIds(dyn, self.table_names, cast(ShardedEmbeddingCollection, emb), seed)
                            if self.world > 1 else DynamicIds(dyn, self.table_names, emb, seed))
        self.model.dynamic_ids = self.dynamic  # what an export of the model serves raw ids with
        # Sharded dynamic ids remap a batch with a collective of its own step (admissions follow the step order):
        # the next batch's ids cannot be routed ahead before this step's admissions, so no pipelining then.
        pipelined = self.world > 1 and d.pipeline and self.dynamic is None
        self.input_pipeline = InputPipeline(self.model, self.device, pipelined=pipelined, dynamic=self.dynamic)
        self._attach_transforms()

    def _attach_transforms(self) -> None:
        self.train_loader.transform = self.input_pipeline.train_transform
        self.eval_loader.transform = self.input_pipeline.eval_transform

    def _shard(self) -> None:
        d = self.cfg.dist
        rpn = d.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        names = [t.name for t in self.model.embeddings.tables]
        placements = parallelize.placements_from_config(d, names, self.world)
        if self.cfg.model.dynamic_ids.enabled:  # row_wise over every rank in order, or a ConfigError on every rank
            placements = dynamic_placements(self.cfg.model.dynamic_ids, names, placements, self.world, d.plan)
        data = {"data.train": self.train_ds}
        if self.eval_ds is not self.train_ds:
            data["data.eval"] = self.eval_ds
        agreement.check_placements_and_data(d, self.model.embeddings.tables, placements, data)
        fwd, bwd = self.compression.codecs()  # names, or configured error-bounded codecs for "eb"
        parallelize.shard_model(self.model, placements, self.cfg.train.seed, self.device, fwd, bwd, rpn,
                                d.aggregate_gradients, d.timeout_s, self.cfg.memory)
        sharded = cast(ShardedEmbeddingCollection, self.model.embeddings)  # shard_model put it there
        self.net = parallelize.wrap_ddp(self.model, self.device, sharded.stats)

    @property
    def step(self) -> int:
        return self.progress.step

    def data_description(self) -> DataDescription:
        """The data the model trains on as export and publishing see it (features, tables, transforms)."""
        return self.train_ds

    def _resume(self) -> None:
        state = self.checkpointer.load_latest()
        if state is None:
            print("resume: no checkpoint found, starting from scratch")
            return
        self._resume_steps()
        print(f"resume: continuing from {state['path']} (step {self.step})")
        self.validator.resumed()

    def _resume_steps(self) -> None:
        if not self.cfg.train.max_steps:  # train.epochs: the epochs left, in batches of the size used now
            self.total_steps = self.step + self.train_loader.batches_until(self.cfg.train.epochs)

    def save(self) -> Path | None:
        """A checkpoint of this step, unless a weight is not finite (then a DivergenceError). Collective."""
        return self.checkpointer.save(self.step)

    # -- loop ------------------------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> float:
        return optimizer_step(self._loss, self.optimizer, batch, self.device)

    def _loss(self, batch: Batch) -> torch.Tensor:
        """The mean BCE over the global batch's rows. Every rank's loss is averaged over the ranks (DDP for the
        dense part, 1/W in the tables' backward), so a rank whose share of a short global batch of G rows differs
        from G / W (or is empty) weighs its sum by W / G instead of taking its own mean."""
        with dense_autocast(self.device, self.cfg.train.autocast):
            logits = self.net(batch).float()  # the loss in fp32 also under bf16 autocast
        g = batch.global_rows
        if g is None or g == batch.batch_size * self.world:
            return F.binary_cross_entropy_with_logits(logits, batch.labels)
        return F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") * (self.world / g)

    def train(self) -> dict[str, Any]:
        """-> the summary (``summary.json``). Under torchrun a failed collective is a PeerFailure."""
        try:
            return self._train()
        except (RuntimeError, torch.distributed.DistError) as e:
            if self.world == 1 or not parallelize.is_peer_failure(e):
                raise  # this rank's own error, reported as it is
            raise PeerFailure(
                f"rank {self.rank}: a collective with the other ranks failed (a rank died, or none answered within "
                f"dist.timeout_s={self.cfg.dist.timeout_s:g} s) at step {self.step}: {e}"
            ) from e

    def _train(self) -> dict[str, Any]:
        t, p, v = self.cfg.train, self.progress, self.validator
        self.net.train()
        bar = self._bar(self.total_steps)
        window = MetricsWindow(t.batch_size * self.world)
        stop: dict[str, float] | None = None  # the evaluation that reached train.target_auc or stopped the run
        while p.step < self.total_steps and stop is None and not v.finished:
            epoch = self.train_loader.iterate_epoch(limit=self.total_steps - p.step)
            for batch in self.input_pipeline.batches(epoch, self.train_loader):
                self._step(batch, window, bar, p.step + 1 == self.total_steps)
                if t.eval_every and self.has_eval and p.step % t.eval_every == 0 and p.step < self.total_steps:
                    stop = v.validate(self.evaluate(), self.logger)
                    window.restart_clock()
                if p.step >= self.total_steps or stop is not None:
                    break  # the final checkpoint follows the loop
                if self.checkpointer.maybe_save(p.step, last=False):
                    window.exclude_pause()
        bar.close()
        if stop is None and self.has_eval:
            stop = self.evaluate()
            v.final(stop, self.logger)  # before the final checkpoint
        self.checkpointer.maybe_save(p.step, last=True)  # once per step: a stop on a new best has its checkpoint
        oracle = oracle_auc(self.eval_ds, (self.eval_loader.start, self.eval_loader.end)) if self.has_eval else None
        return self._finish(stop or {}, oracle)  # no evaluation rows: no metrics

    def _bar(self, total: int | None) -> tqdm:
        return tqdm(total=total, initial=self.progress.step, unit="step", dynamic_ncols=True,
                    disable=not (self.cfg.train.progress and self.is_main))

    def _step(self, batch: Batch, window: MetricsWindow, bar: tqdm, last: bool) -> float:
        """One training step counted, and the log line of its window when due (every ``train.log_every`` steps,
        and at the ``last``) -> the step's loss."""
        p = self.progress
        self.compression.begin_step(p.step)
        lr_factor = self.lr.set_step(p.step) if self.lr is not None else None
        started = time.perf_counter()
        loss = self.train_step(batch)
        p.train_seconds += window.add(loss, started)  # data wait + steps, not evaluation or checkpoints
        self.validator.check_loss(loss)  # collective under torchrun: every rank stops alike
        p.step += 1
        p.samples += batch.global_rows or batch.batch_size * self.world  # global samples
        bar.update(1)
        if p.step % self.cfg.train.log_every == 0 or last:
            values, n = window.take()
            if lr_factor is not None:  # the schedule's factor at the window's last step
                values["lr_factor"] = lr_factor
            # bytes and seconds per collective, cache counters, since the last log line
            values.update({k: v / n for k, v in self.model.embeddings.pop_counters().items()})
            values.update(self.compression.metrics(n))  # eb: ratio, codec time, bounds in force
            values.update(self.dynamic.stats() if self.dynamic is not None else {})
            self.logger.log(p.step, "train", values)
            bar.set_postfix(loss=f"{values['loss']:.4f}", samples_s=f"{values['samples_per_sec']:,.0f}")
        return loss

    def _finish(self, final: dict[str, float], oracle: float | None, extra: dict[str, Any] | None = None
                ) -> dict[str, Any]:
        """``summary.json`` (rank 0) from the ``final`` evaluation and ``extra`` fields; the logger closed.
        -> the summary."""
        summary = summarize(final, self.progress, self.world, self.cfg.train.target_auc, oracle, self._reliability)
        summary.update(self.validator.summary_fields())
        summary.update(extra or {})
        summary.update(self.dynamic.stats() if self.dynamic is not None else {})
        if self.output_dir and self.is_main:
            write_summary(summary, self.output_dir, self.world > 1, self.cfg.dist.pipeline)
        self.logger.close()
        return summary

    def evaluate(self) -> dict[str, float]:
        """The metrics of the evaluation rows (the same on every rank); keeps their reliability bins for the
        summary's diagram."""
        metrics = evaluate_loader(self.net, self.eval_loader, self.device, self.model.embeddings, self.world,
                                  self.input_pipeline.eval_step)
        self._reliability = metrics.reliability()
        return metrics.compute()

    def close(self) -> None:
        """Release what the run holds besides memory: the cached embedding tiers' prefetch thread and table files.
        The model cannot look up cached rows afterwards."""
        self.model.embeddings.close()
