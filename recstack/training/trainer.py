"""The training loop: one Trainer for a fixed data set, resumable at any step.

Steps: read a batch -> forward -> BCE loss -> backward (embedding rows are updated inside backward by the
collection's fused optimizer) -> dense optimizer step. Metrics go to ``metrics.jsonl`` and TensorBoard,
checkpoints to ``<output_dir>/checkpoints``, the final evaluation to ``summary.json`` and ``curves.png``.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from recstack.compression.runtime import CompressionRuntime
from recstack.config import Config
from recstack.data.batch import Batch
from recstack.data.format import PreparedDataset, layout_difference
from recstack.data.loader import BatchLoader, LoaderPosition
from recstack.errors import ConfigError
from recstack.metrics import BinaryMetrics, auc
from recstack.models.build import build_dense_optimizer, build_model, capped_table_sizes
from recstack.models.dlrm import DLRM
from recstack.training.checkpoint.resume import (
    claim_output_dir,
    convert_embedding_layout,
    find_resume_state,
    rebatched_position,
)
from recstack.training.checkpoint.single import rng_state, save_checkpoint, set_rng_state
from recstack.training.logger import MetricsLogger
from recstack.training.lr_schedule import LRScaler, LRSchedule

if TYPE_CHECKING:
    from recstack.distributed.sharded_collection import ShardedEmbeddingCollection


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def optimizer_step(
    loss_fn: Callable[[Batch], torch.Tensor], optimizer: torch.optim.Optimizer, batch: Batch, device: torch.device
) -> float:
    """One training step shared by every loop (this Trainer, the ExFM streams): move the batch to the device,
    compute ``loss_fn(batch)``, backward (which also applies the embedding updates), dense optimizer step.
    -> the loss as a float."""
    batch = batch.to(device, non_blocking=True)
    loss = loss_fn(batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # also applies the embedding updates
    optimizer.step()
    return loss.item()


def prepare_data(cfg: Config, output_dir: Path | None, world: int = 1
                 ) -> tuple[PreparedDataset, PreparedDataset, tuple[int, int]]:
    """-> (train set, eval set, eval row range). Generates the synthetic set first when ``[data.synth]``
    (again when the set found there was generated with other options); under torchrun (``world`` > 1) rank 0
    generates it and the others wait for it. An eval set must have the training set's layout (features, tables
    and their sizes); the eval range may be empty (no evaluation)."""
    d = cfg.data
    train_path = d.train
    if d.synth:
        if not train_path:
            if output_dir is None:
                raise ValueError("data.synth needs data.train or an output directory to write into")
            train_path = str(output_dir / "data")
        if world > 1:
            _synthesize_on_rank0(cfg, Path(train_path))
        else:
            _synthesize(cfg, Path(train_path))
    if not train_path:
        raise ValueError("data.train: no training data given (a prepared directory, or a [data.synth] table)")
    train = PreparedDataset(train_path)
    if d.eval:
        ev = PreparedDataset(d.eval)
        diff = layout_difference(train, ev)
        if diff is not None:
            raise ValueError(
                f"data.eval {ev.path} was prepared with a different layout than data.train {train.path}: {diff} "
                "(train vs eval). Prepare the evaluation data with the training data's statistics (one prepare "
                "with a split, --stats-from the training output, or the same Criteo --max-ind-range) so that ids "
                "mean the same rows"
            )
        return train, ev, (0, len(ev))
    return train, train, held_out_rows(len(train), d.eval_fraction)


def held_out_rows(rows: int, eval_fraction: float) -> tuple[int, int]:
    """The evaluation rows of a training set without ``data.eval``: its last ``int(rows * eval_fraction)``."""
    n_eval = int(rows * eval_fraction)
    return rows - n_eval, rows


def _synthesize(cfg: Config, path: Path) -> None:
    """Generate ``[data.synth]`` into ``path`` unless it already holds a set generated with these options."""
    from recstack.data.synth.generate import SynthConfig, generate

    want = SynthConfig(**cfg.data.synth)
    meta = path / "meta.json"
    overwrite = False
    if meta.is_file():
        try:
            info = json.loads(meta.read_text()).get("info", {})
        except (ValueError, AttributeError):
            info = {}
        if not isinstance(info, dict) or info.get("generator") != "recstack.data.synth":
            raise ValueError(f"{path} holds a data set that [data.synth] did not generate; not overwriting it "
                             "(point data.train elsewhere, or remove [data.synth] to train on it)")
        have = info.get("config")
        if have == json.loads(json.dumps(want.to_dict())):
            return
        changed = sorted(k for k, v in json.loads(json.dumps(want.to_dict())).items()
                         if not isinstance(have, dict) or have.get(k) != v)
        print(f"{path}: generated with other [data.synth] options ({', '.join(changed)} differ); generating it "
              "again", file=sys.stderr)
        overwrite = True
    generate(want, path, progress=cfg.train.progress, overwrite=overwrite)


def _synthesize_on_rank0(cfg: Config, path: Path) -> None:
    """``_synthesize`` on rank 0 only (every rank writing the same files would race); the other ranks wait for it
    and stop with its error when it fails. The wait is on a group of its own without ``dist.timeout_s``: a large
    set takes longer to generate than a collective may."""
    import datetime

    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            _synthesize(cfg, path)
        except Exception as e:  # re-raised below, after the other ranks have been told
            error = e
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(status, src=0, group=group)
    dist.destroy_process_group(group)
    if error is not None:
        raise error
    if status[0] is not None:
        raise ValueError(f"rank 0 could not generate [data.synth] into {path}: {status[0]}")


class Trainer:
    def __init__(self, cfg: Config, output_dir: str | Path | None = None, resume: bool = False,
                 overwrite: bool = False) -> None:
        """``resume``: continue from the newest checkpoint in ``output_dir``; otherwise the run starts at step 0,
        and an earlier run's checkpoints and metrics there are an error unless ``overwrite`` removes them."""
        self.cfg = cfg
        t = cfg.train
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        seed_everything(t.seed)
        self.rank, self.world = 0, 1
        self.device = resolve_device(t.device)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun
            from recstack.distributed.parallelize import init_distributed

            self.rank, self.world, self.device = init_distributed(cfg.dist.timeout_s)
        self.is_main = self.rank == 0
        self.output_dir = Path(output_dir) if output_dir else None
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            resume = True  # torchrun --max-restarts started us again after a failure: continue, do not redo
        if self.output_dir and not resume:
            claim_output_dir(self.output_dir, overwrite, self.is_main)
        if self.output_dir and self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        self.train_ds, self.eval_ds, eval_range = prepare_data(cfg, self.output_dir, self.world)
        self.has_eval = eval_range[1] > eval_range[0]
        if not self.has_eval:
            why = (f"data.eval {self.eval_ds.path} has no rows" if self.eval_ds is not self.train_ds else
                   f"data.eval_fraction={cfg.data.eval_fraction:g} of {len(self.train_ds)} training rows holds no row")
            if t.target_auc:
                raise ValueError(f"train.target_auc={t.target_auc:g} needs evaluation rows, but {why}")
            if self.is_main:
                print(f"no evaluation: {why}; training without it (summary.json gets no eval metrics)",
                      file=sys.stderr)
        if self.eval_ds is self.train_ds:
            train_range = (0, eval_range[0])
        else:
            train_range = (0, len(self.train_ds))
        self.num_dense = len(self.train_ds.dense_features)
        self.table_sizes = capped_table_sizes(self.train_ds.table_sizes, cfg.model.max_table_size)
        caps = self.table_sizes if cfg.model.max_table_size > 0 else None
        self.train_loader = BatchLoader(
            self.train_ds, t.batch_size, train_range, shuffle=t.shuffle, seed=t.seed, table_caps=caps,
            rank=self.rank, world_size=self.world,
        )
        if len(self.train_loader) == 0:
            raise ValueError(
                f"{self.train_ds.path}: {train_range[1] - train_range[0]} training rows give no full batch "
                f"of {t.batch_size}"
            )
        self.eval_loader = BatchLoader(
            self.eval_ds, t.eval_batch_size, eval_range, drop_last=False, table_caps=caps,
            extras=("probability",), rank=self.rank, world_size=self.world,
        )
        self.model: DLRM = build_model(
            cfg, self.num_dense, self.table_sizes, self.device, self.train_ds.table_names
        )
        self.net: torch.nn.Module = self.model  # what the step calls: the model, or DDP around it
        split = self.model.split_batch  # ids as the tables read them (quotient-remainder: split by the loader thread)
        if self.model.qr is not None:
            self.train_loader.transform = self.eval_loader.transform = split
        prefetch = self.model.embeddings.next_batch_hook()
        if prefetch is not None:  # cached embedding tiers: the loader announces batches so rows come in ahead
            self.train_loader.transform = lambda b: prefetch(split(b))
        self.compression = CompressionRuntime(cfg, self.output_dir, self.rank, self.world)
        if self.world > 1:
            self._parallelize()
        self.compression.attach(self.model)  # eb codecs learn which table each chunk carries; --dump-a2a hook
        self.optimizer = build_dense_optimizer(cfg, self.model.dense_parameters())
        o = cfg.optim
        schedule = LRSchedule(o.lr_warmup_steps, o.lr_decay_start_step, o.lr_decay_steps)
        self.lr = LRScaler(schedule, self.optimizer, self.model) if schedule.active else None
        self.total_steps = t.max_steps or t.epochs * len(self.train_loader)
        self.step = 0
        self.target_step: int | None = None  # the step whose evaluation reached train.target_auc
        self.samples = 0
        self.train_seconds = 0.0
        self.ckpt_dir = self.output_dir / "checkpoints" if self.output_dir else None
        if resume:
            self._resume()
        # A resumed run drops what the stopped run logged after its checkpoint (it is about to be redone).
        self.logger = MetricsLogger(self.output_dir if self.is_main else None,
                                    resume_step=self.step if resume else None)

    def _parallelize(self) -> None:
        """Shard the tables by the plan (or ``dist.sharding``) and wrap the dense part in DDP."""
        from recstack.distributed.parallelize import placements_from_config, shard_model, wrap_ddp

        d = self.cfg.dist
        rpn = d.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        placements = placements_from_config(d, [t.name for t in self.model.embeddings.tables], self.world)
        fwd, bwd = self.compression.codecs()  # names, or configured error-bounded codecs for "eb"
        shard_model(self.model, placements, self.cfg.train.seed, self.device, fwd, bwd, rpn, d.aggregate_gradients)
        sharded = cast("ShardedEmbeddingCollection", self.model.embeddings)  # shard_model put it there
        self.net = wrap_ddp(self.model, self.device, sharded.stats)
        if d.pipeline:  # the prefetch thread moves each batch to the device and distributes its ids
            self.train_loader.transform = pipelined_input(sharded, self.model.split_batch, self.device)

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        pos = self.train_loader.position
        model_state = self.model.state_dict()
        if self.world > 1:  # embedding shards go through DCP, not into this replicated file
            model_state = {k: v for k, v in model_state.items() if not k.startswith("embeddings.")}
        state = {
            "model": model_state,
            "dense_optimizer": self.optimizer.state_dict(),
            "position": {"epoch": pos.epoch, "batch": pos.batch,
                         "global_batch_size": self.train_loader.global_batch_size},
            "samples": self.samples,
            "target_step": self.target_step,
            "train_seconds": self.train_seconds,
            "rng": rng_state(),
            "config": self.cfg.to_dict(),
            "num_dense": self.num_dense,
            "table_sizes": self.table_sizes,
            "table_names": self.train_ds.table_names,  # per feature; shared tables repeat
            "world_size": self.world,
        }
        if self.world == 1:  # with more ranks this state is rank 0's alone; see rank_state_dict
            state.update(self.rank_state_dict())
        return state

    def rank_state_dict(self) -> dict[str, Any]:
        """State that differs between ranks (error-feedback residuals of the chunks this rank sent): sharded
        checkpoints keep it in one file per rank."""
        return {"compression": self.compression.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        where = state.get("path", "the checkpoint")
        tables = convert_embedding_layout(state, self.model.embeddings, self.device) if self.world == 1 else None
        try:
            missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        except RuntimeError as e:  # shapes differ
            raise ConfigError(f"resume: {where} does not match the model: {e}") from e
        if self.world > 1:  # the sharded tables came from DCP
            missing = [k for k in missing if not k.startswith("embeddings.")]
        if unexpected or missing:
            raise ConfigError(f"resume: {where} does not match the model (was it trained with another [model] or "
                              f"optim.sparse?): missing {missing}, unexpected {unexpected}")
        emb = self.model.embeddings
        if tables is not None:  # an all-in-memory checkpoint's tables, into cached tiers
            emb.restore_tensors(*tables)
        elif emb.stores_rows_in_files:  # cached embedding tiers: their rows are files beside the state
            emb.restore_files(state.get("checkpoint_dir"))
        self.optimizer.load_state_dict(state["dense_optimizer"])
        self.train_loader.position = rebatched_position(state, self.train_loader, self.cfg.train.shuffle, self.is_main)
        self.step = int(state["step"])
        self.samples = int(state["samples"])
        self.target_step = state.get("target_step")  # a run that reached train.target_auc stays finished
        self.train_seconds = float(state["train_seconds"])
        set_rng_state(state["rng"])
        self.compression.load_state_dict(state.get("compression"), state.get("world_size"), self.device)
        if not self.cfg.train.max_steps:  # train.epochs: the epochs left, in batches of the size used now
            pos, per_epoch = self.train_loader.position, len(self.train_loader)
            left = self.cfg.train.epochs * per_epoch - (pos.epoch * per_epoch + pos.batch)
            self.total_steps = self.step + max(0, left)

    def _resume(self) -> None:
        state = find_resume_state(self.ckpt_dir, self.world, self.model.embeddings, self.device)
        if state is None:
            print("resume: no checkpoint found, starting from scratch")
            return
        self.load_state_dict(state)
        print(f"resume: continuing from {state['path']} (step {self.step})")

    def save(self) -> Path | None:
        if self.ckpt_dir is None:
            return None
        keep = self.cfg.train.keep_checkpoints
        if self.world > 1:
            from recstack.training.checkpoint.sharded import save_sharded

            sharded = cast("ShardedEmbeddingCollection", self.model.embeddings)
            return save_sharded(self.ckpt_dir, self.step, sharded, self.state_dict(), keep,
                                rank_state=self.rank_state_dict())
        files = self.model.embeddings.checkpoint_files()  # tables streamed beside the state (cached tiers)
        return save_checkpoint(self.ckpt_dir, self.step, self.state_dict(), keep=keep, files=files)

    # -- loop ------------------------------------------------------------------------------------------
    def train_step(self, batch) -> float:
        return optimizer_step(self._loss, self.optimizer, batch, self.device)

    def _loss(self, batch: Batch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.net(batch), batch.labels)

    def train(self) -> dict[str, Any]:
        if self.world == 1:
            return self._train()
        try:
            return self._train()
        except (RuntimeError, torch.distributed.DistError) as e:
            from recstack.distributed.parallelize import is_peer_failure
            from recstack.errors import PeerFailure

            if not is_peer_failure(e):
                raise  # this rank's own error, reported as it is
            raise PeerFailure(
                f"rank {self.rank}: a collective with the other ranks failed (a rank died, or none answered within "
                f"dist.timeout_s={self.cfg.dist.timeout_s:g} s) at step {self.step}: {e}"
            ) from e

    def _train(self) -> dict[str, Any]:
        t = self.cfg.train
        self.net.train()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (t.progress and self.is_main),
                   unit="step", dynamic_ncols=True)
        window_loss, window_n, window_t0, window_wait, window_step = 0.0, 0, time.perf_counter(), 0.0, 0.0
        tick = window_t0  # train_seconds counts data wait + steps, not evaluation or checkpoints
        reached: dict[str, float] | None = None  # the evaluation that reached train.target_auc
        while self.step < self.total_steps and reached is None and self.target_step is None:
            for batch in self.train_loader.iterate_epoch(limit=self.total_steps - self.step):
                self.compression.begin_step(self.step)
                lr_factor = self.lr.set_step(self.step) if self.lr is not None else None
                started = time.perf_counter()
                loss = self.train_step(batch)
                now = time.perf_counter()
                self.train_seconds += now - tick
                window_wait += started - tick  # waiting for the loader
                window_step += now - started
                tick = now
                if not math.isfinite(loss):
                    raise FloatingPointError(f"step {self.step + 1}: loss is {loss}; lower the learning rates")
                self.step += 1
                self.samples += batch.batch_size * self.world  # global samples
                window_loss += loss
                window_n += 1
                bar.update(1)
                if self.step % t.log_every == 0 or self.step == self.total_steps:
                    now = time.perf_counter()
                    sps = window_n * t.batch_size * self.world / max(now - window_t0, 1e-9)
                    values = {"loss": window_loss / window_n, "samples_per_sec": sps,
                              "time_data_wait": window_wait / window_n, "time_step": window_step / window_n}
                    if lr_factor is not None:  # the schedule's factor at the window's last step
                        values["lr_factor"] = lr_factor
                    # bytes and seconds per collective since the last log line (none in one process)
                    values.update({k: v / window_n for k, v in self.model.embeddings.pop_comm_stats().items()})
                    values.update(self.compression.metrics(window_n))  # eb: ratio, codec time, bounds in force
                    self.logger.log(self.step, "train", values)
                    bar.set_postfix(loss=f"{window_loss / window_n:.4f}", samples_s=f"{sps:,.0f}")
                    window_loss, window_n, window_t0, window_wait, window_step = 0.0, 0, now, 0.0, 0.0
                if t.eval_every and self.has_eval and self.step % t.eval_every == 0 and self.step < self.total_steps:
                    result = self.evaluate()  # on every rank the same (gathered) figures, so all stop together
                    self.logger.log(self.step, "eval", result)
                    tick = window_t0 = time.perf_counter()
                    if self._reached_target(result):
                        reached = result
                if t.checkpoint_every and self.step % t.checkpoint_every == 0:
                    self.save()
                    tick = time.perf_counter()
                if self.step >= self.total_steps or reached is not None:
                    break
        bar.close()
        if reached is not None:
            final = reached
        elif self.has_eval:
            final = self.evaluate()
            if not any(r["step"] == self.step and r["kind"] == "eval" for r in self.logger.kept):
                self.logger.log(self.step, "eval", final)  # (a finished run resumed has it already)
            self._reached_target(final)  # the last evaluation counts too
        else:
            final = {}  # no evaluation rows: no metrics
        self.save()
        summary = self.summary(final)
        self.logger.close()
        return summary

    def close(self) -> None:
        """Release what the run holds besides memory: the cached embedding tiers' prefetch thread and table files.
        The model cannot look up cached rows afterwards."""
        self.model.embeddings.close()

    def _reached_target(self, result: dict[str, float]) -> bool:
        """Whether this evaluation reaches train.target_auc for the first time (recorded as target_step)."""
        t = self.cfg.train
        if not t.target_auc or self.target_step is not None or result["auc"] < t.target_auc:
            return False
        self.target_step = self.step
        if self.is_main:
            print(f"reached train.target_auc={t.target_auc:g} at step {self.step} ({self.samples} samples)")
        return True

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.net.eval()
        metrics = BinaryMetrics()
        self.eval_loader.position = LoaderPosition()
        for batch in self.eval_loader.iterate_epoch():
            batch = batch.to(self.device)
            metrics.update(self.net(batch), batch.labels)
        self.net.train()
        self.model.embeddings.pop_comm_stats()  # evaluation traffic is not part of the training step's figures
        if self.world > 1:
            from recstack.distributed.parallelize import all_gather_metrics

            metrics = all_gather_metrics(metrics)
        return metrics.compute()

    def oracle_auc(self) -> float | None:
        """AUC of the synthetic generator's true click probabilities on the evaluation rows."""
        if not self.eval_ds.has("probability"):
            return None
        lo, hi = self.eval_loader.start, self.eval_loader.end
        p = torch.from_numpy(np.array(self.eval_ds.column("probability")[lo:hi]))
        y = torch.from_numpy(np.array(self.eval_ds.column("labels")[lo:hi]))
        return float(auc(p, y))

    def summary(self, final: dict[str, float]) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: final[k] for k in ("auc", "logloss", "ne", "calibration", "accuracy") if k in final
        }
        out["eval_examples"] = final.get("num_examples", 0)
        out["steps"] = self.step
        out["train_samples"] = self.samples
        out["samples_per_sec"] = self.samples / self.train_seconds if self.train_seconds else None
        out["world_size"] = self.world
        if self.cfg.train.target_auc:
            out["target_auc"] = self.cfg.train.target_auc
            out["target_reached_step"] = self.target_step  # None: not reached within the steps given
        oracle = self.oracle_auc() if self.has_eval else None
        if oracle is not None:
            out["oracle_auc"] = oracle
            out["auc_gap_closed"] = (out["auc"] - 0.5) / (oracle - 0.5) if oracle > 0.5 and "auc" in out else None
        if self.output_dir and self.is_main:
            # An undefined metric (AUC of a one-class evaluation set) is null: JSON has no NaN.
            safe = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in out.items()}
            (self.output_dir / "summary.json").write_text(json.dumps(safe, indent=2, allow_nan=False))
            from recstack.training.plots import plot_comm_breakdown, plot_curves

            plot_curves(self.output_dir / "metrics.jsonl", self.output_dir / "curves.png")
            if self.world > 1:
                plot_comm_breakdown(self.output_dir / "metrics.jsonl", self.output_dir / "comm_breakdown.png",
                                    pipelined=self.cfg.dist.pipeline)
        return out


def pipelined_input(embeddings: ShardedEmbeddingCollection, split: Callable[[Batch], Batch], device: torch.device
                    ) -> Callable[[Batch], Batch]:
    """The loader's transform when ``dist.pipeline`` is on: in its prefetch thread, move each batch to the device
    and send its ids to the ranks that hold their rows (``embeddings.route``)."""

    def transform(batch: Batch) -> Batch:
        if device.type == "cuda":  # a new thread's current device is cuda:0: without this, rank r's loader
            torch.cuda.set_device(device)  # thread would make a CUDA context (and allocations) on GPU 0
        batch = split(batch.to(device))
        embeddings.route(batch.sparse)
        return batch

    return transform
