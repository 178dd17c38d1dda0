"""Adaptive bounds, the [compression] config, payload capture (recstack train --dump-a2a) and analyze-a2a."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import train_args

from recstack.cli.main import main
from recstack.compression.config import CompressionConfig
from recstack.compression.eb.bounds import DualLevelBound, multiplier
from recstack.config import load_config
from recstack.data.prepare.criteo import KAGGLE_CARDINALITIES
from recstack.data.prepared_dataset import PreparedDataset
from recstack.embedding.collection import TableConfig, init_table
from recstack.errors import ConfigError


@pytest.mark.parametrize("iteration,step,linear,const", [
    (0, 2.0, 2.0, 2.0), (10, 1.9, 1.9, 2.0), (55, 1.5, 1.45, 2.0), (99, 1.1, 1.01, 2.0), (100, 1.0, 1.0, 1.0),
    (10_000, 1.0, 1.0, 1.0)])
def test_iteration_multipliers(iteration, step, linear, const):
    assert multiplier("step", iteration, 2.0, 100) == pytest.approx(step)
    assert multiplier("linear", iteration, 2.0, 100) == pytest.approx(linear)
    assert multiplier("constant", iteration, 2.0, 100) == const
    assert multiplier("off", iteration, 2.0, 100) == 1.0
    log = [multiplier("log", i, 2.0, 100) for i in range(0, 101, 10)]
    assert log[0] == 2.0 and log[-1] == pytest.approx(1.0) and all(a > b for a, b in zip(log, log[1:], strict=False))
    assert log[1] < multiplier("linear", 10, 2.0, 100)  # log falls fastest at the start


def test_default_classes_reproduce_the_papers_kaggle_split():
    tables = [(f"C{i + 1}", n) for i, n in enumerate(KAGGLE_CARDINALITIES)]
    policy = DualLevelBound(CompressionConfig(), tables)
    classes = [t.klass for t in policy.tables]
    assert classes.count("tight") == 8 and classes.count("loose") == 6 and classes.count("base") == 12
    largest = sorted(range(26), key=lambda i: -KAGGLE_CARDINALITIES[i])[:8]
    assert all(policy.tables[i].klass == "tight" for i in largest)
    assert policy.bound(2, 0) == pytest.approx(0.02) and policy.bound(2, 65536) == pytest.approx(0.01)  # C3: 10M
    assert policy.bound(8, 10**6) == pytest.approx(0.05)  # C9: 3 rows
    assert policy.in_force(0) == {"tight": 0.02, "base": 0.06, "loose": 0.1}


def test_table_overrides_and_backward_scale():
    cfg = CompressionConfig(table_bounds={"C2": 0.002}, schedule="off")
    policy = DualLevelBound(cfg, [("C1", 10), ("C2", 10**6)], scale=0.5)
    assert policy.bound(1, 0) == pytest.approx(0.001) and policy.bound(0, 0) == pytest.approx(0.025)
    assert policy.in_force(5)["C2"] == pytest.approx(0.001)
    with pytest.raises(ValueError, match="no table named C9"):
        DualLevelBound(CompressionConfig(table_bounds={"C9": 0.1}), [("C1", 10)])


@pytest.mark.parametrize("override,match", [
    ("compression.bound_mode=\"pct\"", "bound_mode"), ("compression.schedule_c=0.5", "schedule_c"),
    ("compression.tight_min_rows=5", "tight_min_rows"), ("compression.table_bounds={C1=-1}", "C1"),
    ("compression.dump_steps=[0]", "dump_steps"), ("compression.lossless=\"lz4\"", "lossless"),
    ("compression.schedule_c=inf", "schedule_c"), ("compression.base_bound=inf", "base_bound"),
    ("compression.backward_scale=nan", "backward_scale"), ("compression.table_bounds={C1=inf}", "C1")])
def test_config_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


@pytest.fixture(scope="module")
def capture(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cap")
    options = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.threads=1",
               "train.progress=false", "train.max_steps=4", "train.batch_size=256"]
    args = train_args(out / "run", tiny_dataset, options, "--dump-a2a", str(out / "dump"), "--dump-steps", "1,3")
    assert main(args) == 0
    return out / "dump"


def test_dump_holds_each_features_pooled_rows_and_gradients(capture: Path, tiny_dataset: Path):
    meta = json.loads((capture / "meta.json").read_text())
    assert [f["feature"] for f in meta["features"]] == ["C1", "C2", "C3", "C4"] and meta["steps"] == [1, 3]
    names = sorted(p.name for p in capture.glob("*.npy"))
    assert names == sorted(f"{d}_C{f}_s{s}_r0.npy" for d in ("fwd", "bwd") for f in range(1, 5) for s in (1, 3))
    # step 1 pools the initial rows of the first batch's ids (one id per feature: the row itself)
    ds = PreparedDataset(tiny_dataset)
    ids = np.asarray(ds.column("sparse")[:256])  # no shuffling: the first batch is the first rows
    for f, info in enumerate(meta["features"]):
        got = np.load(capture / f"fwd_{info['feature']}_s1_r0.npy")
        table = init_table(TableConfig(info["table"], info["rows"], 8, (f,)), 0, f).numpy()
        assert got.shape == (256, 8)
        np.testing.assert_array_equal(got, table[ids[:, f]])
        grad = np.load(capture / f"bwd_{info['feature']}_s1_r0.npy")
        assert grad.shape == (256, 8) and np.abs(grad).sum() > 0


def test_analyze_reports_and_json(capture: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["analyze-a2a", str(capture), "--codecs", "eb,fp16,zstd-q", "--direction", "fwd"]) == 0
    text = capsys.readouterr().out
    assert "geometric mean over tables" in text and "C4" in text
    assert main(["analyze-a2a", str(capture), "--json", "--bound", "0.05", "--codecs", "eb,int8"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 16 and {r["direction"] for r in rows} == {"fwd", "bwd"}
    for r in rows:
        eb = r["codecs"]["eb"]
        assert eb["within_bound"] and eb["max_error"] <= 0.05 * r["range"] and eb["ratio"] > 2
        assert r["distinct_rows"] <= 256 and r["table_rows"] in (50, 300, 7, 1000)
    small = [r for r in rows if r["table"] == "C3" and r["direction"] == "fwd"]  # 7 rows: 7 distinct vectors
    assert all(r["distinct_rows"] <= 7 for r in small)


def test_analyze_raw_float32_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (64, 8)).astype("<f4")
    a.tofile(tmp_path / "other_dlrm.bin")
    assert main(["analyze-a2a", str(tmp_path / "other_dlrm.bin"), "--raw-shape", "64x8", "--json", "--abs",
                 "--bound", "0.01", "--codecs", "eb"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["shape"] == [64, 8] and row["direction"] == "raw" and row["codecs"]["eb"]["max_error"] <= 0.01
    assert main(["analyze-a2a", str(tmp_path / "other_dlrm.bin"), "--raw-shape", "60x8"]) == 2
    assert "needs 480" in capsys.readouterr().err
    assert main(["analyze-a2a", str(tmp_path / "other_dlrm.bin")]) == 2
    assert "--raw-shape" in capsys.readouterr().err
    with open(tmp_path / "other_dlrm.bin", "ab") as f:  # two stray bytes: not the 64x8 float32 it claims
        f.write(b"\0\0")
    for shape in ("64x8", "0x8"):
        assert main(["analyze-a2a", str(tmp_path / "other_dlrm.bin"), "--raw-shape", shape, "--codecs", "fp16"]) == 2
        assert "2050 bytes are not a whole number of float32 values" in capsys.readouterr().err


def test_evaluation_passes_are_exact_and_training_passes_compressed():
    import torch

    from recstack.compression.base import ChunkKey
    from recstack.compression.eb.core import describe
    from recstack.compression.runtime import CompressionRuntime
    from recstack.data.batch import SparseFeatures
    from recstack.embedding.fused import FusedEmbeddingBagCollection
    from recstack.embedding.sparse_optim import SparseOptimizerConfig

    cfg = load_config(None, ['dist.forward_codec="eb"', 'dist.backward_codec="fp16"'])
    runtime = CompressionRuntime(cfg.compression, cfg.dist.forward_codec, cfg.dist.backward_codec, cfg.train.batch_size,
                                 None)
    fwd, bwd = runtime.codecs()
    assert bwd == "fp16" and fwd.name == "eb"
    model = torch.nn.Module()
    model.embeddings = FusedEmbeddingBagCollection([TableConfig("C1", 100, 8, (0,))], SparseOptimizerConfig())
    runtime.attach(model)
    x, key = torch.randn(64, 8), ChunkKey("fwd_a2a", 0, 1, 0)
    ids = SparseFeatures.from_dense_ids(torch.randint(0, 100, (4, 1)))
    model.embeddings.eval()
    model.embeddings(ids)
    assert describe(fwd.encode_chunk(x, key)).kind == 0  # a lossless copy while evaluating
    model.embeddings.train()
    model.embeddings(ids)
    assert describe(fwd.encode_chunk(x, key)).kind == 1


@pytest.mark.parametrize("exact", ["true", "false"])
def test_evaluation_traffic_is_left_out_of_the_eb_metrics(exact: str, monkeypatch: pytest.MonkeyPatch):
    """Evaluation passes between two log lines add nothing to the next window's eb figures (exact evaluation
    or not), as the exchange's own byte counts leave them out."""
    import itertools
    import types

    import torch

    from recstack.compression.base import ChunkKey
    from recstack.compression.eb import codec as eb_codec
    from recstack.compression.runtime import CompressionRuntime
    from recstack.data.batch import SparseFeatures
    from recstack.embedding.fused import FusedEmbeddingBagCollection
    from recstack.embedding.sparse_optim import SparseOptimizerConfig

    # a clock that ticks once per reading: every encode and decode the codec counts takes exactly 1 s
    monkeypatch.setattr(eb_codec, "time", types.SimpleNamespace(perf_counter=itertools.count().__next__))
    cfg = load_config(None, ['dist.forward_codec="eb"', f"compression.eval_lossless={exact}"])
    runtime = CompressionRuntime(cfg.compression, cfg.dist.forward_codec, cfg.dist.backward_codec, cfg.train.batch_size,
                                 None)
    fwd, _ = runtime.codecs()
    model = torch.nn.Module()
    model.embeddings = FusedEmbeddingBagCollection([TableConfig("C1", 100, 8, (0,))], SparseOptimizerConfig())
    runtime.attach(model)
    ids = SparseFeatures.from_dense_ids(torch.randint(0, 100, (4, 1)))

    def step(rows: int) -> None:  # one forward: this rank's chunk out, rank 1's chunk in
        model.embeddings(ids)
        x = torch.randn(rows, 8)
        fwd.decode_chunk(fwd.encode_chunk(x, ChunkKey("fwd_a2a", 0, 1, 0)), (rows, 8), ChunkKey("fwd_a2a", 1, 0, 0))

    step(64)  # a training step before the evaluation: its figures stay in the window
    model.embeddings.eval()
    for _ in range(3):
        step(500)
    model.embeddings.train()
    step(64)
    m = runtime.metrics(2)  # per step: one chunk of 64 x 8 out, one in
    assert m["eb_fwd_chunks"] == 1 and m["eb_fwd_raw_bytes"] == 64 * 8 * 4 and m["eb_fwd_bytes"] < 64 * 8 * 4
    assert m["eb_fwd_encode_s"] == 1 and m["eb_fwd_decode_s"] == 1
    assert "eb_fwd_chunks" not in runtime.metrics(1)  # nothing held back for a later window
