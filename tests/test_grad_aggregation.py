"""Gradient aggregation for the backward all-to-all: which pieces qualify, and that the owner's per-row sums
are those of the per-sample gradients (the distributed check against one process is in test_sharded.py)."""

from __future__ import annotations

import pytest
import torch

from recstack.config import ConfigError, load_config
from recstack.distributed.grad_aggregation import aggregate, expand, receive_groups, send_groups


def _row_sums(rows: torch.Tensor, present: torch.Tensor, grads: torch.Tensor, n_rows: int) -> torch.Tensor:
    return torch.zeros(n_rows, grads.shape[1], dtype=torch.float64).index_add_(0, rows, grads[present].double())


@pytest.mark.parametrize("seed", range(5))
def test_owner_row_sums_equal_per_sample_sums(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, d, n_rows = 40, 3, 7
    lengths = (torch.rand(b, generator=g) < 0.8).long()  # a row shard: some samples have no id in it
    ids = torch.randint(0, n_rows, (int(lengths.sum()),), generator=g)
    grads = torch.randn(b, d, generator=g)
    send, recv = send_groups(ids, lengths, False), receive_groups(ids, lengths, False)
    assert send is not None and recv is not None and send.count == recv.first.numel() == ids.unique().numel()
    sums = aggregate(grads, send)
    assert sums.shape == (send.count, d)
    full = expand(sums, recv)  # what the owner's ordinary backward then sees, per sample
    assert full.shape == (b, d)
    present = lengths == 1
    want = _row_sums(ids, present, grads, n_rows)
    got = _row_sums(ids, present, full, n_rows)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert (full[~present] == 0).all()
    on_first = torch.zeros(b, dtype=torch.bool)
    on_first[recv.first] = True
    assert (full[present & ~on_first] == 0).all()  # the rest of each id's samples carry nothing


def test_multi_hot_and_weighted_pieces_travel_per_sample() -> None:
    lengths, ids = torch.tensor([1, 2, 0, 1]), torch.tensor([3, 1, 2, 3])
    assert send_groups(ids, lengths, False) is None and receive_groups(ids, lengths, False) is None
    one_hot = torch.tensor([1, 1, 0, 1])
    assert send_groups(ids[:3], one_hot, True) is None and receive_groups(ids[:3], one_hot, True) is None
    grads = torch.randn(4, 2)
    assert aggregate(grads, None) is grads and expand(grads, None) is grads


def test_aggregation_refuses_error_feedback() -> None:
    with pytest.raises(ConfigError, match="dist.aggregate_gradients: cannot be combined"):
        load_config(None, ["dist.aggregate_gradients=true", 'dist.backward_codec="eb"',
                           "compression.error_feedback=true"])
    load_config(None, ["dist.aggregate_gradients=true", 'dist.backward_codec="eb"'])
