"""Request values read a column at a time (``recstack.serving.columns``) against Python's own parse of each
value, and one user's fields read once (``ServingModel.encode_candidates``) against the same rows sent whole:
the same arrays, the same OOV counts, the same errors naming the same field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from server_helpers import raw_criteo_rows, request_rows, shared_artifacts  # noqa: F401 (a fixture)

from recstack.data.prepare.criteo import DENSE_NAMES, SPARSE_NAMES, transform_dense
from recstack.serving.artifact import RequestError
from recstack.serving.columns import criteo_columns, hex_values
from recstack.serving.export import DenseProgram
from recstack.serving.model import EncodedBatch, ServingModel
from recstack.training.inference import load_model

ROWS = request_rows(raw_criteo_rows(150, seed=7))


def python_hex(texts: list) -> np.ndarray:
    """Each value by Python's int(): the reference."""
    return np.array([0 if v is None or v == "" else int(v, 16) for v in texts], np.int64)


@pytest.mark.parametrize("n", [1, 26, 127, 128, 1300])  # both sides of the threshold for Python's int()
def test_hex_values_equal_pythons_int(n: int) -> None:
    rng = np.random.default_rng(n)
    texts: list = []
    for _ in range(n):
        k = int(rng.integers(0, 10))
        digits = "".join(rng.choice(list("0123456789abcdefABCDEF"), int(rng.integers(1, 9))))
        texts.append(None if k == 0 else "" if k == 1 else "ffffffff" if k == 2 else "0" if k == 3 else digits)
    got = hex_values(texts)
    assert got is not None and got.dtype == np.int64
    np.testing.assert_array_equal(got, python_hex(texts))


@pytest.mark.parametrize("n", [3, 300])
@pytest.mark.parametrize("bad", ["123456789", "g", "12,3", "é1", "1\x00", "\x00", " 1", "1\n", "0x1", 5, 1.0, True,
                                 ["1"]])
def test_hex_values_refuse_anything_else(n: int, bad: object) -> None:
    for at in (0, n // 2, n - 1):
        texts: list = ["1f"] * n
        texts[at] = bad
        assert hex_values(texts) is None, (at, bad)


def test_criteo_columns_equal_the_reference_transform() -> None:
    dense, cats = criteo_columns(ROWS, DENSE_NAMES, SPARSE_NAMES) or (None, None)
    assert dense is not None and cats is not None
    raw = np.array([[0 if r[k] is None else r[k] for k in DENSE_NAMES] for r in ROWS], np.int64)
    raw[0, 0], raw[1, 1] = -5, 10**17 + 3  # a negative count; an integer float64 rounds
    rows = [dict(r) for r in ROWS]
    rows[0]["I1"], rows[1]["I2"] = -5, 10**17 + 3
    dense, _ = criteo_columns(rows, DENSE_NAMES, SPARSE_NAMES) or (None, None)
    assert dense is not None
    np.testing.assert_array_equal(dense, transform_dense(raw))
    np.testing.assert_array_equal(cats, python_hex([r[k] for r in ROWS for k in SPARSE_NAMES]).reshape(len(ROWS), 26))
    for bad in (10**18, -(10**18), 10**400, 1.0, True, "3"):
        assert criteo_columns([ROWS[0], {**ROWS[1], "I5": bad}], DENSE_NAMES, SPARSE_NAMES) is None, bad


def same_batch(a: EncodedBatch, b: EncodedBatch) -> None:
    """The same rows; ``a``'s dense features may be one user's, shared by its rows."""
    assert b.dense_row is None and torch.equal(a.dense[a.dense_rows()], b.dense)
    assert torch.equal(a.sparse.ids, b.sparse.ids) and torch.equal(a.sparse.offsets, b.sparse.offsets)
    assert a.oov_counts == b.oov_counts and a.one_id_per_bag == b.one_id_per_bag


def encoded(model: ServingModel, rows: list[dict]) -> list[dict]:
    b = model.encode(rows)
    ids = b.sparse.ids.view(len(model.feature_names), len(rows))
    return [{**{n: float(b.dense[i, j]) for j, n in enumerate(model.manifest["model"]["dense_features"])},
             **{n: int(ids[f, i]) for f, n in enumerate(model.feature_names)}} for i in range(len(rows))]


@pytest.mark.parametrize("ids", [False, True])
def test_shared_fields_read_once_give_the_rows_batch(shared_artifacts, ids: bool) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    rows = encoded(model, ROWS) if ids else [dict(r) for r in ROWS]
    if not ids:
        rows[0]["C3"] = "abcdef12"  # out of vocabulary in the shared part: counted once per candidate
    splits = [
        [*DENSE_NAMES, *SPARSE_NAMES[:13]],  # bench/serving_http.py's request: every dense feature shared
        ["I1", "I2", "C1", "C2", "C3"],  # dense features on both sides
        [],  # nothing shared
        [*DENSE_NAMES, *SPARSE_NAMES],  # everything shared
    ]
    for keys in splits:
        for n in (1, 2, 150):
            shared = {k: rows[0][k] for k in keys}
            cands = [{k: v for k, v in r.items() if k not in shared} for r in rows[:n]]
            batch = model.encode_candidates(shared, cands, ids=ids)
            same_batch(batch, model.encode([{**shared, **c} for c in cands], ids=ids))
            assert batch.size == n and (len(batch.dense) == 1 or not set(DENSE_NAMES) <= shared.keys())
    if not ids:
        assert batch.oov_counts["C3"] == 150


@pytest.mark.parametrize("ids", [False, True])
def test_shared_fields_errors_name_the_field(shared_artifacts, ids: bool) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    rows = encoded(model, ROWS[:3]) if ids else [dict(r) for r in ROWS[:3]]
    user = {k: rows[0][k] for k in ("I1", "C1")}
    cands = [{k: v for k, v in r.items() if k not in user} for r in rows]
    bad_value = -1 if ids else "xyz"
    cases = [
        (user, [cands[0], {**cands[1], "C1": rows[1]["C1"]}], "C1", 1, "both in shared"),
        (user, [cands[0], {k: v for k, v in cands[1].items() if k != "C7"}], "C7", 1, "missing"),
        ({**user, "C2": bad_value}, [{k: v for k, v in c.items() if k != "C2"} for c in cands], "C2", 0, None),
        (user, [cands[0], cands[1], {**cands[2], "C9": bad_value}], "C9", 2, None),
        (user, [cands[0], {**cands[1], "colour": 1}], "colour", 1, "unknown field"),
    ]
    for shared, cs, field, row, why in cases:
        with pytest.raises(RequestError, match=why) as e:
            model.encode_candidates(shared, cs, ids=ids)
        assert (e.value.field, e.value.row) == (field, row), (field, e.value)


def test_one_users_dense_features_go_through_the_bottom_mlp_once(shared_artifacts) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    shared = {k: ROWS[0][k] for k in [*DENSE_NAMES, *SPARSE_NAMES[:13]]}
    cands = [{k: v for k, v in r.items() if k not in shared} for r in ROWS[:100]]
    batch = model.encode_candidates(shared, cands)
    assert model.takes_dense_row and batch.dense.shape == (1, 13) and batch.size == 100
    alone = model.score(batch)
    # the rows sent whole (as `recstack predict` takes them): the bottom MLP on 100 equal rows
    torch.testing.assert_close(alone, model.score(model.encode([{**shared, **c} for c in cands])), rtol=0, atol=1e-5)
    # batched with other requests (the batcher's concat): each as alone
    parts = [model.encode(ROWS[:3]), batch, model.encode(ROWS[5:6]), model.encode_candidates(shared, cands[:7])]
    joined = EncodedBatch.concat(parts)
    assert joined.size == 111 and joined.dense.shape == (6, 13)  # 3 + 1 + 1 + 1 dense rows
    torch.testing.assert_close(model.score(joined), torch.cat([model.score(p) for p in parts]), rtol=0, atol=1e-5)


def test_a_program_exported_before_dense_row_gets_each_rows_dense_features(shared_artifacts,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    src = shared_artifacts["models"] / "1"
    old = tmp_path / "old"
    shutil.copytree(src, old)
    _, dlrm = load_model(shared_artifacts["run"])
    prog = DenseProgram(dlrm).eval()
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():  # the dense program as exported before: (pooled [B, F, D], dense [B, n_dense])
        ep = torch.export.export(prog, (torch.randn(4, 26, dlrm.embeddings.embedding_dim), torch.randn(4, 13)),
                                 dynamic_shapes={"pooled": {0: batch}, "dense": {0: batch}})
    ep._example_inputs = None
    torch.export.save(ep, old / "dense.pt2")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["dense_program"]["inputs"] = ["pooled", "dense"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    before, now = ServingModel.load(old, verify=False), ServingModel.load(src)
    assert not before.takes_dense_row
    shared = {k: ROWS[0][k] for k in [*DENSE_NAMES, *SPARSE_NAMES[:13]]}
    batch_ = now.encode_candidates(shared, [{k: v for k, v in r.items() if k not in shared} for r in ROWS[:20]])
    assert batch_.dense.shape == (1, 13)
    torch.testing.assert_close(before.score(batch_), now.score(batch_), rtol=0, atol=1e-5)
