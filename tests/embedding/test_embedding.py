"""The fused collection against plain PyTorch: same lookups, same updates as autograd + an optimizer."""

from __future__ import annotations

import pytest
import torch

from recstack.data.batch import SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from recstack.embedding.collection import init_table


def _random_sparse(sizes: list[int], batch: int, max_len: int, gen: torch.Generator, weighted: bool):
    """Multi-hot feature-major ids with empty bags allowed."""
    lengths = torch.randint(0, max_len + 1, (len(sizes), batch), generator=gen)
    ids = torch.cat([torch.randint(0, n, (int(lengths[f].sum()),), generator=gen) for f, n in enumerate(sizes)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)])
    w = torch.rand(ids.numel(), generator=gen) if weighted else None
    return SparseFeatures(ids, offsets, len(sizes), w)


def _reference(sizes, dim, seed, sparse, grad_out, kind, lr, eps=1e-8):
    """Per-table nn.functional.embedding_bag with dense autograd gradients, updated by hand."""
    b = sparse.batch_size
    new_weights = []
    outs = []
    for f, n in enumerate(sizes):
        w = init_table(TableConfig(f"t{f}", n, dim, (f,)), seed, f).requires_grad_()
        sf = sparse.feature_slice(f, f + 1)
        out = torch.nn.functional.embedding_bag(
            sf.ids, w, sf.offsets, mode="sum", per_sample_weights=sf.weights, include_last_offset=True
        )
        (out * grad_out[:, f]).sum().backward()
        g = w.grad
        with torch.no_grad():
            if kind == "sgd":
                neww = w - lr * g
            else:
                acc = g.pow(2).mean(1)
                neww = w - lr * g / (acc.sqrt() + eps).unsqueeze(1)
        outs.append(out.detach())
        new_weights.append(neww)
        assert out.shape == (b, dim)
    return torch.stack(outs, 1), torch.cat(new_weights)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("multi_hot,weighted", [(False, False), (True, False), (True, True)])
def test_fused_matches_autograd(kind: str, multi_hot: bool, weighted: bool) -> None:
    sizes, dim, batch, seed = [7, 50, 3, 200], 8, 16, 3
    gen = torch.Generator().manual_seed(1)
    if multi_hot:
        sparse = _random_sparse(sizes, batch, 4, gen, weighted)
    else:
        ids = torch.stack([torch.randint(0, n, (batch,), generator=gen) for n in sizes], 1)
        sparse = SparseFeatures.from_dense_ids(ids)
    tables = [TableConfig(f"t{i}", n, dim, (i,)) for i, n in enumerate(sizes)]
    ec = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig(kind, lr=0.05), seed=seed)
    grad_out = torch.randn(batch, len(sizes), dim, generator=gen)
    out = ec(sparse)
    (out * grad_out).sum().backward()
    ref_out, ref_w = _reference(sizes, dim, seed, sparse, grad_out, kind, 0.05)
    torch.testing.assert_close(out.detach(), ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ec.weight, ref_w, rtol=1e-5, atol=1e-6)


def test_adagrad_accumulates_over_steps() -> None:
    tables = [TableConfig("t", 5, 4, (0,))]
    ec = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig("rowwise_adagrad", lr=0.1))
    sparse = SparseFeatures.from_dense_ids(torch.tensor([[1], [1], [3]]))
    w0 = ec.weight.clone()
    g = torch.ones(3, 1, 4)
    (ec(sparse) * g).sum().backward()
    # row 1 got two ids: summed grad 2 -> acc 4 -> step 0.1 * 2 / 2 = 0.1
    torch.testing.assert_close(ec.weight[1], w0[1] - 0.1)
    torch.testing.assert_close(ec.accumulator, torch.tensor([0.0, 4.0, 0.0, 1.0, 0.0]))
    (ec(sparse) * g).sum().backward()
    torch.testing.assert_close(ec.accumulator[1], torch.tensor(8.0))
    torch.testing.assert_close(ec.weight[1], w0[1] - 0.1 - 0.2 / (8.0**0.5 + 1e-8), rtol=1e-6, atol=1e-7)


def test_eval_mode_does_not_update() -> None:
    ec = FusedEmbeddingBagCollection([TableConfig("t", 5, 4, (0,))], SparseOptimizerConfig("sgd", lr=1.0))
    w0 = ec.weight.clone()
    ec.eval()
    ec(SparseFeatures.from_dense_ids(torch.tensor([[1], [2]]))).sum()
    assert torch.equal(ec.weight, w0)


def test_init_is_per_table_and_seeded() -> None:
    t = TableConfig("t", 100, 4, (0,))
    assert torch.equal(init_table(t, 0, 2), init_table(t, 0, 2))
    assert not torch.equal(init_table(t, 0, 2), init_table(t, 1, 2))
    assert init_table(t, 0, 2).abs().max() <= 0.1


def test_init_bound_scales_every_placement_alike() -> None:
    """model.embedding_init_bound: rows drawn from +-bound (the same draws as the reference init, scaled), reserved
    rows still zero, and the chunked draw (tiered files) and a shard's block (sharded tables) the same rows."""
    from recstack.embedding.collection import init_block, init_row_chunks

    ref, small = TableConfig("t", 3, 64, (0,), zero_rows=1), TableConfig("t", 3, 64, (0,), zero_rows=1,
                                                                         init_bound=1e-3)
    want, got = init_table(ref, 4, 2), init_table(small, 4, 2)
    assert want.abs().max() > 0.5  # the reference's 1/sqrt(3) for a 3-row table
    assert got.abs().max() <= 1e-3 and torch.count_nonzero(got[:1]) == 0
    torch.testing.assert_close(got, want * (1e-3 * 3**0.5), rtol=1e-5, atol=0)
    assert torch.equal(torch.cat(list(init_row_chunks(small, 4, 2, chunk_rows=2))), got)
    assert torch.equal(init_block(small, 4, 2, (1, 3), (8, 40)), got[1:3, 8:40])


@pytest.mark.parametrize("sharding,k", [("table_wise", 1), ("row_wise", 3), ("row_wise", 4), ("column_wise", 2),
                                        ("column_wise", 4), ("table_row_wise", 2)])
@pytest.mark.parametrize("chunk_bytes", [4 * 6 * 7, 4 * 6 * 1000, 1 << 20])  # 7 rows, 1000 rows, the whole table
def test_shard_blocks_are_the_rows_of_the_whole_table(monkeypatch: pytest.MonkeyPatch, sharding: str, k: int,
                                                      chunk_bytes: int) -> None:
    """A shard's initial rows, drawn in row chunks keeping only its rectangle, are bit-identical to the same
    rectangle of init_table (that is what lets a sharded model build on "meta" and draw only its own shards)."""
    from recstack.distributed.sharding import shard_blocks
    from recstack.embedding import collection

    monkeypatch.setattr(collection, "INIT_CHUNK_BYTES", chunk_bytes)
    t = TableConfig("t", 1001, 8, (0,))  # 1001 rows: row blocks of 251 / 334 / 501, the last one short
    whole = init_table(t, 5, 3)
    for r0, r1, c0, c1 in shard_blocks(sharding, t.num_embeddings, t.embedding_dim, k):
        assert torch.equal(collection.init_block(t, 5, 3, (r0, r1), (c0, c1)), whole[r0:r1, c0:c1])
        out = torch.full((r1 - r0, c1 - c0), float("nan"))  # a view of a weight, written in place
        assert collection.init_block(t, 5, 3, (r0, r1), (c0, c1), out=out) is out
        assert torch.equal(out, whole[r0:r1, c0:c1])
    assert collection.init_block(t, 5, 3, (1001, 1001), (0, 8)).shape == (0, 8)  # an empty row shard
    monkeypatch.undo()
    assert torch.equal(torch.cat(list(collection.init_row_chunks(t, 5, 3, 97))), whole)


def test_fused_collection_from_an_init_function_and_on_meta() -> None:
    """``init`` gives each table's rows; on "meta" the collection has shapes and no values (nothing is drawn)."""
    tables = [TableConfig("a", 5, 4, (0,)), TableConfig("b", 3, 4, (1,))]
    given = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig(), init=lambda i, out: out.fill_(float(i)))
    assert torch.equal(given.weight, torch.cat([torch.zeros(5, 4), torch.ones(3, 4)]))
    drawn = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig(), seed=7)  # in place, in chunks
    assert torch.equal(drawn.weight, torch.cat([init_table(t, 7, i) for i, t in enumerate(tables)]))
    meta = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig(), init=lambda i, out: 1 / 0, device="meta")
    assert meta.weight.is_meta and tuple(meta.weight.shape) == (8, 4)


def test_shared_table_two_features() -> None:
    tables = [TableConfig("shared", 10, 4, (0, 1)), TableConfig("own", 6, 4, (2,))]
    ec = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig("sgd", lr=0.1))
    ids = torch.tensor([[3, 3, 5], [1, 2, 0]])
    out = ec(SparseFeatures.from_dense_ids(ids))
    torch.testing.assert_close(out[0, 0], out[0, 1])  # both features read row 3 of the shared table
    torch.testing.assert_close(out[1, 2], ec.table_weight("own")[0])
