"""Epoch order and coverage of the batch loader: every row once per epoch (a short last batch), the shuffle
modes deterministic by seed and epoch, positions exact under resume and over ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import write_tiny_dataset

from recstack.data.loader import BatchLoader, LoaderPosition
from recstack.data.order import EpochOrder, shuffle_mode
from recstack.data.prepared_dataset import PreparedDataset
from recstack.training.checkpoint.resume import saved_position

ROWS = 1003  # not a multiple of any batch used here
MODES = ("none", "blocks", "rows", "window")


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> PreparedDataset:
    data = write_tiny_dataset(tmp_path_factory.mktemp("order") / "data", rows=ROWS)
    return PreparedDataset(data)


def _row_ids(ds: PreparedDataset) -> np.ndarray:
    """A column that names each row: the generator's probability is distinct per row in this set."""
    p = np.asarray(ds.column("probability"))
    assert len(np.unique(p)) == len(p)
    return p


def _epoch_rows(loader: BatchLoader, ids: np.ndarray, limit: int | None = None) -> list[np.ndarray]:
    """The row indices of each batch the loader yields (from its position), via the probability column."""
    where = {float(v): i for i, v in enumerate(ids)}
    return [np.array([where[float(v)] for v in b.extras["probability"].numpy()])
            for b in loader.iterate_epoch(limit)]


def _loader(ds: PreparedDataset, mode: str, batch: int = 64, **kw) -> BatchLoader:
    return BatchLoader(ds, batch, shuffle=mode, extras=("probability",), shuffle_window=100, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_row_once_per_epoch(ds: PreparedDataset, mode: str, prefetch: int) -> None:
    """Without drop_last an epoch visits all 1003 rows once (15 batches of 64 and one of 43); the position then
    points at the next epoch."""
    ids = _row_ids(ds)
    loader = _loader(ds, mode, drop_last=False, prefetch=prefetch)
    assert len(loader) == 16
    batches = _epoch_rows(loader, ids)
    assert [len(b) for b in batches] == [64] * 15 + [43]
    assert sorted(np.concatenate(batches).tolist()) == list(range(ROWS))
    assert loader.position == LoaderPosition(1, 0)


@pytest.mark.parametrize("mode", MODES)
def test_drop_last_skips_the_short_batch(ds: PreparedDataset, mode: str) -> None:
    ids = _row_ids(ds)
    loader = _loader(ds, mode, drop_last=True)
    rows = np.concatenate(_epoch_rows(loader, ids))
    assert len(loader) == 15 and len(rows) == 960 == len(np.unique(rows))
    assert loader.position == LoaderPosition(1, 0)


@pytest.mark.parametrize("mode", ["blocks", "rows", "window"])
def test_order_differs_by_epoch_and_seed_and_repeats_for_the_same(ds: PreparedDataset, mode: str) -> None:
    def seq(seed: int, epoch: int) -> list[int]:
        loader = _loader(ds, mode, drop_last=False, seed=seed)
        loader.position = LoaderPosition(epoch, 0)
        return np.concatenate(_epoch_rows(loader, _row_ids(ds))).tolist()

    assert seq(0, 0) == seq(0, 0)
    assert seq(0, 0) != seq(0, 1) and seq(0, 0) != seq(1, 0)
    if mode != "blocks":  # rows share batches with other rows than in file order
        first = set(seq(0, 0)[:64])
        assert first != set(range(64)) and first != set(seq(0, 1)[:64])


def test_blocks_keep_the_order_shuffle_true_always_had() -> None:
    """``train.shuffle = true`` is the block mode: its full blocks in the permutation the loader always drew
    (default_rng([seed, epoch]).permutation(full blocks)), the short block last."""
    assert shuffle_mode(True) == "blocks" and shuffle_mode(False) == "none"
    order = EpochOrder("blocks", 0, 1003, 64, seed=3, epoch=2)
    before = np.random.default_rng([3, 2]).permutation(1003 // 64)
    assert [order.piece(k * 64, k * 64 + 64)[0] // 64 for k in range(15)] == before.tolist()
    assert order.piece(960, 1003) == (960, 1003)
    with pytest.raises(ValueError, match="is not one of"):
        shuffle_mode("random")


def test_window_shuffle_permutes_rows_inside_windows() -> None:
    """Each window of 100 consecutive rows is visited as a whole, in a shuffled order, before the next."""
    order = EpochOrder("window", 10, 1013, 64, seed=0, epoch=0, window=100)
    seq = order.piece(0, 1003 // 2).tolist() + order.piece(1003 // 2, 1003).tolist()
    assert sorted(seq) == list(range(10, 1013))
    windows = [(r - 10) // 100 for r in seq]
    runs = [w for i, w in enumerate(windows) if i == 0 or windows[i - 1] != w]
    assert sorted(runs) == list(range(11)) and runs != list(range(11))  # each window once, not in file order
    assert seq[:100] != sorted(seq[:100])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_continues_at_the_next_row(ds: PreparedDataset, mode: str, prefetch: int) -> None:
    """A loader stopped after 5 batches and a fresh one put at its position give the rest of the epoch and the
    next epoch exactly as an uninterrupted loader does."""
    ids = _row_ids(ds)
    straight = _loader(ds, mode, drop_last=False, seed=7)
    want = _epoch_rows(straight, ids) + _epoch_rows(straight, ids)
    stopped = _loader(ds, mode, drop_last=False, seed=7, prefetch=prefetch)
    got = _epoch_rows(stopped, ids, limit=5)
    assert stopped.position == LoaderPosition(0, 320)
    again = _loader(ds, mode, drop_last=False, seed=7, prefetch=prefetch)
    again.position = stopped.position
    assert again.batches_until(2) == 11 + 16
    got += _epoch_rows(again, ids) + _epoch_rows(again, ids)
    assert [b.tolist() for b in got] == [b.tolist() for b in want]


@pytest.mark.parametrize("mode", ["none", "rows", "window"])
def test_another_batch_size_continues_at_the_same_row(ds: PreparedDataset, mode: str) -> None:
    """Rows 0..320 done in batches of 64; batches of 96 from there visit exactly the rest of the sequence."""
    ids = _row_ids(ds)
    piece = EpochOrder(mode, 0, ROWS, 64, seed=0, epoch=0, window=100).piece(0, ROWS)  # the epoch's sequence
    seq = list(range(*piece)) if isinstance(piece, tuple) else piece.tolist()
    first = _loader(ds, mode, drop_last=False)
    done = np.concatenate(_epoch_rows(first, ids, limit=5)).tolist()
    wider = _loader(ds, mode, batch=96, drop_last=False)
    wider.position = wider.normalised(first.position.rebatched(64, 96, mode))
    rest = _epoch_rows(wider, ids)
    assert [len(b) for b in rest] == [96] * 7 + [683 - 7 * 96]
    assert sorted(done) == sorted(seq[:320])  # a batch is read in file order: compare its set of rows
    for k, rows in enumerate(rest):
        assert sorted(rows.tolist()) == sorted(seq[320 + 96 * k : 320 + 96 * (k + 1)])
    with pytest.raises(ValueError, match="another permutation"):
        first.position.rebatched(64, 96, "blocks")
    assert LoaderPosition(2, 0).rebatched(64, 96, "blocks") == LoaderPosition(2, 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_each_global_batch_of_the_same_order(ds: PreparedDataset, mode: str, world: int) -> None:
    """Rank r's batches are the r-th slices of one process's global batches (the same rows, the last batch
    short and split unevenly); every batch knows the global batch's row count."""
    ids = _row_ids(ds)
    gb = 63 if world == 3 else 64
    one = _loader(ds, mode, batch=gb, drop_last=False, seed=5)
    want = _epoch_rows(one, ids)
    per_rank = [_epoch_rows(_loader(ds, mode, batch=gb // world, drop_last=False, seed=5, rank=r, world_size=world),
                            ids) for r in range(world)]
    assert all(len(p) == len(want) for p in per_rank)
    for k, rows in enumerate(want):
        assert sorted(np.concatenate([p[k] for p in per_rank]).tolist()) == sorted(rows.tolist())
    loader = _loader(ds, mode, batch=gb // world, drop_last=False, rank=world - 1, world_size=world)
    sizes = [b.global_rows for b in loader.iterate_epoch()]
    assert sizes == [gb] * (ROWS // gb) + [ROWS % gb]


def test_short_batch_of_one_row_leaves_rank_0_empty(tmp_path: Path) -> None:
    data = PreparedDataset(write_tiny_dataset(tmp_path / "d", rows=129))
    shares = [[b.batch_size for b in BatchLoader(data, 64, drop_last=False, rank=r, world_size=2).iterate_epoch()]
              for r in range(2)]
    assert shares == [[64, 0], [64, 1]]


def test_checkpoint_positions_from_before_rows_are_converted() -> None:
    """Older checkpoints counted whole batches of an epoch that dropped its short last batch: batch 5 of 64 is
    row 320; a count at the end of the full batches (15 of 1003 rows) is the start of the next epoch."""
    old = {"config": {"train": {"batch_size": 64, "shuffle": True}}, "world_size": 1}
    assert saved_position({**old, "position": {"epoch": 1, "batch": 5}}, ROWS) == (LoaderPosition(1, 320), 64,
                                                                                 "blocks")
    assert saved_position({**old, "position": {"epoch": 1, "batch": 15, "global_batch_size": 64}}, ROWS)[0] == \
        LoaderPosition(2, 0)
    new = {"position": {"epoch": 0, "row": 960, "global_batch_size": 64, "shuffle": "rows"}}
    assert saved_position(new, ROWS) == (LoaderPosition(0, 960), 64, "rows")
