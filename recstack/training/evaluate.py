"""A training run's evaluation: the pass over the evaluation rows (every rank scores its slice, the metrics are
merged across ranks), the generator's oracle AUC on synthetic data, and the run's summary (``summary.json``,
``curves.png``, ``reliability.png``, ``comm_breakdown.png``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recstack.data.batch import Batch
from recstack.data.loader import BatchLoader, LoaderPosition
from recstack.data.prepared_dataset import PreparedDataset
from recstack.embedding.collection import EmbeddingCollection
from recstack.io import atomic_write_text, json_safe
from recstack.metrics import BinaryMetrics, auc
from recstack.training.step import Progress

METRICS = ("auc", "logloss", "ne", "calibration", "ece", "accuracy")  # what summary.json reports of an evaluation


@torch.no_grad()
def evaluate_loader(net: torch.nn.Module, loader: BatchLoader, device: torch.device,
                    embeddings: EmbeddingCollection, world: int,
                    prepare: Callable[[Batch], Batch] | None = None) -> BinaryMetrics:
    """Score every batch of ``loader`` from its start with ``net`` (left in training mode) -> the accumulated
    ``recstack.metrics.BinaryMetrics``, on every rank the same (gathered) ones. Collective under torchrun.
    ``prepare``: applied to each batch in this thread (``InputPipeline.eval_step``: collectives of its own)."""
    net.eval()
    metrics = BinaryMetrics()
    loader.position = LoaderPosition()
    for batch in loader.iterate_epoch():
        batch = batch.to(device)
        if prepare is not None:
            batch = prepare(batch)
        metrics.update(net(batch), batch.labels)
    net.train()
    embeddings.pop_counters()  # evaluation traffic is not part of the training step's figures
    if world > 1:
        from recstack.distributed.parallelize import all_gather_metrics

        metrics = all_gather_metrics(metrics)
    return metrics


def oracle_auc(ds: PreparedDataset, rows: tuple[int, int]) -> float | None:
    """AUC of the synthetic generator's true click probabilities on the rows [lo, hi) of ``ds``; None when the
    set has none (not generated)."""
    if not ds.has("probability"):
        return None
    lo, hi = rows
    p = torch.from_numpy(np.array(ds.column("probability")[lo:hi]))
    y = torch.from_numpy(np.array(ds.column("labels")[lo:hi]))
    return float(auc(p, y))


def select_metrics(result: dict[str, float]) -> dict[str, float]:
    """What ``summary.json`` reports of an evaluation ``result``."""
    return {k: result[k] for k in METRICS if k in result}


def summarize(final: dict[str, float], progress: Progress, world: int, target_auc: float,
              oracle: float | None, reliability: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """The run's summary: the final evaluation's metrics (``final``, empty without evaluation rows), steps,
    samples, throughput, the target AUC's step, the gap to the oracle AUC closed and the final evaluation's
    ``reliability`` bins (``BinaryMetrics.reliability``)."""
    out: dict[str, Any] = select_metrics(final)
    out["eval_examples"] = final.get("num_examples", 0)
    out["steps"] = progress.step
    out["train_samples"] = progress.samples
    out["samples_per_sec"] = progress.samples / progress.train_seconds if progress.train_seconds else None
    out["world_size"] = world
    if target_auc:
        out["target_auc"] = target_auc
        out["target_reached_step"] = progress.target_step  # None: not reached within the steps given
    if oracle is not None:
        out["oracle_auc"] = oracle
        out["auc_gap_closed"] = (out["auc"] - 0.5) / (oracle - 0.5) if oracle > 0.5 and "auc" in out else None
    if final and reliability is not None:
        out["reliability"] = reliability
    return out


def figures(m: dict[str, Any]) -> str:
    """AUC, logloss and NE of an evaluation (an undefined one as nan), as the console shows them."""
    return "  ".join(f"{name} {float('nan') if m.get(k) is None else m[k]:.4f}"
                     for name, k in (("AUC", "auc"), ("logloss", "logloss"), ("NE", "ne")))


def write_summary(summary: dict[str, Any], output_dir: Path, comm_breakdown: bool, pipelined: bool) -> None:
    """``summary.json`` and the plots of ``metrics.jsonl`` (the communication breakdown under torchrun)."""
    # An undefined metric (AUC of a one-class evaluation set) is null: JSON has no NaN.
    atomic_write_text(output_dir / "summary.json", json.dumps(json_safe(summary), indent=2, allow_nan=False))
    from recstack.training.plots import plot_comm_breakdown, plot_curves, plot_reliability

    plot_curves(output_dir / "metrics.jsonl", output_dir / "curves.png")
    if "reliability" in summary:
        plot_reliability(summary["reliability"], output_dir / "reliability.png")
    if comm_breakdown:
        plot_comm_breakdown(output_dir / "metrics.jsonl", output_dir / "comm_breakdown.png", pipelined=pipelined)

