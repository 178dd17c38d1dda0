"""Counter-based random numbers, Zipf-like rank sampling and keyed id permutations, all vectorised in numpy.

Everything here is a pure function of integer keys (seed, purpose, table, row or id, ...), never of a
stateful generator. That is what lets the synthetic generator produce the same row ``i`` whatever chunk it
falls in, and derive the parameters of id ``j`` of a 10M-row table on demand without storing the table.

The mixer is the splitmix64 finaliser (a bijective avalanche on 64-bit words); uint64 arithmetic wraps
modulo 2**64 by design, so overflow warnings are silenced where it is used.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 4


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser of uint64 values: [...] -> [...] uint64, a bijection with full avalanche."""
    z = np.array(x, dtype=np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def scalar_key(*parts: int) -> np.uint64:
    """Fold Python integers (any sign or size) into one uint64 key; used for per-table/per-purpose bases."""
    h = np.array([0x243F6A8885A308D3], dtype=np.uint64)
    for p in parts:
        h = mix64(h ^ np.uint64(int(p) & _MASK64))
    return h[0]


def keyed(base: np.uint64, *arrays: np.ndarray) -> np.ndarray:
    """Hash of (base, a0[i], a1[i], ...) for broadcastable integer arrays: [...] uint64.

    One mixing pass per array over the shape broadcast so far (so keyed(b, rows[:, None], cols[None, :])
    mixes the rows once, then the full grid once). Callers fold constant keys into ``base`` first.
    """
    h = np.array(base, dtype=np.uint64)
    for a in arrays:
        h = mix64(h ^ np.asarray(a).astype(np.int64).view(np.uint64))
    return h


def uniform(h: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniforms in the open interval (0, 1), 53 bits each."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def uniform_quad(h: np.ndarray) -> np.ndarray:
    """Four 16-bit uniforms in (0, 1) per hash: [...] uint64 -> [..., 4] float64 (cheap bulk randomness)."""
    h = np.ascontiguousarray(h, dtype="<u8")  # fixed byte order: the same values on every platform
    parts = h.view("<u2").reshape(*h.shape, 4).astype(np.float64)
    return (parts + 0.5) * (1.0 / 65536.0)


def approx_normal(h: np.ndarray) -> np.ndarray:
    """Standard-normal-like values (Irwin-Hall sum of four 16-bit uniforms, rescaled to mean 0, variance 1).

    Bounded at about +-3.46; far cheaper than Box-Muller and close enough for synthetic effects. [...] -> [...].
    """
    h = np.asarray(h, dtype=np.uint64)
    # Sum the four 16-bit fields with two lane-wise adds instead of a slow reduction over a length-4 axis.
    pairs = (h & np.uint64(0x0000FFFF0000FFFF)) + ((h >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF))
    total = (pairs & np.uint64(0xFFFFFFFF)) + (pairs >> np.uint64(32))
    return ((total.astype(np.float64) + 2.0) * (1.0 / 65536.0) - 2.0) * np.sqrt(3.0)


def symmetric_quad(h: np.ndarray) -> np.ndarray:
    """Four zero-mean, unit-variance uniform values per hash: [...] uint64 -> [..., 4] float64."""
    return (uniform_quad(h) - 0.5) * np.sqrt(12.0)


def zipf_ranks(u: np.ndarray, n: int, exponent: float) -> np.ndarray:
    """Popularity ranks in [0, n) from uniforms u in (0, 1): [...] float64 -> [...] int64.

    Inverse CDF of the continuous density proportional to x**-exponent on [1, n + 1), floored, so rank r
    has probability proportional to the integral of x**-exponent over [r + 1, r + 2): Zipf-like, with the
    head marginally flatter than an exact Zipf law. O(1) memory whatever ``n`` is. exponent 0 is uniform.
    """
    if n < 1:
        raise ValueError(f"zipf_ranks: table size must be >= 1, got {n}")
    if exponent < 0:
        raise ValueError(f"zipf_ranks: exponent must be >= 0, got {exponent}")
    top = float(n + 1)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * np.log(top))
    else:
        a = 1.0 - exponent
        x = (1.0 + u * (top**a - 1.0)) ** (1.0 / a)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, n - 1)


def zipf_mass_below(rank: np.ndarray, n: int, exponent: float) -> np.ndarray:
    """P(sampled rank < rank) under ``zipf_ranks``: [...] -> [...] float64 (the CDF, for tests and reports)."""
    x = np.asarray(rank, dtype=np.float64) + 1.0
    top = float(n + 1)
    if abs(exponent - 1.0) < 1e-9:
        return np.log(x) / np.log(top)
    a = 1.0 - exponent
    return (x**a - 1.0) / (top**a - 1.0)


def fit_zipf_exponent(counts: np.ndarray, min_count: int = 10, points: int = 64) -> float:
    """Zipf exponent of observed value counts [n] (any order): minus the least-squares slope of log count
    against log rank, clipped at 0. The fit uses ``points`` log-spaced ranks among the values seen at least
    ``min_count`` times (each decade of ranks weighs alike, and the tail's counts of 1 and 2, which flatten
    every finite sample, are left out); 0 when fewer than two ranks qualify."""
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    c = c[c >= min_count]
    if len(c) < 2:
        return 0.0
    ranks = np.unique(np.round(np.geomspace(1, len(c), points)).astype(np.int64))
    slope = np.polyfit(np.log(ranks.astype(np.float64)), np.log(c[ranks - 1]), 1)[0]
    return max(0.0, float(-slope))


class IdPermutation:
    """A keyed pseudo-random bijection of [0, n), so the most popular ranks land on scattered ids.

    A 4-round Feistel network on the smallest even number of bits covering n, restricted to [0, n) by
    cycle walking (re-apply until the value falls inside). Nothing is stored; ``forward`` and ``inverse``
    work on any batch of values, for tables of any size.
    """

    def __init__(self, n: int, key: np.uint64) -> None:
        if n < 1:
            raise ValueError(f"IdPermutation: size must be >= 1, got {n}")
        self.n = int(n)
        half = 1
        while (1 << (2 * half)) < self.n:
            half += 1
        self.half_bits = np.uint64(half)
        self.half_mask = np.uint64((1 << half) - 1)
        self.round_keys = [scalar_key(int(key), r) for r in range(_FEISTEL_ROUNDS)]

    def _round(self, x: np.ndarray, r: int) -> np.ndarray:
        # Cheap keyed round function; the Feistel structure makes the whole map a bijection regardless.
        with np.errstate(over="ignore"):
            t = (x ^ self.round_keys[r]) * _M1
        t ^= t >> np.uint64(32)
        return t & self.half_mask

    def _feistel(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        left, right = x >> self.half_bits, x & self.half_mask
        if not inverse:
            for r in range(_FEISTEL_ROUNDS):
                left, right = right, left ^ self._round(right, r)
        else:
            for r in reversed(range(_FEISTEL_ROUNDS)):
                left, right = right ^ self._round(left, r), left
        return (left << self.half_bits) | right

    def _walk(self, values: np.ndarray, inverse: bool) -> np.ndarray:
        v = np.asarray(values, dtype=np.int64)
        shape = v.shape
        v = v.reshape(-1)
        if v.size and (v.min() < 0 or v.max() >= self.n):
            raise ValueError(f"IdPermutation: values must lie in [0, {self.n}), got [{v.min()}, {v.max()}]")
        out = self._feistel(v.astype(np.uint64), inverse)
        pending = np.flatnonzero(out >= np.uint64(self.n))
        while pending.size:  # expected walk length is below 4: the Feistel domain is < 4n
            out[pending] = self._feistel(out[pending], inverse)
            pending = pending[out[pending] >= np.uint64(self.n)]
        return out.astype(np.int64).reshape(shape)

    def forward(self, ranks: np.ndarray) -> np.ndarray:
        """Ranks [...] int in [0, n) -> ids [...] int64 in [0, n)."""
        return self._walk(ranks, inverse=False)

    def inverse(self, ids: np.ndarray) -> np.ndarray:
        """Ids [...] int in [0, n) -> ranks [...] int64 (exact inverse of ``forward``)."""
        return self._walk(ids, inverse=True)


__all__ = [
    "IdPermutation",
    "approx_normal",
    "fit_zipf_exponent",
    "keyed",
    "mix64",
    "scalar_key",
    "symmetric_quad",
    "uniform",
    "uniform_quad",
    "zipf_mass_below",
    "zipf_ranks",
]
