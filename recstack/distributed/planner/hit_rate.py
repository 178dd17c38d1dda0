"""Cache hit rates of a row cache over Zipf-distributed ids, for the planner's storage tiers.

The id law is the synthetic generator's (``recstack.data.synth.zipf.zipf_ranks``): over n rows, popularity
rank r is drawn with probability p_r proportional to the integral of x**-s over [r + 1, r + 2) (s = 0:
uniform), and the ranks are scattered over the ids. Ids are independent draws (the independent reference
model). Tables of 94M rows are not summed row by row: ranks are grouped in bins (the first 1024 ranks one
each, then log-spaced) whose ranks share one probability, the bin's mass over its width: O(bins) work
whatever n is.

Two cache policies, C rows of cache:

- ``lfu``: the cache keeps the C most popular rows (a perfect LFU over a stationary law), so the hit rate per
  id is the Zipf mass of the top C ranks.
- ``lru``: Che's approximation. A row is resident iff it was requested within the last tau requests, tau
  (the characteristic time) solving sum_r (1 - exp(-p_r tau)) = C; the hit rate per id is
  sum_r p_r (1 - exp(-p_r tau)).

The planner prices what the cache actually moves: the cache (``recstack.embedding.tiered.cache``) looks up the
distinct rows of each batch once, so with N ids per step, row r is requested in a step with probability
q_r = 1 - exp(-N p_r) and misses when it is not resident: misses per step = sum_r q_r * (1 - resident_r), the
hit rate is 1 - misses / requests with requests = sum_r q_r (the cache counters' definition). With N -> 0
this is the per-id hit rate above. The recency clock of the LRU cache advances once per batch; Che's
approximation in batches gives the same residency, 1 - exp(-N p_r T) with tau = N T.

A row shard (``fraction`` q of the table's rows, the ranks scattered over the ids so every shard sees every
popularity level) sees the same law thinned to q of each bin; its cache of C rows behaves like a cache of C / q
rows over the whole table. (A table spec's ``access_counts`` histogram does not enter the hit rates.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recstack.data.synth.zipf import zipf_mass_below

POLICIES = ("lru", "lfu")
SYNTH_ZIPF_EXPONENT = 1.1  # recstack.data.synth.SynthConfig.zipf_exponent (a test keeps them equal)
_EXACT_RANKS = 1024  # ranks below this get a bin each
_LOG_BINS = 4096  # log-spaced bins above them


@dataclass(frozen=True)
class CacheEstimate:
    """Expected cache behaviour per training step: ``requests`` distinct rows looked up, ``misses`` of them
    not resident (each fetched from the backing store and, as training updates every row it reads, written
    back when evicted), ``hit_rate`` = 1 - misses / requests, ``id_hit_rate`` = the share of ids (not distinct
    rows) that hit."""

    requests: float
    misses: float
    hit_rate: float
    id_hit_rate: float


class ZipfRows:
    """Zipf(``exponent``) popularity over ``rows`` rows in bins: ``width`` [m] ranks per bin (floats: a shard
    takes a fraction of each) and ``p`` [m] probability of each rank in the bin; ranks in popularity order."""

    def __init__(self, rows: int, exponent: float) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be a positive integer, got {rows!r}")
        if not 0 <= exponent < np.inf:
            raise ValueError(f"Zipf exponent must be a non-negative number, got {exponent!r}")
        self.rows, self.exponent = rows, float(exponent)
        exact = np.arange(min(rows, _EXACT_RANKS) + 1, dtype=np.float64)
        if rows > _EXACT_RANKS:
            tail = np.unique(np.round(np.geomspace(_EXACT_RANKS, rows, _LOG_BINS + 1)))
            edges = np.unique(np.concatenate([exact, tail]))
        else:
            edges = exact
        mass = np.diff(zipf_mass_below(edges, rows, self.exponent))
        self.width = np.diff(edges)  # [m]
        self.p = mass / self.width  # [m]

    def resident(self, cache_rows: float, policy: str, fraction: float = 1.0) -> np.ndarray:
        """[m] probability that a rank of each bin is in a cache of ``cache_rows`` rows, for a shard holding
        ``fraction`` of the rows (a cache of cache_rows / fraction over the whole table)."""
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
        c = cache_rows / fraction
        if c >= self.rows:
            return np.ones_like(self.p)
        if c <= 0:
            return np.zeros_like(self.p)
        if policy == "lfu":  # the top c ranks; the bin that holds rank c is partly resident
            before = np.concatenate([[0.0], np.cumsum(self.width)[:-1]])
            return np.clip((c - before) / self.width, 0.0, 1.0)
        return -np.expm1(-self.p * che_time(self, c))


def che_time(law: ZipfRows, cache_rows: float) -> float:
    """Characteristic time tau (in requests) of an LRU cache of ``cache_rows`` < rows rows:
    sum_r (1 - exp(-p_r tau)) = cache_rows, solved by bisection on log tau (the sum grows with tau)."""

    def filled(tau: float) -> float:
        return float((law.width * -np.expm1(-law.p * tau)).sum())

    lo, hi = 1e-300, 1.0
    while filled(hi) < cache_rows:
        lo, hi = hi, hi * 4.0
    for _ in range(200):
        mid = np.sqrt(lo * hi) if lo > 0 else hi / 2
        if filled(mid) < cache_rows:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return float(hi)


def estimate_cache(rows: int, exponent: float, cache_rows: float, ids_per_step: float, policy: str,
                   fraction: float = 1.0) -> CacheEstimate:
    """Cache behaviour per step of a shard holding ``fraction`` of a ``rows``-row table whose ids follow
    Zipf(``exponent``) (module docstring), with ``cache_rows`` rows of cache and ``ids_per_step`` ids of the
    whole table per step (the shard receives ``fraction`` of them)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    law = ZipfRows(rows, exponent)
    return _estimate(law, cache_rows, ids_per_step, policy, fraction)


def _estimate(law: ZipfRows, cache_rows: float, ids_per_step: float, policy: str, fraction: float) -> CacheEstimate:
    resident = law.resident(cache_rows, policy, fraction)
    width = law.width * fraction
    asked = -np.expm1(-ids_per_step * law.p)  # [m] chance a rank is requested in a step
    requests = float((width * asked).sum())
    misses = float((width * asked * (1.0 - resident)).sum())
    id_mass = width * law.p
    id_hit = float((id_mass * resident).sum() / id_mass.sum())
    return CacheEstimate(requests, misses, 1.0 - misses / requests if requests > 0 else 1.0, id_hit)

