"""Training-serving consistency: raw rows -> ``recstack data prepare`` -> ``recstack train`` -> ``recstack
predict`` on the prepared rows, against ``recstack export`` + ``ServingModel`` on the same RAW rows.

fp32 tables: the served probabilities equal predict's within 1e-6. Quantized tables: the served logit of every
row lies within a bound derived from the tables' per-element quantization bound (``recstack.serving.quantized``):
the pooled error of a bag is at most sum |w| * (row bound) over its ids, and interval arithmetic carries that
radius through the QR combine, the interaction and the MLPs (``logit_bound``), so the bound is rigorous, not a
tolerance fitted to pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from test_export import RATINGS_SCHEMA
from torch import nn

from recstack.cli.main import main
from recstack.data.examples import ratings_table, write_ratings
from recstack.data.prepare.schema import schema_from_dict, schema_to_toml
from recstack.data.prepared_dataset import PreparedDataset
from recstack.models.dlrm import DLRM
from recstack.models.interaction import CatInteraction, DotInteraction
from recstack.serving.artifact import list_versions
from recstack.serving.model import ServingModel
from recstack.serving.quantized import LEVELS
from recstack.training.inference import load_model, predict_logits

CONFIG = """
[data]
train = "{data}"
eval_fraction = 0.2
[model]
embedding_dim = 8
bottom_mlp = [16, 8]
top_mlp = [16, 1]
{model}
[optim]
dense = "adam"
dense_lr = 0.01
sparse = "rowwise_adagrad"
sparse_lr = 0.05
[train]
batch_size = 64
max_steps = 40
threads = 1
progress = false
"""
WIDTHS = ("fp32", "fp16", "int8", "int4")

Interval = tuple[torch.Tensor, torch.Tensor]  # (center, radius >= 0), float64


def _linear(layer: nn.Linear, x: Interval) -> Interval:
    w = layer.weight.double()
    c = x[0] @ w.T + (layer.bias.double() if layer.bias is not None else 0)
    return c, x[1] @ w.abs().T


def _mul(a: Interval, b: Interval) -> Interval:
    return a[0] * b[0], a[0].abs() * b[1] + a[1] * b[0].abs() + a[1] * b[1]


def _mlp(seq: nn.Module, x: Interval) -> Interval:
    for layer in seq:
        if isinstance(layer, nn.Linear):
            x = _linear(layer, x)
        else:  # ReLU: monotone, so the interval's ends map to the ends
            lo, hi = torch.relu(x[0] - x[1]), torch.relu(x[0] + x[1])
            x = ((lo + hi) / 2, (hi - lo) / 2)
    return x


def logit_bound(model: DLRM, dense: torch.Tensor, pooled: Interval) -> torch.Tensor:
    """|served logit - trained logit| per row [B], when the served pooled embeddings [B, F', D] (the
    collection's, before the QR combine) lie within ``pooled`` (center: the trained model's, radius: the
    quantization bound). Both logits lie in the propagated interval, so they differ by at most its width."""
    c, r = pooled
    if model.qr is not None:
        f = model.qr.num_features
        b, _, d = c.shape
        one = torch.ones if model.qr.operation == "mult" else torch.zeros
        pc = torch.cat([c[:, f:], one(b, 1, d, dtype=c.dtype)], 1)[:, model.qr.partner]
        pr = torch.cat([r[:, f:], torch.zeros(b, 1, d, dtype=c.dtype)], 1)[:, model.qr.partner]
        q = (c[:, :f], r[:, :f])
        c, r = _mul(q, (pc, pr)) if model.qr.operation == "mult" else (q[0] + pc, q[1] + pr)
    x = None
    if model.bottom is not None:  # dense features are exact: radius 0
        x = _mlp(model.bottom, (dense.double(), torch.zeros_like(dense, dtype=torch.float64)))[0]
    inter = model.interaction
    if isinstance(inter, DotInteraction):
        tc = torch.cat([x.unsqueeze(1), c], 1) if x is not None else c
        tr = torch.cat([torch.zeros_like(x).unsqueeze(1), r], 1) if x is not None else r
        zc = torch.bmm(tc, tc.transpose(1, 2))
        ta, trt = tc.abs(), tr.transpose(1, 2)
        zr = torch.bmm(ta, trt) + torch.bmm(tr, ta.transpose(1, 2)) + torch.bmm(tr, trt)
        zc, zr = zc[:, inter.li, inter.lj], zr[:, inter.li, inter.lj]
        h = (torch.cat([x, zc], 1), torch.cat([torch.zeros_like(x), zr], 1)) if x is not None else (zc, zr)
    else:
        flat = (c.flatten(1), r.flatten(1))
        h = (torch.cat([x, flat[0]], 1), torch.cat([torch.zeros_like(x), flat[1]], 1)) if x is not None else flat
        if not isinstance(inter, CatInteraction):  # DCNv2: x_{l+1} = x0 * (U V x_l + b) + x_l
            x0 = h
            for v, u in zip(inter.v, inter.u, strict=True):
                y = _mul(x0, _linear(u, _linear(v, h)))
                h = (y[0] + h[0], y[1] + h[1])
    out = _mlp(model.top, h)
    return 2 * out[1].squeeze(1)


def row_bounds(weight: np.ndarray, art: Path, manifest: dict, entry: dict) -> np.ndarray:
    """Per row of one table, the largest per-element bound of its width (float64 [rows])."""
    x = np.abs(weight.astype(np.float64)).max(axis=1)
    if entry["width"] == "fp32":
        return np.zeros(len(x))
    if entry["width"] == "fp16":
        return np.maximum(x * 2.0**-11, 2.0**-25)
    assert entry["width"] in LEVELS
    sb = np.load(art / manifest["table_files"][entry["width"]]["scale_bias"], mmap_mode="r")
    s = sb[entry["offset"] : entry["offset"] + entry["rows"], 0].astype(np.float64)
    return s / 2 + 2.0**-24 * (x + s)


@torch.no_grad()
def quantized_bounds(run: Path, art: Path, data: PreparedDataset) -> tuple[np.ndarray, np.ndarray]:
    """-> (trained logits [N], bound [N]) for the artifact ``art`` of ``run`` over all rows of ``data``."""
    cfg, model = load_model(run)
    manifest = json.loads((art / "manifest.json").read_text())
    emb = model.embeddings
    eps = torch.from_numpy(np.concatenate([row_bounds(emb.table_weight(t["name"]).numpy(), art, manifest, t)
                                           for t in manifest["tables"]]))
    batch = data.batch(0, len(data))
    caps = torch.tensor(model.feature_rows())
    batch.sparse.ids = torch.remainder(batch.sparse.ids, caps.repeat_interleave(batch.sparse.ids_per_feature))
    sp = model.split_batch(batch).sparse
    b, f = sp.batch_size, sp.num_features
    center = emb(sp).double()
    w = sp.weights.abs().double() if sp.weights is not None else None
    radius = F.embedding_bag(emb.global_rows(sp), eps.unsqueeze(1), sp.offsets, mode="sum", per_sample_weights=w,
                             include_last_offset=True).view(f, b, 1).transpose(0, 1).expand_as(center)
    want = model(batch).double()
    bound = logit_bound(model, batch.dense, (center, radius.contiguous()))
    # float32 evaluation of the same program (both sides): a few ulps of the logit and of the MLP sums
    return want.numpy(), (bound + 1e-5 + 1e-5 * want.abs()).numpy()


def criteo_rows(path: Path, n: int) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines()[:n]:
        f = line.split("\t") + [""] * 40
        r = {f"I{i}": int(f[i]) if f[i] else None for i in range(1, 14)}
        r.update({f"C{i}": f[13 + i] or None for i in range(1, 27)})
        rows.append(r)
    return rows


def _pipeline(tmp: Path, prepare: list[str], model_toml: str, data: Path) -> tuple[Path, np.ndarray, Path]:
    """prepare -> train -> predict -> export every width into a versions directory."""
    assert main(["data", "prepare", *prepare, "--out", str(data)]) == 0
    (tmp / "c.toml").write_text(CONFIG.format(data=data, model=model_toml))
    assert main(["train", "--config", str(tmp / "c.toml"), "--output-dir", str(tmp / "run")]) == 0
    assert main(["predict", "--checkpoint", str(tmp / "run"), "--data", str(data), "--out", str(tmp / "p.npy")]) == 0
    root = tmp / "models"
    root.mkdir()
    for w in WIDTHS:
        assert main(["export", "--checkpoint", str(tmp / "run"), "--out", str(root), "--tables", w]) == 0
    assert list_versions(root) == [1, 2, 3, 4]
    return tmp / "run", np.load(tmp / "p.npy"), root


def _check(run: Path, predicted: np.ndarray, root: Path, data: Path, rows: list[dict]) -> dict[str, float]:
    ds = PreparedDataset(data)
    cfg, model = load_model(run)
    trained, _ = predict_logits(cfg, model, ds, progress=False)
    worst = {}
    for version, width in enumerate(WIDTHS, 1):
        m = ServingModel.load(root / str(version))
        logits = m.score(m.encode(rows)).double().numpy()
        prob = 1 / (1 + np.exp(-logits))
        if width == "fp32":
            assert np.abs(prob - predicted).max() <= 1e-6
            assert np.abs(logits - trained).max() <= 1e-6
            continue
        want, bound = quantized_bounds(run, root / str(version), ds)
        err = np.abs(logits - want)
        assert (err <= bound).all(), (width, float((err - bound).max()))
        assert (np.abs(prob - predicted) <= bound / 4 + 1e-6).all()  # sigmoid is 1/4-Lipschitz
        worst[width] = float((err / bound).max())
    return worst


@pytest.mark.parametrize("prepare, model_toml", [
    (["--vocab-min-freq", "2"], 'interaction = "dot"'),
    (["--max-ind-range", "5000"], 'interaction = "dot"\nmax_table_size = 700\nqr_collisions = 8\nqr_threshold = 300'),
])
def test_criteo_raw_rows_score_as_predict(shared_data: Path, tmp_path: Path, prepare: list[str],
                                          model_toml: str) -> None:
    raw = shared_data / "criteo_kaggle_sample.tsv"
    run, predicted, root = _pipeline(tmp_path, [str(raw), *prepare], model_toml, tmp_path / "data")
    rows = criteo_rows(raw, len(predicted))
    assert len(rows) == len(predicted)
    worst = _check(run, predicted, root, tmp_path / "data", rows)
    print(f"largest |served - trained logit| / bound per width: {worst}")
    if "--vocab-min-freq" in prepare:  # values seen once share row 0 with missing ones: counted as OOV
        m = ServingModel.load(root / "1")
        assert sum(m.encode(rows[:200]).oov_counts.values()) > 0


def test_schema_raw_rows_score_as_predict(tmp_path: Path) -> None:
    table, _ = ratings_table(2500, seed=5)
    raw = write_ratings(tmp_path / "ratings.parquet", table)
    (tmp_path / "schema.toml").write_text(schema_to_toml(schema_from_dict(RATINGS_SCHEMA)))
    run, predicted, root = _pipeline(tmp_path, [str(raw), "--schema", str(tmp_path / "schema.toml")],
                                     'interaction = "cat"', tmp_path / "data")
    fields = ServingModel.load(root / "1").raw_fields
    worst = _check(run, predicted, root, tmp_path / "data", pq.read_table(raw).select(fields).to_pylist())
    print(f"largest |served - trained logit| / bound per width: {worst}")
