"""Streaming windows and the streaming trainer: progressive evaluation, one pass per window, exact resume, and a
crafted checkpoint skipped on resume without running anything."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Payload

from recstack.data.format import PreparedFormatError
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.synth.generate import SynthConfig, generate
from recstack.exfm.config import NetSpec, StreamConfig
from recstack.exfm.fm import load_snapshot, run_fm_windows
from recstack.exfm.source import PreparedWindows
from recstack.exfm.windows import VerticalIndex, make_windows, row_windows, time_windows
from recstack.training.checkpoint.single import latest_checkpoint, list_checkpoints


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(SynthConfig(rows=2400, num_days=5, num_verticals=2, table_sizes=(30, 40), num_dense=2,
                                calibration_rows=512, seed=2), tmp_path_factory.mktemp("stream") / "d",
                    progress=False)


def _spec() -> NetSpec:
    spec = NetSpec(batch_size=64)
    spec.model.embedding_dim, spec.model.bottom_mlp, spec.model.top_mlp = 4, [8, 4], [8, 1]
    spec.optim.dense, spec.optim.dense_lr, spec.optim.sparse = "adam", 0.01, "rowwise_adagrad"
    return spec


def test_time_and_row_windows() -> None:
    ts = np.array([100, 100, 101, 103, 103, 104])
    got = [(w.index, w.start, w.end) for w in time_windows(ts, 2.0)]
    assert got == [(0, 0, 3), (1, 3, 5), (2, 5, 6)]
    got = [(w.index, w.start, w.end) for w in time_windows(ts, 1.0)]
    assert got == [(0, 0, 2), (1, 2, 3), (2, 3, 3), (3, 3, 5), (4, 5, 6)]  # an empty window keeps its place
    assert [(w.start, w.end) for w in row_windows(7, 3)] == [(0, 3), (3, 6), (6, 7)]
    with pytest.raises(PreparedFormatError, match="row 2 has timestamp 99 after 101"):
        time_windows(np.array([100, 101, 99]), 1.0, "x/timestamp.bin")


def test_windows_and_verticals_of_a_synthetic_stream(data: Path) -> None:
    ds = PreparedDataset(data)
    windows = make_windows(ds, StreamConfig(window=1.0))
    assert len(windows) == 5 and windows[0].start == 0 and windows[-1].end == len(ds)
    ts = np.asarray(ds.column("timestamp"))
    for w in windows:
        assert (ts[w.start : w.end] == w.index).all()
    index = VerticalIndex(ds)
    rows = [index.rows(windows[2], v) for v in index.verticals]
    assert sorted(np.concatenate(rows).tolist()) == list(range(windows[2].start, windows[2].end))
    assert make_windows(ds, StreamConfig(window_rows=1000, max_windows=2))[1].end == 2000


def _run(data: Path, out: Path) -> dict:
    ds = PreparedDataset(data)
    return run_fm_windows(PreparedWindows(ds, make_windows(ds, StreamConfig(window=1.0))), _spec(), 0, out,
                          publish_every=2)


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("ref")
    return _run(data, out), out


def test_progressive_evaluation_comes_before_training(data: Path, reference: tuple[dict, Path]) -> None:
    res, out = reference
    recs = res["records"]
    assert [r["window"] for r in recs] == [0, 1, 2, 3, 4]
    ds = PreparedDataset(data)
    sizes = [w.rows for w in make_windows(ds, StreamConfig(window=1.0))]
    assert [r["fm"]["num_examples"] for r in recs] == sizes  # every row of window t is evaluated ...
    assert [r["train_rows"] for r in recs] == sizes  # ... and trained on, once
    # window 0 is evaluated by the untrained model: its NE is far from what training reaches later
    assert recs[0]["fm"]["ne"] > recs[-1]["fm"]["ne"]
    # snapshots every 2 windows, version = windows trained on; version 2 scores like the model after window 1
    assert [p.name for p in list_checkpoints(out / "snapshots")] == ["ckpt_000000002.pt", "ckpt_000000004.pt"]
    model, _ = load_snapshot(out / "snapshots", 4)
    batch = ds.batch(0, 50)
    assert torch.isfinite(model(batch)).all()


def test_resume_after_a_crash_mid_window_matches_an_uninterrupted_stream(
    data: Path, reference: tuple[dict, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, ref_dir = reference
    from recstack.data.loader import BatchLoader

    real = BatchLoader.iterate_epoch
    calls = {"n": 0}

    def crashing(self):
        for i, batch in enumerate(real(self)):
            if self.batch_size == 64 and self.start >= 1400 and i == 3:  # training, inside window 2 or 3
                calls["n"] += 1
                raise KeyboardInterrupt("simulated kill")
            yield batch

    monkeypatch.setattr(BatchLoader, "iterate_epoch", crashing)
    with pytest.raises(KeyboardInterrupt):
        _run(data, tmp_path / "run")
    assert calls["n"] == 1
    monkeypatch.setattr(BatchLoader, "iterate_epoch", real)
    done = len(list_checkpoints(tmp_path / "run" / "checkpoints"))
    assert done == 1  # keep=1: the newest window checkpoint only
    res = _run(data, tmp_path / "run")
    assert _same_but_timing(res["records"], ref["records"])
    for version in (2, 4):
        a, _ = load_snapshot(ref_dir / "snapshots", version)
        b, _ = load_snapshot(tmp_path / "run" / "snapshots", version)
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert ka == kb and torch.equal(va, vb), ka
    final_a, final_b = latest_checkpoint(ref_dir / "checkpoints"), latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert final_a["next_window"] == final_b["next_window"] == 5
    for k, v in final_a["model"].items():
        assert torch.equal(v, final_b["model"][k]), k
    logged = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(logged) == 5  # every window logged exactly once across the crash


def _same_but_timing(a: list[dict], b: list[dict]) -> bool:
    strip = [{k: v for k, v in r.items() if k != "train_seconds"} for r in a]
    return strip == [{k: v for k, v in r.items() if k != "train_seconds"} for r in b]


def test_resume_skips_a_crafted_checkpoint_naming_it_and_runs_nothing(reference: tuple[dict, Path], data: Path,
                                                                        tmp_path: Path) -> None:
    """A ``ckpt_*.pt`` newer than the stream's own, crafted to run a command when unpickled: the resume of the
    stream (``StreamTrainer``'s, as ``recstack exfm`` runs it) skips it with a warning naming the file, continues
    from the intact checkpoint (every window done: the records are the uninterrupted run's), and the command never
    runs."""
    ref, ref_dir = reference
    run = tmp_path / "run"
    shutil.copytree(ref_dir, run)
    ckpts = run / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["ckpt_000000005.pt"]
    marker, crafted = tmp_path / "pwned", ckpts / "ckpt_000000009.pt"
    torch.save({"complete": True, "next_window": 0, "x": Payload(marker)}, crafted)  # a valid torch file
    refused = re.escape(f"skipping {crafted}: refused: it holds objects other than tensors")
    with pytest.warns(UserWarning, match=refused):
        res = _run(data, run)
    assert not marker.exists()
    assert res["records"] == ref["records"]
    assert crafted.is_file()  # skipped, not removed: what to do with it is the user's call
