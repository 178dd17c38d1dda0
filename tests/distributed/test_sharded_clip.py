"""Gradient-norm clipping (``optim.max_grad_norm``) on sharded tables: 2 spawned gloo ranks against one process
(same global batches). The tables' part of the norm is summed over the ranks (each element of a table-, row- or
column-wise shard lives on one rank); a data-parallel table, the same on every rank, counts once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_sharded import _run, _spawn, assert_match_single_process

ALL_ROWS = ("optim.sparse_weight_decay=0.01", 'optim.sparse_weight_decay_mode="all_rows"')


@pytest.mark.parametrize(("sparse", "extra"), [("sgd", ("optim.sparse_weight_decay=0.01",)), ("adam", ALL_ROWS)],
                         ids=["sgd_touched", "adam_all_rows"])
def test_clipped_sharded_matches_single_process(tiny_dataset: Path, tmp_path: Path, sparse: str,
                                                extra: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    clipped = (*extra, "optim.max_grad_norm=0.05")
    ref = _run(tiny_dataset, sparse, 0, 1, extra=clipped, steps=15)
    unclipped = _run(tiny_dataset, sparse, 0, 1, extra=extra, steps=15)
    assert not torch.allclose(ref[2][0], unclipped[2][0], atol=1e-4)  # the clip binds
    names = ["mixed", "data_parallel"]  # mixed: data-parallel, row-, table- and column-wise tables at once
    assert_match_single_process(_spawn(tmp_path, tiny_dataset, 2, sparse, names, clipped, steps=15), names, ref)
