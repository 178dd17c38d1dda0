"""``recstack export`` and ``ServingModel``: every model variant scores as the trained model does (fp32
tables), from encoded ids and from raw schema rows; artifacts are versioned, atomic, checksummed, refused when
damaged, and hold nothing pickled; bad requests raise RequestError naming the field."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import torchrun

from recstack.cli.main import main
from recstack.config import load_config
from recstack.data.examples import ratings_table, write_ratings
from recstack.data.prepare.schema import schema_from_dict
from recstack.data.prepare.schema_prepare import prepare_dataset
from recstack.data.prepared_dataset import PreparedDataset
from recstack.serving.artifact import ArtifactError, RequestError, list_versions
from recstack.serving.export import export_checkpoint
from recstack.serving.model import EncodedBatch, ServingModel, check_program_pickle_free
from recstack.training.inference import load_model, predict_logits
from recstack.training.trainer import Trainer

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "train.batch_size=64",
         "train.threads=1", "train.progress=false", "train.max_steps=30", 'optim.sparse="rowwise_adagrad"']
# The ratings example without its time split: one prepared directory whose rows are the table's, in order.
RATINGS_SCHEMA = {
    "source": {"format": "parquet"},
    "label": {"column": "rating", "threshold": 4.0, "min": 1.0, "max": 5.0},
    "dense": [{"name": "age", "transform": "standardize"}, {"name": "num_ratings", "transform": "log1p"}],
    "sparse": [
        {"name": "user", "column": "user_id", "min_freq": 2},
        {"name": "movie", "column": "movie_id", "table": "movie"},
        {"name": "history", "multi_hot": True, "table": "movie", "pooling": "mean", "max_length": 3},
        {"name": "genres", "multi_hot": True, "separator": "|", "encoding": "hash", "hash_size": 64},
        {"name": "device"},
    ],
}


def train_run(data: Path, out: Path, extra: list[str] = ()) -> Path:  # type: ignore[assignment]
    cfg = load_config(None, [f'data.train="{data}"', *SMALL, *extra])
    trainer = Trainer(cfg, out)
    try:
        trainer.train()
    finally:
        trainer.close()
    return out


def encoded_rows(ds: PreparedDataset, lo: int, hi: int) -> list[dict[str, Any]]:
    """Rows [lo, hi) of a prepared set as ``encode(..., ids=True)`` takes them."""
    dense, single = np.asarray(ds.column("dense")[lo:hi]), np.asarray(ds.column("sparse")[lo:hi])
    rows = []
    for r in range(hi - lo):
        row: dict[str, Any] = {n: float(dense[r, j]) for j, n in enumerate(ds.dense_features)}
        for s, col in zip(ds.sparse_features, ds.sparse_column, strict=True):
            if col is not None:
                row[s.name] = int(single[r, col])
                continue
            off = ds.column(f"{s.name}.offsets")
            a, b = int(off[lo + r]), int(off[lo + r + 1])
            ids = [int(v) for v in ds.column(f"{s.name}.values")[a:b]]
            row[s.name] = ({"ids": ids, "weights": [float(w) for w in ds.column(f"{s.name}.weights")[a:b]]}
                           if s.weighted else ids)
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def ratings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ratings")
    table, _ = ratings_table(3000, seed=3)
    raw = write_ratings(d / "ratings.parquet", table)
    prepare_dataset(schema_from_dict(RATINGS_SCHEMA), [raw], d / "data", progress=False)
    return {"raw": raw, "data": d / "data", "dir": d}


def _check_fp32(run: Path, data: Path, out: Path, rows: int = 300) -> ServingModel:
    """Export fp32 and compare ServingModel on encoded rows with predict_logits on the prepared rows."""
    path, version = export_checkpoint(run, out)
    m = ServingModel.load(path)
    cfg, model = load_model(run)
    ds = PreparedDataset(data)
    want, _ = predict_logits(cfg, model, ds, progress=False, rows=(0, rows))
    enc = encoded_rows(ds, 0, rows)
    got = m.score(m.encode(enc, ids=True)).numpy()
    assert got.shape == (rows,) and np.abs(got - want).max() <= 1e-6
    # Requests batched together (dynamic batching) score as they do alone.
    joined = EncodedBatch.concat([m.encode(enc[:7], ids=True), m.encode(enc[7:8], ids=True),
                                  m.encode(enc[8:rows], ids=True)])
    assert joined.size == rows and np.array_equal(m.score(joined).numpy(), got)
    return m


@pytest.mark.parametrize("variant", [
    ["model.interaction=\"dot\""],
    ["model.interaction=\"cat\"", "model.max_table_size=50"],  # capped tables
    ["model.interaction=\"dcn\"", "model.dcn_low_rank=4", "model.dcn_layers=2"],
    ["model.qr_collisions=4", "model.qr_threshold=40"],  # movie (shared by two features) and user split
    ["model.qr_collisions=8", "model.qr_threshold=20", 'model.qr_operation="add"', "model.max_table_size=300"],
])
def test_every_variant_scores_as_the_trained_model(ratings: dict[str, Path], tmp_path: Path,
                                                   variant: list[str]) -> None:
    run = train_run(ratings["data"], tmp_path / "run", variant)
    m = _check_fp32(run, ratings["data"], tmp_path / "model")
    assert m.version == 1 and m.manifest["model"]["interaction"] in ("dot", "cat", "dcn")
    if "qr" in variant[0]:
        assert m.qr is not None and any(t["name"].endswith("_rem") for t in m.manifest["tables"])


def test_raw_schema_rows_score_as_their_prepared_rows(ratings: dict[str, Path], tmp_path: Path) -> None:
    run = train_run(ratings["data"], tmp_path / "run")
    path, _ = export_checkpoint(run, tmp_path / "model")
    m = ServingModel.load(path)
    cfg, model = load_model(run)
    ds = PreparedDataset(ratings["data"])
    want, _ = predict_logits(cfg, model, ds, progress=False)
    table = pq.read_table(ratings["raw"]).select(m.raw_fields)
    rows = table.to_pylist()
    batch = m.encode(rows)
    assert np.abs(m.score(batch).numpy() - want).max() <= 1e-6
    # Users seen once in training share the out-of-vocabulary row, and are counted.
    assert batch.oov_counts["user"] == int((np.asarray(ds.column("sparse"))[:, 0] == 1).sum()) > 0
    # One user, many candidates: the shared fields once.
    shared = {k: rows[0][k] for k in ("user_id", "age", "num_ratings", "device", "history")}
    cands = [{k: r[k] for k in ("movie_id", "genres")} for r in rows[:5]]
    got = m.score(m.encode_candidates(shared, cands)).numpy()
    assert np.allclose(got, m.score(m.encode([{**shared, **c} for c in cands])).numpy(), atol=0)
    # Several requests batched together score as each alone.
    parts = [m.encode(rows[:3]), m.encode(rows[3:4]), m.encode(rows[4:9])]
    joined = EncodedBatch.concat(parts)
    assert joined.size == 9 and np.array_equal(m.score(joined).numpy(), m.score(m.encode(rows[:9])).numpy())


def test_bad_requests_name_the_field(ratings: dict[str, Path], tmp_path: Path) -> None:
    run = train_run(ratings["data"], tmp_path / "run")
    m = ServingModel.load(export_checkpoint(run, tmp_path / "model")[0])
    good = pq.read_table(ratings["raw"]).select(m.raw_fields).slice(0, 2).to_pylist()
    cases = [
        ({k: v for k, v in good[0].items() if k != "age"}, "age", "missing"),
        ({**good[0], "colour": "red"}, "colour", "unknown field"),
        ({**good[0], "age": "old"}, "age", "expected a number"),
        ({**good[0], "age": float("nan")}, "age", "NaN"),
        ({**good[0], "num_ratings": float("inf")}, "num_ratings", "NaN or Inf"),
        ({**good[0], "movie_id": [1, 2]}, "movie_id", "several values"),
        ({**good[0], "history": {"a": 1}}, "history", "cannot hold"),
        ({**good[0], "movie_id": 2**70}, "movie_id", "cannot hold"),  # past Arrow's int64
        ({**good[0], "history": [1, 2**64]}, "history", "cannot hold"),
        ({**good[0], "age": 1e300}, "age", "outside float32's range"),  # finite in JSON, not in float32
    ]
    for row, field, why in cases:
        with pytest.raises(RequestError, match=why) as e:
            m.encode([row])
        assert e.value.field == field, (field, e.value)
    with pytest.raises(RequestError, match="cannot mix list and non-list") as e:  # one row's type against another's
        m.encode([good[1], {**good[0], "movie_id": [1, 2]}])
    assert e.value.field == "movie_id"
    with pytest.raises(RequestError, match="row 1: field 'age': missing"):
        m.encode([good[1], {k: v for k, v in good[0].items() if k != "age"}])
    with pytest.raises(RequestError, match="both in shared"):
        m.encode_candidates({"age": 3.0}, [{"age": 4.0}])
    ids = encoded_rows(PreparedDataset(ratings["data"]), 0, 1)[0]
    with pytest.raises(RequestError, match="outside the table") as e:
        m.encode([{**ids, "device": 10**6}], ids=True)
    assert e.value.field == "device"
    with pytest.raises(RequestError, match="outside float32's range") as e:
        m.encode([{**ids, "age": -1e300}], ids=True)
    assert e.value.field == "age"


def test_tiered_checkpoint_exports(tiny_dataset: Path, tmp_path: Path) -> None:
    """Cached tiers (a ckpt_<step>/ directory with table files) read through load_model; synthetic data has
    no raw form, so the artifact takes encoded ids only."""
    run = train_run(tiny_dataset, tmp_path / "run", ['memory.device="4392"', 'memory.host="10800"',
                                                     f'memory.ssd_dir="{tmp_path / "ssd"}"'])
    assert any(p.is_dir() for p in (run / "checkpoints").iterdir())
    m = _check_fp32(run, tiny_dataset, tmp_path / "model")
    with pytest.raises(RequestError, match="no raw form"):
        m.encode([{}])


@pytest.fixture(scope="module")
def tiny_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_run(tiny_dataset, tmp_path_factory.mktemp("tiny_run") / "run")


def test_versions_directory_cli_and_atomic_writes(tiny_run: Path, tmp_path: Path, capsys) -> None:
    root = tmp_path / "models"
    root.mkdir()
    for want in (1, 2):
        assert main(["export", "--checkpoint", str(tiny_run), "--out", str(root), "--tables", "int8",
                     "--table", "C2=int4"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["version"] == want and out["widths"] == ["int4", "int8"]
    assert list_versions(root) == [1, 2] and sorted(p.name for p in root.iterdir()) == ["1", "2"]  # no tmp left
    m = ServingModel.load(root / "2")
    assert m.version == 2 and {t["name"]: t["width"] for t in m.manifest["tables"]}["C2"] == "int4"
    assert main(["export", "--checkpoint", str(tiny_run), "--out", str(root / "2")]) == 2  # never replaced
    assert main(["export", "--checkpoint", str(tiny_run), "--out", str(tmp_path / "x"), "--table", "nope=int8"]) == 2
    assert "no table 'nope'" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_damaged_artifacts_are_refused_naming_the_file(tiny_run: Path, tmp_path: Path) -> None:
    path, _ = export_checkpoint(tiny_run, tmp_path / "m", "int8")
    ServingModel.load(path)
    manifest = json.loads((path / "manifest.json").read_text())
    table = path / manifest["table_files"]["int8"]["data"]
    blob = table.read_bytes()
    table.write_bytes(blob[:-7])
    with pytest.raises(ArtifactError, match=f"{table.name}: .* bytes, the manifest says"):
        ServingModel.load(path)
    table.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(ArtifactError, match=f"{table.name}: checksum mismatch"):
        ServingModel.load(path)
    table.write_bytes(blob)
    (path / "tables" / "extra.npy").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="extra.npy: not listed"):
        ServingModel.load(path)
    (path / "tables" / "extra.npy").unlink()
    doc = json.loads((path / "manifest.json").read_text())
    doc["files"]["../outside.npy"] = doc["files"].pop("tables/int8.npy")
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="outside the artifact"):
        ServingModel.load(path)
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "dense.pt2").unlink()
    with pytest.raises(ArtifactError, match="dense.pt2: missing"):
        ServingModel.load(path)
    with pytest.raises(ArtifactError, match="no manifest.json"):
        ServingModel.load(tmp_path)


def test_the_program_archive_holds_nothing_pickled(tiny_run: Path, tmp_path: Path) -> None:
    path, _ = export_checkpoint(tiny_run, tmp_path / "m")
    with zipfile.ZipFile(path / "dense.pt2") as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
    assert [s for n, s in sizes.items() if "sample_inputs" in n] == [0]
    check_program_pickle_free(path / "dense.pt2")
    # torch.export.save of a program with its sample inputs pickles them: refused before torch.export.load.
    ep = torch.export.export(torch.nn.Linear(2, 1), (torch.randn(3, 2),))
    torch.export.save(ep, tmp_path / "pickled.pt2")
    with pytest.raises(ArtifactError, match="pickled sample inputs"):
        check_program_pickle_free(tmp_path / "pickled.pt2")


def test_an_exfm_vertical_models_serving_path_exports(tiny_run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    """A VM with training-only heads (distillation head, student adapter): its serving path is exported."""
    from recstack.exfm.config import DistillConfig
    from recstack.exfm.vm import VerticalModel
    from recstack.serving.export import export_model

    cfg, body = load_model(tiny_run)
    vm = VerticalModel(body, "aux_sa", DistillConfig()).eval()
    ds = PreparedDataset(tiny_dataset)
    path, _ = export_model(cfg, vm.serving_model(), ds, tmp_path / "vm")
    m = ServingModel.load(path)
    with torch.no_grad():
        want = vm(ds.batch(0, 100)).numpy()
    got = m.score(m.encode(encoded_rows(ds, 0, 100), ids=True)).numpy()
    assert np.abs(got - want).max() <= 1e-6


@pytest.mark.slow
def test_sharded_torchrun_checkpoint_exports(tiny_dataset: Path, tmp_path: Path) -> None:
    """A torchrun run's step_<step>/ checkpoint (tables in DCP shards): load_model puts them together."""
    args = [*torchrun(2), "train", "--output-dir", str(tmp_path / "run"), "--set", f'data.train="{tiny_dataset}"']
    for o in [*SMALL, "train.max_steps=20", "train.batch_size=32"]:
        args += ["--set", o]
    res = subprocess.run(args, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert any(p.name.startswith("step_") for p in (tmp_path / "run" / "checkpoints").iterdir())
    _check_fp32(tmp_path / "run", tiny_dataset, tmp_path / "model")
