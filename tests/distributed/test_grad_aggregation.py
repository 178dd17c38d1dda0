"""Gradient aggregation for the backward all-to-all: which pieces qualify, and that the owner's per-row sums
are those of the per-sample gradients (the distributed check against one process is in test_sharded.py)."""

from __future__ import annotations

import pytest
import torch

from recstack.config import load_config
from recstack.distributed.grad_aggregation import (
    aggregate,
    aggregate_flat,
    expand,
    expand_flat,
    receive_groups,
    send_groups,
)
from recstack.errors import ConfigError


def _row_sums(rows: torch.Tensor, present: torch.Tensor, grads: torch.Tensor, n_rows: int) -> torch.Tensor:
    return torch.zeros(n_rows, grads.shape[1], dtype=torch.float64).index_add_(0, rows, grads[present].double())


@pytest.mark.parametrize("seed", range(5))
def test_owner_row_sums_equal_per_sample_sums(seed: int) -> None:
    """Several pieces at once (different batches, widths, a multi-hot one that stays per sample)."""
    g = torch.Generator().manual_seed(seed)
    pieces, grads, n_rows = [], [], 7
    for b, d, multi in ((40, 3, False), (25, 3, False), (40, 5, False), (30, 3, True), (0, 3, False)):
        lengths = (torch.rand(b, generator=g) < 0.8).long() + (multi and b > 0) * (torch.arange(b) == 0).long()
        ids = torch.randint(0, n_rows, (int(lengths.sum()),), generator=g)  # a row shard: some samples have none
        pieces.append((ids, lengths))
        grads.append(torch.randn(b, d, generator=g))
    send, recv = send_groups(pieces, False), receive_groups(pieces, False)
    sums = aggregate(grads, send)
    full = expand(sums, recv)  # what the owner's ordinary backward then sees, per sample
    for (ids, lengths), grad, s, r, got, x in zip(pieces, grads, send, recv, full, sums, strict=True):
        if lengths.numel() and int(lengths.max()) > 1:
            assert s is None and r is None and x is grad and got is grad
            continue
        assert s.count == r.first.numel() == ids.unique().numel() and x.shape == (s.count, grad.shape[1])
        assert got.shape == grad.shape
        present = lengths == 1
        torch.testing.assert_close(_row_sums(ids, present, got, n_rows), _row_sums(ids, present, grad, n_rows),
                                   atol=1e-6, rtol=1e-6)
        assert (got[~present] == 0).all()
        on_first = torch.zeros(len(lengths), dtype=torch.bool)
        on_first[r.first] = True
        assert (got[present & ~on_first] == 0).all()  # the rest of each id's samples carry nothing



@pytest.mark.parametrize("widths", [(4, 4, 4, 4), (4, 2, 4, 4)])
def test_flat_buffers_match_the_piecewise_path(widths: tuple[int, ...]) -> None:
    """The exchange's one-pass form (one width) and its fallback (mixed widths) give the piecewise results."""
    g = torch.Generator().manual_seed(7)
    pieces, grads = [], []
    for k, d in enumerate(widths):
        b = 30 + 5 * k
        lengths = (torch.rand(b, generator=g) < 0.7).long()
        if k == 2:
            lengths[0] = 2  # multi-hot: this piece travels per sample
        pieces.append((torch.randint(0, 6, (int(lengths.sum()),), generator=g), lengths))
        grads.append(torch.randn(b, d, generator=g))
    send, recv = send_groups(pieces, False), receive_groups(pieces, False)
    flat = torch.cat([x.reshape(-1) for x in grads])
    sums, shapes = aggregate_flat(flat, [tuple(x.shape) for x in grads], send)
    want = aggregate(grads, send)
    assert shapes == [tuple(x.shape) for x in want]
    torch.testing.assert_close(sums, torch.cat([x.reshape(-1) for x in want]), atol=1e-6, rtol=1e-6)
    full = expand_flat(sums, shapes, recv)
    torch.testing.assert_close(full, torch.cat([x.reshape(-1) for x in expand(want, recv)]), atol=1e-6, rtol=1e-6)

def test_multi_hot_and_weighted_pieces_travel_per_sample() -> None:
    lengths, ids = torch.tensor([1, 2, 0, 1]), torch.tensor([3, 1, 2, 3])
    assert send_groups([(ids, lengths)], False) == [None] == receive_groups([(ids, lengths)], False)
    one_hot = torch.tensor([1, 1, 0, 1])
    assert send_groups([(ids[:3], one_hot)], True) == [None] == receive_groups([(ids[:3], one_hot)], True)
    grads = torch.randn(4, 2)
    assert aggregate([grads], [None])[0] is grads and expand([grads], [None])[0] is grads


def test_aggregation_refuses_error_feedback() -> None:
    with pytest.raises(ConfigError, match="dist.aggregate_gradients: cannot be combined"):
        load_config(None, ["dist.aggregate_gradients=true", 'dist.backward_codec="eb"',
                           "compression.error_feedback=true"])
    load_config(None, ["dist.aggregate_gradients=true", 'dist.backward_codec="eb"'])
