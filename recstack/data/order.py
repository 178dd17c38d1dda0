"""The order in which one epoch visits the rows of a prepared set (``train.shuffle``).

An epoch is a sequence of the rows [start, end); the loader cuts it into global batches of consecutive
positions of that sequence and gives rank r the r-th slice of each. Every mode is a pure function of
(seed, epoch), so a resumed run regenerates the same sequence and continues at the saved offset, and every rank
computes the same one (no collective):

* ``none``: rows in file order (time order kept, reads sequential).
* ``blocks``: the full blocks of ``global_batch`` consecutive rows in a permuted order, then the short block
  (``end - start`` not a multiple of the batch) last. The same rows always share a batch; reads stay
  sequential. This is what ``train.shuffle = true`` has always meant (the full blocks are permuted by the same
  generator as before, so runs that shuffled keep their numbers).
* ``rows``: a permutation of all rows (int64, 8 bytes a row on every rank).
* ``window``: the rows cut into windows of ``window`` consecutive rows; the windows in a permuted order, the rows
  inside each permuted by a generator of its own. Memory is bounded by one window's index (8 bytes a row) and
  reads stay within a window of the memory map; rows only meet rows of their own window in a batch.

``piece(a, b)`` returns positions [a, b) of the sequence as data-set rows: a contiguous ``(lo, hi)`` range for
``none`` and ``blocks``, an int64 array for the others.
"""

from __future__ import annotations

import numpy as np

SHUFFLES = ("none", "blocks", "rows", "window")


def shuffle_mode(value: bool | str) -> str:
    """``train.shuffle`` as a mode: true is ``blocks`` (its meaning before the modes), false ``none``."""
    if value is True:
        return "blocks"
    if value is False:
        return "none"
    if value not in SHUFFLES:
        raise ValueError(f"train.shuffle: {value!r} is not one of {', '.join(SHUFFLES)} (or true / false)")
    return str(value)


class EpochOrder:
    """The row sequence of epoch ``epoch`` over rows [start, end) (see the module docstring)."""

    def __init__(self, mode: str, start: int, end: int, global_batch: int, seed: int, epoch: int,
                 window: int = 0) -> None:
        self.mode, self.start, self.n, self.gb = mode, start, end - start, global_batch
        self.seed, self.epoch = seed, epoch
        if mode == "blocks":
            # The generator of the batch order before the modes existed: permutation(full blocks).
            self.blocks = np.random.default_rng([seed, epoch]).permutation(self.n // global_batch)
        elif mode == "rows":
            self.perm = np.random.default_rng([seed, epoch]).permutation(self.n).astype(np.int64) + start
        elif mode == "window":
            if window <= 0:
                raise ValueError(f"train.shuffle_window: must be > 0 for the window shuffle, got {window}")
            self.w = window
            nw = -(-self.n // window)
            self.windows = np.random.default_rng([seed, epoch]).permutation(nw)
            sizes = np.full(nw, window, np.int64)
            if nw:
                sizes[self.windows == nw - 1] = self.n - (nw - 1) * window  # the last window may be short
            self.cum = np.concatenate([np.zeros(1, np.int64), np.cumsum(sizes)])  # [nw + 1] sequence offsets
            self._cached: tuple[int, np.ndarray] | None = None  # (window, its rows in order)
        elif mode != "none":
            raise ValueError(f"unknown shuffle mode {mode!r}")

    @property
    def contiguous(self) -> bool:
        """Whether every ``piece`` is a contiguous range of rows."""
        return self.mode in ("none", "blocks")

    def piece(self, a: int, b: int) -> tuple[int, int] | np.ndarray:
        """Positions [a, b) of the sequence (at most one global batch) -> (lo, hi) rows, or int64 rows [b - a]."""
        if self.mode == "none":
            return self.start + a, self.start + b
        if self.mode == "blocks":
            k, gb = a // self.gb, self.gb
            if a % gb or b - a > gb:
                raise ValueError(f"block shuffle: positions [{a}, {b}) are not one block of {gb} rows")
            block = int(self.blocks[k]) if k < len(self.blocks) else k  # the short block comes last
            lo = self.start + block * gb
            return lo, lo + (b - a)
        if self.mode == "rows":
            return self.perm[a:b]
        return self._windowed(a, b)

    def _windowed(self, a: int, b: int) -> np.ndarray:
        parts = []
        i = int(np.searchsorted(self.cum, a, side="right")) - 1
        while a < b:
            rows = self._window_rows(i)
            lo, hi = a - int(self.cum[i]), min(b, int(self.cum[i + 1])) - int(self.cum[i])
            parts.append(rows[lo:hi])
            a += hi - lo
            i += 1
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _window_rows(self, i: int) -> np.ndarray:
        """Rows of the i-th window of the sequence, in their shuffled order (the latest one is cached)."""
        if self._cached is not None and self._cached[0] == i:
            return self._cached[1]
        w = int(self.windows[i])
        lo = w * self.w
        size = min(self.w, self.n - lo)
        rows = np.random.default_rng([self.seed, self.epoch, w]).permutation(size).astype(np.int64) + (self.start + lo)
        self._cached = (i, rows)
        return rows
