"""MetricsLogger (JSONL + TensorBoard), read_jsonl and plot_curves."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import matplotlib.image
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recstack.training.logger import MetricsLogger, read_jsonl
from recstack.training.plots import _series, plot_curves

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(out: Path, train_steps: int = 30, eval_every: int | None = 10) -> Path:
    """A run with a decreasing train loss and, optionally, eval lines; returns the JSONL path."""
    with MetricsLogger(out) as log:
        for step in range(1, train_steps + 1):
            log.log(step, "train", {"loss": 0.7 / math.sqrt(step), "lr": 0.01})
            if eval_every and step % eval_every == 0:
                log.log(step, "eval", {"auc": 0.6 + step / 1000, "ne": 0.95 - step / 1000, "num_examples": 500})
        assert log.path is not None
        return log.path


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels."""
    img = matplotlib.image.imread(path)
    return img.shape[1], img.shape[0]


def test_jsonl_lines_written_and_readable(tmp_path: Path) -> None:
    before = time.time()
    with MetricsLogger(tmp_path / "run") as log:
        log.log(5, "train", {"loss": 0.5, "lr": 1e-3})
        # One line per call, flushed: readable while the logger is still open.
        assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["loss"] == 0.5
        log.log(10, "eval", {"auc": float("nan"), "ne": float("inf"), "num_examples": 7, "acc": torch.tensor(0.25)})
    after = time.time()

    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 2
    train, ev = records
    assert train["step"] == 5 and train["kind"] == "train"
    assert train["loss"] == 0.5 and train["lr"] == 1e-3
    assert before <= train["time"] <= ev["time"] <= after
    assert ev["auc"] is None and ev["ne"] is None  # non-finite -> null
    assert ev["num_examples"] == 7 and isinstance(ev["num_examples"], int)
    assert ev["acc"] == 0.25
    # Each line is standalone strict JSON (no NaN/Infinity tokens).
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_reopening_appends(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(1, "train", {"loss": 1.0})
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(2, "train", {"loss": 0.5})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert not (tmp_path / "tb").exists()


def test_tensorboard_event_files(tmp_path: Path) -> None:
    _write_run(tmp_path, train_steps=20, eval_every=10)
    event_files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert event_files and all(f.stat().st_size > 0 for f in event_files)

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/auc", "eval/ne", "eval/num_examples"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 21))
    assert loss[3].value == pytest.approx(0.7 / 2, rel=1e-6)  # float32 in the event file
    assert [e.step for e in acc.Scalars("eval/auc")] == [10, 20]


def test_non_finite_values_skipped_in_tensorboard(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as log:
        log.log(1, "eval", {"auc": float("nan"), "ne": 0.9})
        log.log(2, "eval", {"auc": 0.7, "ne": 0.8})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/auc")] == [2]
    assert [e.step for e in acc.Scalars("eval/ne")] == [1, 2]


def test_disabled_logger_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    log = MetricsLogger(None)
    log.log(1, "train", {"loss": 1.0})
    log.close()
    assert log.path is None
    assert list(tmp_path.iterdir()) == []


def test_logger_rejects_misuse(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="reserved"):
        log.log(1, "train", {"step": 3.0})
    with pytest.raises(TypeError, match="metric 'loss'"):
        log.log(1, "train", {"loss": "low"})
    log.close()
    log.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        log.log(2, "train", {"loss": 1.0})
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


def test_read_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "loss": 1.0}\n\n{"step": 2, "kind"\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3: invalid JSON"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: expected a JSON object"):
        read_jsonl(path)


def test_read_jsonl_ignores_unfinished_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "loss": 1.0}\n{"step": 2, "kind": "tr')
    assert read_jsonl(path) == [{"step": 1, "kind": "train", "loss": 1.0}]


def test_series_skips_nulls_and_sorts_by_step() -> None:
    records = [
        {"step": 20, "kind": "eval", "auc": 0.8},
        {"step": 10, "kind": "eval", "auc": 0.7},
        {"step": 15, "kind": "eval", "auc": None},
        {"step": 12, "kind": "train", "auc": 0.1},
        {"step": 30, "kind": "eval", "ne": 0.9},
    ]
    assert _series(records, "eval", "auc", Path("m.jsonl")) == ([10.0, 20.0], [0.7, 0.8])
    with pytest.raises(ValueError, match=r"m\.jsonl: record 1"):
        _series([{"step": 1, "kind": "eval", "auc": "high"}], "eval", "auc", Path("m.jsonl"))


def test_plot_with_train_and_eval(tmp_path: Path) -> None:
    jsonl = _write_run(tmp_path / "run", train_steps=40, eval_every=10)
    out = plot_curves(jsonl, tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert _png_size(out) == (800, 900)  # the three-panel layout


def test_plot_with_train_only(tmp_path: Path) -> None:
    jsonl = _write_run(tmp_path / "run", train_steps=5, eval_every=None)
    out = plot_curves(jsonl, tmp_path / "curves.png")
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert _png_size(out) == (800, 900)


def test_plot_empty_file(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("")
    out = plot_curves(jsonl, tmp_path / "curves.png")
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert _png_size(out) == (600, 300)  # the single "no data" figure


def test_plot_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        plot_curves(tmp_path / "absent.jsonl", tmp_path / "curves.png")
