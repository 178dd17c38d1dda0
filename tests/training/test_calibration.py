"""The expected calibration error and the reliability bins of BinaryMetrics, the run's reliability.png and the
end-of-training line."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL, run_cli, train_args

from recstack.metrics import ECE_BINS, BinaryMetrics
from recstack.training.plots import plot_reliability


def _brute_force_ece(logits: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    """The definition, one example and one bin at a time."""
    q = [1.0 / (1.0 + math.exp(-float(x))) for x in logits]
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        members = [i for i, p in enumerate(q) if lo <= p < hi or (b == bins - 1 and p == 1.0)]
        if members:
            gap = sum(q[i] for i in members) / len(members) - sum(float(labels[i]) for i in members) / len(members)
            total += len(members) / len(q) * abs(gap)
    return total


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 4.0), (2, 0.1)])
def test_ece_matches_the_brute_force_definition(seed: int, scale: float) -> None:
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=3000) * scale).astype(np.float32)
    labels = (rng.random(3000) < 1 / (1 + np.exp(-0.7 * logits))).astype(np.float32)
    m = BinaryMetrics()
    for lo in range(0, 3000, 700):  # over several batches
        m.update(torch.from_numpy(logits[lo:lo + 700]), torch.from_numpy(labels[lo:lo + 700]))
    got = m.compute()
    assert ECE_BINS == 15
    assert got["ece"] == pytest.approx(_brute_force_ece(logits, labels), abs=1e-12)
    # next to today's mean-prediction / rate figure, which it does not replace
    assert got["calibration"] == pytest.approx(got["mean_prediction"] / got["ctr"], rel=1e-9)


def test_reliability_bins_count_every_example_once() -> None:
    logits = torch.tensor([-50.0, -1.0, 0.0, 0.01, 2.0, 50.0])  # q ~ 0 and q = 1.0 in the first and last bins
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    m = BinaryMetrics()
    m.update(logits, labels)
    r = m.reliability()
    assert sum(r["count"]) == 6 and r["count"][0] == 1 and r["count"][-1] == 1
    assert r["lower"][0] == 0.0 and r["upper"][-1] == 1.0 and len(r["count"]) == ECE_BINS
    seven = int(0.5 * 15)  # q = 0.5 and q = sigmoid(0.01) share bin 7
    assert r["count"][seven] == 2 and r["rate"][seven] == 0.5
    empty = [b for b, c in enumerate(r["count"]) if c == 0]
    assert all(math.isnan(r["rate"][b]) and math.isnan(r["mean_prediction"][b]) for b in empty)
    assert math.isnan(BinaryMetrics().compute()["ece"])  # no examples: undefined


def test_ece_of_gathered_ranks_equals_one_accumulator() -> None:
    rng = np.random.default_rng(3)
    x, y = torch.from_numpy(rng.normal(size=500).astype(np.float32)), torch.from_numpy((rng.random(500) < 0.3)
                                                                                      .astype(np.float32))
    whole, a, b = BinaryMetrics(), BinaryMetrics(), BinaryMetrics()
    whole.update(x, y)
    a.update(x[:200], y[:200])
    b.update(x[200:], y[200:])
    a.merge(BinaryMetrics.from_state(b.state()))
    assert a.compute()["ece"] == pytest.approx(whole.compute()["ece"], abs=1e-15)


def test_plot_reliability_with_empty_bins(tmp_path: Path) -> None:
    m = BinaryMetrics()
    m.update(torch.tensor([0.0, 0.0, 3.0]), torch.tensor([1.0, 0.0, 1.0]))
    assert plot_reliability(m.reliability(), tmp_path / "r.png").stat().st_size > 0
    assert plot_reliability(BinaryMetrics().reliability(), tmp_path / "none.png").stat().st_size > 0


def test_run_writes_ece_reliability_and_prints_logloss(tiny_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = run_cli(train_args(run, tiny_dataset, [*SMALL, "train.max_steps=40"]))
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    line = re.search(r"final eval: AUC (\d\.\d{4})  logloss (\d\.\d{4})  NE (\d\.\d{4})", res.stdout)
    assert line is not None, res.stdout[-500:]
    assert float(line.group(2)) == pytest.approx(summary["logloss"], abs=5e-5)
    assert 0.0 <= summary["ece"] < 1.0
    bins = summary["reliability"]
    assert sum(bins["count"]) == summary["eval_examples"] and len(bins["count"]) == ECE_BINS
    assert (run / "reliability.png").stat().st_size > 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "ece" in [x for x in lines if x["kind"] == "eval"][-1]
