"""Training that follows a stream of partitions (``recstack train --stream DIR``), on the fixed-set Trainer's
parts: the model, the step, the log window, the Checkpointer and the Validator's guard.

For each partition, in order: **progressive validation** (the model scores the partition before it trains on
it: ``progressive_auc`` / ``progressive_logloss`` of the partition and ``running_auc`` / ``running_logloss`` of
every partition so far, logged as kind ``progressive`` at the step after the partition), one pass of training over
its rows, a checkpoint at the boundary that records the stream position (``checkpoint.state.StreamState``), then
every registered ``PartitionHook``. A run stopped anywhere (SIGKILL included) and started again with ``--resume``
continues after the last checkpointed partition and ends with the uninterrupted run's model: the partition it was
in is trained again from its start, from the same weights, optimizer state and RNG state.

One process (no torchrun); ``train.checkpoint_every`` and ``train.eval_every`` are not used (partitions are the
unit of both); ``train.target_auc``, early stopping and the plateau reduction are fixed-set features and refused.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from recstack.config import Config
from recstack.data.format import DataDescription
from recstack.data.loader import BatchLoader
from recstack.data.stream.partition import PartitionReader, PartitionRows
from recstack.data.stream.source import Partition, StreamSource
from recstack.embedding.dynamic_stage import dynamic_table_layout
from recstack.errors import ConfigError
from recstack.training.checkpoint.state import Stateful, StreamState
from recstack.training.evaluate import evaluate_loader, figures
from recstack.training.hooks import PartitionHook, PartitionInfo
from recstack.training.logger import MetricsWindow
from recstack.training.trainer import Trainer


class StreamTrainer(Trainer):
    """``source``: the partitions; ``reader``: how a partition becomes rows (and the model's layout). The loaders
    take ids modulo ``table_caps`` (``recstack.data.loader.cap_ids``; a 0 leaves a feature's ids raw for a
    dynamic table's transform)."""

    def __init__(self, cfg: Config, source: StreamSource, reader: PartitionReader, output_dir: str | Path | None,
                 resume: bool = False, overwrite: bool = False) -> None:
        self.source, self.reader = source, reader
        self.stream = StreamState()
        self.hooks: list[PartitionHook] = []
        super().__init__(cfg, output_dir, resume=resume, overwrite=overwrite)

    def data_description(self) -> DataDescription:
        return self.reader.describe(Path(self.source.location), [c == 0 for c in self.table_caps])

    def add_hook(self, hook: PartitionHook) -> None:
        """Call ``hook`` after every partition's checkpoint and once at the end (in the order added)."""
        self.hooks.append(hook)

    # -- set-up: the Trainer's, with the stream's layout instead of a prepared set ----------------------
    def _data(self, keep_data: bool) -> None:
        t, m = self.cfg.train, self.cfg.optim
        if self.world > 1:
            raise ConfigError("--stream trains in one process; torchrun is not supported for streams")
        if t.target_auc:
            raise ConfigError(f"train.target_auc={t.target_auc:g}: a stream has no fixed evaluation set to reach "
                              "it on (its progressive AUC is logged per partition)")
        if t.early_stopping.patience or m.plateau_patience:
            raise ConfigError("train.early_stopping / optim.plateau_patience: not for a stream (no fixed "
                              "evaluation set); unset them")
        layout = self.reader.layout
        self.num_dense, self.table_names = len(layout.dense_names), layout.table_names
        # dynamic tables: capacity rows, and a cap of 0 (their raw ids reach the id map in the input pipeline)
        self.table_sizes, caps, self.zero_rows = dynamic_table_layout(
            self.cfg.model.dynamic_ids, layout.table_names, layout.table_sizes, list(layout.table_sizes),
            layout.reserved_rows)
        self.table_caps: list[int] = list(caps if caps is not None else layout.table_sizes)
        self.has_eval = False

    def _data_states(self, resume_on_new_data: bool) -> tuple[list[Stateful], list[Stateful]]:
        return [], [self.stream]

    def _total_steps(self) -> int:
        return 0  # unknown: the stream decides

    def _attach_transforms(self) -> None:
        pass  # each partition's loaders get them (_loader)

    def _resume_steps(self) -> None:
        pass

    def _loader(self, rows: PartitionRows, part: Partition, train: bool) -> BatchLoader:
        t, pipe = self.cfg.train, self.input_pipeline
        loader = BatchLoader(rows, t.batch_size if train else t.eval_batch_size, drop_last=False,
                             shuffle=t.shuffle if train else False, seed=t.seed + part.index,
                             shuffle_window=t.shuffle_window, table_caps=self.table_caps)
        loader.transform = pipe.train_transform if train else pipe.eval_transform
        return loader

    # -- the loop ---------------------------------------------------------------------------------------
    def _train(self) -> dict[str, Any]:
        t, p, s = self.cfg.train, self.progress, self.stream
        self.net.train()
        bar = self._bar(None)
        window = MetricsWindow(t.batch_size)
        partitions = 0
        for part in self.source.partitions(s.position):
            rows = self.reader.read(part.path)  # a bad line: an error naming the file and line
            progressive = self._progressive(rows, part)
            window.restart_clock()
            train_loader = self._loader(rows, part, train=True)
            n = len(train_loader)
            for i, batch in enumerate(self.input_pipeline.batches(train_loader.iterate_epoch(), train_loader)):
                self._step(batch, window, bar, last=i + 1 == n)
            self.logger.log(p.step, "progressive", progressive)  # at the checkpoint's step: a resume redoes both
            s.position = part.position
            self.checkpointer.save(p.step)
            window.exclude_pause()
            partitions += 1
            info = PartitionInfo(part.name, part.index, part.arrived_at, len(rows), p.step)
            for hook in self.hooks:
                hook.after_partition(self, info)
        bar.close()
        for hook in self.hooks:
            hook.close(self)
        if self.checkpointer.saved_at is None:  # nothing new arrived: the run's state at its end all the same
            self.checkpointer.save(p.step)
        return self._finish({}, None, self._stream_summary(partitions))

    def _progressive(self, rows: PartitionRows, part: Partition) -> dict[str, float]:
        """Score the partition before training on it -> the ``progressive`` record (the partition's figures and
        the running ones over every partition so far). Its logloss is held to the divergence guard."""
        metrics = evaluate_loader(self.net, self._loader(rows, part, train=False), self.device,
                                  self.model.embeddings, self.world)
        result = metrics.compute()
        self.validator.check_eval(result)
        self.stream.progressive.merge(metrics)
        running = self.stream.progressive.compute()
        if self.is_main:
            tqdm.write(f"partition {part.index} {part.name} ({len(rows)} rows), before training: {figures(result)}")
        return {"partition": part.index, "rows": len(rows), "progressive_auc": result["auc"],
                "progressive_logloss": result["logloss"], "progressive_ne": result["ne"],
                "running_auc": running["auc"], "running_logloss": running["logloss"], "running_ne": running["ne"],
                "arrival_lag_s": time.time() - part.arrived_at}

    def _stream_summary(self, partitions: int) -> dict[str, Any]:
        """``summary.json``'s stream fields: the position, the partitions consumed (in all and by this process)
        and the progressive figures over the whole stream."""
        run = self.stream.progressive.compute()
        pos = self.stream.position
        return {"stream_position": None if pos is None else pos.name,
                "partitions": 0 if pos is None else pos.index + 1, "partitions_this_run": partitions,
                "progressive_auc": run["auc"], "progressive_logloss": run["logloss"], "progressive_ne": run["ne"],
                "progressive_examples": run["num_examples"]}
