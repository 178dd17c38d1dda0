"""Tests for the synthetic click-log generator (recstack.data.synth) and its samplers (recstack.data.synth.zipf)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.synth.click_model import ClickModel
from recstack.data.synth.generate import CRITEO_KAGGLE_TABLE_SIZES, SynthConfig, generate
from recstack.data.synth.zipf import IdPermutation, keyed, scalar_key, uniform, zipf_mass_below, zipf_ranks
from recstack.metrics import streaming_auc

SMALL_TABLES = (50, 3, 1000, 20_000, 7, 300)


def small_cfg(**kw) -> SynthConfig:
    base = dict(rows=4000, seed=3, table_sizes=SMALL_TABLES, num_dense=5, calibration_rows=4096)
    base.update(kw)
    return SynthConfig(**base)


def columns(path: Path) -> dict[str, np.ndarray]:
    ds = PreparedDataset(path)
    return {name: np.array(ds.column(name)) for name in ds.arrays}


def test_criteo_sizes_match_shared_json() -> None:
    src = Path("/work/shared/data/criteo_cardinalities.json")
    if not src.is_file():
        pytest.skip("shared cardinalities file not present")
    assert CRITEO_KAGGLE_TABLE_SIZES == tuple(json.loads(src.read_text())["criteo_kaggle"])


def test_default_config_caps_tables() -> None:
    cfg = SynthConfig(rows=1000)
    assert len(cfg.effective_table_sizes) == 26 and cfg.num_dense == 13
    assert max(cfg.effective_table_sizes) == cfg.max_table_size
    assert cfg.effective_table_sizes[0] == CRITEO_KAGGLE_TABLE_SIZES[0]  # small tables are untouched
    assert SynthConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"rows": 0}, "rows"),
        ({"target_ctr": 1.0}, "target_ctr"),
        ({"table_sizes": (5, 0)}, "table_sizes"),
        ({"num_verticals": 2, "vertical_ctr": (0.1,)}, "vertical_ctr"),
        ({"drift": -1.0}, "drift"),
        ({"vertical_table": 9}, "vertical_table"),
        ({"vertical_effect_share": 2.0}, "vertical_effect_share"),
        ({"table_sizes": (2**31,), "max_table_size": None}, "table_sizes"),
    ],
)
def test_bad_config_names_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SynthConfig.{field}"):
        small_cfg(**kw)


def test_deterministic_and_independent_of_chunk_size(tmp_path: Path) -> None:
    cfg = small_cfg(num_verticals=2, drift=0.3)
    a = columns(generate(cfg, tmp_path / "a", chunk_rows=4000, progress=False))
    b = columns(generate(cfg, tmp_path / "b", chunk_rows=777, progress=False))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    assert PreparedDataset(tmp_path / "a").info == PreparedDataset(tmp_path / "b").info


def test_different_seeds_differ(tmp_path: Path) -> None:
    a = columns(generate(small_cfg(seed=1), tmp_path / "a", progress=False))
    b = columns(generate(small_cfg(seed=2), tmp_path / "b", progress=False))
    for name in ("sparse", "dense", "probability", "labels"):
        assert not np.array_equal(a[name], b[name]), name


def test_shapes_dtypes_and_ranges(tmp_path: Path) -> None:
    cfg = small_cfg(num_days=5)
    out = generate(cfg, tmp_path / "d", progress=False)
    ds = PreparedDataset(out)
    c = columns(out)
    n = cfg.rows
    assert ds.dense_features == [f"I{j + 1}" for j in range(5)]
    assert [s.name for s in ds.sparse_features] == [f"C{f + 1}" for f in range(len(SMALL_TABLES))]
    assert ds.table_sizes == list(SMALL_TABLES)
    expect = {
        "labels": ((n,), np.float32),
        "dense": ((n, 5), np.float32),
        "sparse": ((n, 6), np.int32),
        "probability": ((n,), np.float32),
        "vertical": ((n,), np.int16),
        "timestamp": ((n,), np.int64),
        "example_id": ((n,), np.int64),
    }
    for name, (shape, dtype) in expect.items():
        assert c[name].shape == shape and c[name].dtype == dtype, name
    assert ((c["sparse"] >= 0) & (c["sparse"] < np.array(SMALL_TABLES))).all()
    assert ((c["probability"] > 0) & (c["probability"] < 1)).all()
    assert set(np.unique(c["labels"])) == {0.0, 1.0}
    assert (c["vertical"] == 0).all()
    np.testing.assert_array_equal(c["example_id"], np.arange(n))
    ts = c["timestamp"]
    assert ts[0] == 0 and ts[-1] == 4 and (np.diff(ts) >= 0).all()
    assert np.bincount(ts).min() >= n // 5 - 1  # days are evenly filled
    # Dense values are log1p of non-negative integer counts, with zeros present as in Criteo.
    counts = np.expm1(c["dense"].astype(np.float64))
    assert (counts >= 0).all() and np.allclose(counts, np.round(counts), atol=1e-3 * (1 + counts))
    assert (c["dense"] == 0).mean() > 0.02 and c["dense"].max() > 3.0


def test_ctr_follows_target() -> None:
    for target in (0.25, 0.08):
        cfg = small_cfg(rows=40_000, target_ctr=target)
        model = ClickModel(cfg)
        p = 1.0 / (1.0 + np.exp(-model.logit_of_rows(model.sample(0, cfg.rows))))
        # Calibration on 4096 rows and the sampling error of 40k rows are each well under 0.005.
        assert abs(p.mean() - target) < 0.01, (target, p.mean())
        assert p.std() > 0.05  # the click model is not a constant


def test_labels_are_bernoulli_of_probability(tmp_path: Path) -> None:
    cfg = small_cfg(rows=30_000)
    c = columns(generate(cfg, tmp_path / "d", progress=False))
    p, y = c["probability"].astype(np.float64), c["labels"]
    edges = np.quantile(p, np.linspace(0, 1, 6))
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        m = (p >= lo) & (p <= hi)
        expected, var = p[m].mean(), (p[m] * (1 - p[m])).sum() / m.sum() ** 2
        assert abs(y[m].mean() - expected) < 4 * math.sqrt(var), (lo, hi)


def test_oracle_auc_matches_recomputation(tmp_path: Path) -> None:
    out = generate(small_cfg(rows=20_000), tmp_path / "d", progress=False)
    ds = PreparedDataset(out)
    c = columns(out)
    assert ds.info["oracle_auc"] == pytest.approx(roc_auc_score(c["labels"], c["probability"]), abs=1e-12)
    assert 0.6 < ds.info["oracle_auc"] < 0.95
    assert ds.info["base_rate"] == pytest.approx(c["labels"].mean(), abs=1e-12)
    assert SynthConfig.from_dict(ds.info["config"]) == small_cfg(rows=20_000)


def test_streaming_auc_exact_with_ties_and_many_groups() -> None:
    rng = np.random.default_rng(0)
    # Coarse values force ties; a wide range spreads them over many exponent bins and fine groups.
    n = 20_000
    scores = (np.round(rng.random(n) * 200) / 200 * np.exp(-rng.integers(0, 12, n))).astype(np.float32)
    labels = (rng.random(n) < 0.2 + 0.6 * scores).astype(np.float32)
    got = streaming_auc(scores, labels, block_rows=7919, group_bins=16)
    assert got == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert math.isnan(streaming_auc(scores, np.zeros_like(labels)))
    with pytest.raises(ValueError, match="finite"):
        streaming_auc(np.array([0.5, np.nan], dtype=np.float32), np.array([0, 1], dtype=np.float32))


def test_zipf_ranks_follow_their_cdf() -> None:
    u = uniform(keyed(scalar_key(7), np.arange(400_000)))
    for n, s in ((100_000, 1.1), (1000, 1.0), (50, 0.0)):
        r = zipf_ranks(u, n, s)
        assert r.min() >= 0 and r.max() < n
        for k in (1, 10, n // 3):
            assert abs((r < k).mean() - zipf_mass_below(np.array(k), n, s)) < 0.005, (n, s, k)


def test_permutation_is_a_bijection_with_inverse() -> None:
    for n in (1, 2, 17, 1000, 65_537):
        perm = IdPermutation(n, scalar_key(n))
        ranks = np.arange(n)
        ids = perm.forward(ranks)
        np.testing.assert_array_equal(np.sort(ids), ranks)
        np.testing.assert_array_equal(perm.inverse(ids), ranks)
    with pytest.raises(ValueError, match="must lie in"):
        IdPermutation(10, scalar_key(1)).forward(np.array([10]))


def test_ids_have_scattered_zipf_popularity(tmp_path: Path) -> None:
    cfg = small_cfg(rows=20_000)
    c = columns(generate(cfg, tmp_path / "d", progress=False))
    ids = c["sparse"][:, 3]  # the 20k-row table
    counts = np.bincount(ids, minlength=20_000)
    top = np.sort(counts)[::-1]
    # Zipf 1.1: the top 10 ids get ~30% of draws, far above the 0.05% uniform ids would.
    assert top[:10].sum() / cfg.rows > 0.25
    assert top[0] > 50 * np.median(counts[counts > 0])
    hot = np.argsort(counts)[::-1][:10]
    assert not set(hot.tolist()) <= set(range(100))  # popular ids are scattered, not 0, 1, 2, ...


def test_drift_changes_click_model_over_time(tmp_path: Path) -> None:
    for drift in (0.0, 0.5):
        cfg = small_cfg(rows=3000, num_days=7, drift=drift)
        model = ClickModel(cfg)
        rows = model.sample(0, 2000)
        day = [model.logit(rows.ids, rows.dense, rows.vertical, np.full(2000, t)) for t in (0.0, 0.25, 6.0)]
        if drift == 0:
            np.testing.assert_array_equal(day[0], day[2])
        else:
            near, far = np.corrcoef(day[0], day[1])[0, 1], np.corrcoef(day[0], day[2])[0, 1]
            assert near > 0.95 and far < 0.8 and np.abs(day[0] - day[2]).mean() > 0.2, (near, far)
        # The public logit of the stored rows reproduces what the generator wrote.
        out = generate(cfg, tmp_path / f"d{drift}", progress=False)
        c = columns(out)
        t = c["example_id"] * cfg.num_days / cfg.rows
        p = model.probability(c["sparse"], c["dense"], c["vertical"], t)
        np.testing.assert_allclose(p, c["probability"], rtol=1e-6, atol=1e-7)


def test_verticals_differ_in_base_rate_and_are_visible(tmp_path: Path) -> None:
    cfg = small_cfg(rows=30_000, num_verticals=3, vertical_ctr=(0.1, 0.25, 0.4), vertical_mix=(0.5, 0.3, 0.2))
    c = columns(generate(cfg, tmp_path / "d", progress=False))
    v = c["vertical"].astype(np.int64)
    share = np.bincount(v, minlength=3) / cfg.rows
    np.testing.assert_allclose(share, [0.5, 0.3, 0.2], atol=0.015)
    for k, ctr in enumerate((0.1, 0.25, 0.4)):
        assert abs(c["probability"][v == k].mean() - ctr) < 0.015, k
    assert (c["sparse"][:, 0] % 3 == v).all()  # the vertical table reveals the vertical
    # A share of the id effects is vertical-specific: the same ids score differently per vertical.
    model = ClickModel(cfg)
    rows = model.sample(0, 1000)
    logits = [model.logit(rows.ids, rows.dense, np.full(1000, k), rows.time) for k in range(3)]
    centred = [x - x.mean() for x in logits]
    assert np.corrcoef(centred[0], centred[1])[0, 1] < 0.95


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    cfg = small_cfg(rows=100)
    generate(cfg, tmp_path / "d", progress=False)
    with pytest.raises(FileExistsError):
        generate(cfg, tmp_path / "d", progress=False)
    generate(cfg, tmp_path / "d", progress=False, overwrite=True)


def test_huge_tables_need_no_memory(tmp_path: Path) -> None:
    cfg = small_cfg(rows=2000, table_sizes=(10_000_000, 2**31 - 1, 5), max_table_size=None)
    c = columns(generate(cfg, tmp_path / "d", progress=False))
    assert ((c["sparse"] >= 0) & (c["sparse"] < np.array(cfg.table_sizes))).all()
    assert c["sparse"][:, 1].max() > 2**30  # ids span the whole 31-bit range


def test_logit_rejects_bad_input() -> None:
    model = ClickModel(small_cfg(rows=100))
    rows = model.sample(0, 10)
    bad = rows.ids.copy()
    bad[3, 2] = 1000  # table C3 has 1000 rows
    with pytest.raises(ValueError, match="C3"):
        model.logit(bad, rows.dense, rows.vertical, rows.time)
    with pytest.raises(ValueError, match="dense"):
        model.logit(rows.ids, rows.dense[:, :2], rows.vertical, rows.time)
    with pytest.raises(ValueError, match="vertical"):
        model.logit(rows.ids, rows.dense, np.full(10, 1), rows.time)
