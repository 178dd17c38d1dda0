"""Row-wise quantization and the quantized pooled lookup: every width within its stated per-element bound,
pooling from quantized rows within the bag's summed bound, fp32 exactly as the training collection pools."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from recstack.data.batch import SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from recstack.serving.quantized import (
    LEVELS,
    QuantizedEmbeddingCollection,
    QuantizedRows,
    bytes_per_row,
    dequantize,
    open_group,
    quantize_rows,
    write_table,
)


def element_bound(x: np.ndarray, width: str, scale_bias: np.ndarray | None) -> np.ndarray:
    """The documented per-element error bound |x^ - x| of each element of rows x [n, D]."""
    if width == "fp32":
        return np.zeros_like(x)
    if width == "fp16":
        return np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    s = scale_bias[:, :1].astype(np.float64)  # type: ignore[index]
    return s / 2 + 2.0**-24 * (np.abs(x) + s)


def roundtrip(x: np.ndarray, width: str) -> tuple[np.ndarray, np.ndarray | None]:
    q, sb = quantize_rows(x, width)
    out = dequantize(torch.from_numpy(q), None if sb is None else torch.from_numpy(sb), width, x.shape[1])
    return out.numpy().astype(np.float64), sb


rows_strategy = st.integers(1, 6).flatmap(lambda n: st.integers(1, 9).flatmap(
    lambda d: arrays(np.float32, (n, d), elements=st.floats(-30, 30, width=32))))


@settings(max_examples=200, deadline=None)
@given(x=rows_strategy, width=st.sampled_from(["fp32", "fp16", "int8", "int4"]))
def test_every_width_is_within_its_per_element_bound(x: np.ndarray, width: str) -> None:
    out, sb = roundtrip(x, width)
    err = np.abs(out - x.astype(np.float64))
    assert (err <= element_bound(x.astype(np.float64), width, sb)).all()
    if width in LEVELS:  # the scale is the row's range over the levels, rounded up to float16 (not much more)
        lo, hi = x.min(1).astype(np.float64), x.max(1).astype(np.float64)
        s, b = sb[:, 0].astype(np.float64), sb[:, 1].astype(np.float64)
        assert (b <= lo).all() and (b >= lo - np.abs(lo) * 2.0**-10 - 2.0**-24).all()
        used = hi > b  # a constant row that float16 holds exactly keeps the placeholder scale 1
        assert (s[used] >= (hi - b)[used] / LEVELS[width]).all()
        assert (s[used] <= (hi - b)[used] / LEVELS[width] * (1 + 2.0**-10) + 2.0**-24).all()


def test_constant_rows_odd_dims_and_extreme_values() -> None:
    x = np.array([[0.5] * 5, [-3.0] * 5, [1e-6, -1e-6, 0, 2e-7, 0]], np.float32)
    for width in ("fp16", "int8", "int4"):
        out, sb = roundtrip(x, width)
        assert (np.abs(out - x) <= element_bound(x.astype(np.float64), width, sb)).all()
    q, _ = quantize_rows(x, "int4")
    assert q.shape == (3, 3)  # 5 codes -> 3 bytes
    with pytest.raises(ValueError, match="float16"):
        quantize_rows(np.array([[1e6, 0.0]], np.float32), "int8")
    with pytest.raises(ValueError, match="NaN"):
        quantize_rows(np.array([[np.nan, 0.0]], np.float32), "fp16")


def test_bytes_per_row_and_written_files(tmp_path) -> None:
    w = torch.randn(1000, 16) * 0.1
    for width, want in (("fp32", 64), ("fp16", 32), ("int8", 20), ("int4", 12)):
        assert bytes_per_row(width, 16) == want
        data, sb = open_group(width, 1300, 16, tmp_path / f"{width}.npy", tmp_path / f"{width}.sb.npy")
        write_table(w, width, data, sb, 0)
        write_table(w[:300], width, data, sb, 1000)  # a second table after the first
        on_disk = data.nbytes + (sb.nbytes if sb is not None else 0)
        assert on_disk == 1300 * want
        rows = QuantizedRows(width, 16, np.load(tmp_path / f"{width}.npy", mmap_mode="r"),
                             np.load(tmp_path / f"{width}.sb.npy", mmap_mode="r") if sb is not None else None)
        q, qsb = quantize_rows(w[[5, 7]].numpy(), width)  # the padded, word-gathered layout decodes the same
        want = dequantize(torch.from_numpy(q), None if qsb is None else torch.from_numpy(qsb), width, 16)
        assert torch.equal(rows.lookup(torch.tensor([5, 1007])), want)


def _random_bags(rng: np.random.Generator, rows: list[int], b: int, weighted: bool) -> SparseFeatures:
    lengths = rng.integers(0, 5, size=len(rows) * b)
    ids = np.concatenate([rng.integers(0, rows[f], size=int(lengths[f * b : (f + 1) * b].sum()))
                          for f in range(len(rows))])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    w = torch.from_numpy(rng.uniform(-2, 2, len(ids)).astype(np.float32)) if weighted else None
    return SparseFeatures(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(offsets), len(rows), w)


@pytest.mark.parametrize("width", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("weighted, mixed", [(False, False), (True, False), (True, True)])
def test_pooled_lookup_matches_fp32_pooling_within_the_bag_bound(width: str, weighted: bool, mixed: bool) -> None:
    """Features 0 and 2 share table "a", "b" is stored after it in the same width group, or (mixed) in
    another width; pooled error of bag b <= sum over its ids of |w| * row bound."""
    rng = np.random.default_rng(0)
    tables = [TableConfig("a", 300, 6, (0, 2)), TableConfig("b", 40, 6, (1,))]
    ref = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig("sgd", 0.1), seed=3).eval()
    widths = [width, "fp32" if mixed else width]
    groups, bounds, index = [], [], {}
    for t, w in zip(tables, widths, strict=True):
        q, sb = quantize_rows(ref.table_weight(t.name).numpy(), w)
        bounds.append(element_bound(ref.table_weight(t.name).numpy().astype(np.float64), w, sb).max(axis=1))
        if w in index:  # one group per width: stack the rows
            g = groups[index[w]]
            q = np.concatenate([g.data.numpy(), q])
            sb = None if sb is None else np.concatenate([g.scale_bias.numpy(), sb])
            groups[index[w]] = QuantizedRows(w, 6, q, sb)
        else:
            index[w] = len(groups)
            groups.append(QuantizedRows(w, 6, q, sb))
    offset = [0, 300] if widths[0] == widths[1] else [0, 0]
    coll = QuantizedEmbeddingCollection(groups, [index[widths[t]] for t in ref.feature_table],
                                        [offset[t] for t in ref.feature_table])
    for _ in range(5):
        sp = _random_bags(rng, [300, 40, 300], 7, weighted)
        with torch.no_grad():
            want, got = ref(sp).double().numpy(), coll(sp).double().numpy()
        if width == "fp32":
            assert np.array_equal(want, got)
            continue
        ids, off = sp.ids.numpy(), sp.offsets.numpy()
        w = np.abs(sp.weights.numpy()) if sp.weights is not None else np.ones(len(ids))
        row_bound = np.concatenate([bounds[ref.feature_table[f]][ids[off[f * 7] : off[(f + 1) * 7]]]
                                    for f in range(3)])
        bag_bound = np.add.reduceat(np.concatenate([w * row_bound, [0.0]]), off[:-1]) * (np.diff(off) > 0)
        bag_bound = bag_bound.reshape(3, 7).T[:, :, None] * (1 + 1e-5) + 1e-6  # float32 sums of 4 terms
        assert (np.abs(got - want) <= bag_bound).all()


def test_memory_mapped_tables_are_shared_read_only(tmp_path) -> None:
    data, sb = open_group("int8", 50, 4, tmp_path / "t.npy", tmp_path / "t.sb.npy")
    write_table(torch.randn(50, 4), "int8", data, sb, 0)
    data.flush()
    sb.flush()
    mapped = np.load(tmp_path / "t.npy", mmap_mode="r", allow_pickle=False)
    t = QuantizedRows("int8", 4, mapped, np.load(tmp_path / "t.sb.npy", mmap_mode="r"))
    assert isinstance(mapped, np.memmap) and not mapped.flags.writeable
    got = t.lookup(torch.tensor([3, 3, 49]))
    assert got.shape == (3, 4) and torch.equal(got[0], got[1])
