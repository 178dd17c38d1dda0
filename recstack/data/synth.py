"""Synthetic click logs with a known ground-truth click model, written in the prepared format.

Each row i has a vertical v, a time t (in days; rows are in time order, ``timestamp`` = floor(t)), 13 dense
count features (stored log1p-transformed, as the Criteo prepare step does) and one id per sparse table.
Ids follow a Zipf-like popularity law per table, and a keyed permutation scatters the popular ids over
the table. The click probability is p = sigmoid(logit) with

    logit = b_v + delta_v(t)                               vertical base rate, wandering when drift > 0
          + c_dense * sum_j beta_j * tanh(x_j)             x_j: standardised log1p dense value
          + c_id    * sum_f a_f * s(r_f) * e_f(id_f, v, t) first-order id effects
          + c_pair  * sum_{f<g} <w_f, w_g>                 pairwise interactions between a few tables and
                                                           the dense field w_0 = W tanh(x); w_f = sqrt(g_f)
                                                           * s(r_f) * u_f(id_f, t), u_f a latent vector

a low-rank model that a DLRM with dot interaction can represent. s(r) = 1 / (1 + r / effect_head_rank)
shrinks the effects of rarely seen ids (r is the id's popularity rank): the signal then sits on ids a model
sees often enough to learn, which is what keeps a trained model close to the oracle. Drift rotates every
id's effect and latent vector from one independent draw to the next at ``drift`` radians per day. Verticals
differ in base rate and in a share of the first-order effects.

Every random quantity is a hash of integer keys (recstack.data.zipf): per-row values of (seed, row),
per-id parameters of (seed, table, id, drift knot), so a row does not depend on the chunk it is written in
and a 10M-row table costs nothing. The scales c_* and intercepts b_v are fitted on a calibration sample
drawn the same way, so each part has the configured logit standard deviation and each vertical its CTR.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from recstack.data.format import PreparedWriter, SparseFeatureSpec
from recstack.data.zipf import (
    IdPermutation,
    approx_normal,
    keyed,
    mix64,
    scalar_key,
    symmetric_quad,
    uniform,
    zipf_ranks,
)

# DLRM's embedding-table sizes for Criteo Kaggle (C1..C26), as listed in facebookresearch/dlrm
# tools/visualize.py (copied by value from the project's shared criteo_cardinalities.json).
CRITEO_KAGGLE_TABLE_SIZES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

# Hash purposes: every stream of randomness gets its own key so streams never correlate.
_VERTICAL, _TIME, _RANK, _DENSE_Z, _DENSE_EPS, _DENSE_ZERO, _LABEL = range(1, 8)
_PERM, _EFFECT, _EFFECT_VERT, _IMPORTANCE, _DENSE_PARAM, _BASE_DRIFT = range(10, 16)
_DATA_STREAM, _CALIBRATION_STREAM = 0, 1
_DENSE_FACTORS = 2  # shared latent "activity" factors that make the dense counts correlated
_BLOCK_ROWS = 16384
_OUTPUT_COLUMNS = ("labels", "dense", "sparse", "probability", "vertical", "timestamp", "example_id")


@dataclass
class SynthConfig:
    """Everything that defines a synthetic data set; the same config and seed give the same bytes."""

    rows: int = 1_000_000
    seed: int = 0
    num_dense: int = 13
    table_sizes: tuple[int, ...] = CRITEO_KAGGLE_TABLE_SIZES
    max_table_size: int | None = 100_000  # each table is capped at this many rows (None: no cap)
    zipf_exponent: float = 1.1  # id popularity ~ rank ** -zipf_exponent within each table
    num_days: int = 7  # rows are spread evenly over this many days, in time order
    target_ctr: float = 0.25  # overall click rate (sets the vertical CTRs when vertical_ctr is None)
    num_verticals: int = 1
    vertical_ctr: tuple[float, ...] | None = None  # click rate per vertical; None: spread around target
    vertical_mix: tuple[float, ...] | None = None  # share of rows per vertical; None: equal shares
    vertical_table: int | None = 0  # sparse table whose ids reveal the vertical (id % V == v); None: hidden
    vertical_effect_share: float = 0.5  # share of first-order id-effect variance that differs per vertical
    drift: float = 0.0  # radians per day that id effects and latent vectors rotate (0: stationary)
    base_rate_drift_std: float = 0.2  # logit std of the vertical base-rate wander when drift > 0
    # Signal strengths. The defaults give an oracle AUC near 0.79 and keep the signal learnable: a one-pass
    # DLRM on 0.6M rows gets ~96% of the oracle's (AUC - 0.5). Pairwise interactions are the part such a
    # model learns slowest (one pass over 0.5M rows picks up under a fifth of them), so by default they
    # carry a small share; raise interaction_logit_std for experiments that are about interactions.
    dense_logit_std: float = 0.8  # logit std contributed by the dense features' own effects
    id_logit_std: float = 1.0  # logit std contributed by first-order id effects
    interaction_logit_std: float = 0.2  # logit std contributed by pairwise interactions
    latent_dim: int = 4  # rank of the pairwise interaction model
    interaction_tables: int | None = 4  # tables (picked by seed) that carry latent vectors; None: all
    effect_head_rank: float = 10.0  # id effects shrink as 1 / (1 + rank / this) (0: no shrinkage)
    table_importance_spread: float = 0.5  # log-normal spread of per-table effect strengths
    calibration_rows: int = 32768  # rows per vertical used to fit the scales and intercepts

    def __post_init__(self) -> None:
        self.table_sizes = tuple(int(s) for s in self.table_sizes)
        for name in ("vertical_ctr", "vertical_mix"):
            if getattr(self, name) is not None:
                setattr(self, name, tuple(float(x) for x in getattr(self, name)))
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SynthConfig.{name}: {why}, got {getattr(self, name)!r}")

        for name in ("rows", "num_days", "num_verticals", "latent_dim", "calibration_rows"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.num_dense < 0:
            raise bad("num_dense", "must be >= 0")
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise bad("table_sizes", "must be a non-empty list of sizes >= 1")
        if max(self.effective_table_sizes) > 2**31 - 1:  # the prepared format stores ids as int32
            raise bad("table_sizes", "sizes above 2**31 - 1 need a max_table_size cap")
        if self.interaction_tables is not None and self.interaction_tables < 0:
            raise bad("interaction_tables", "must be >= 0 or None")
        if self.max_table_size is not None and self.max_table_size < 1:
            raise bad("max_table_size", "must be >= 1 or None")
        if not 0.0 < self.target_ctr < 1.0:
            raise bad("target_ctr", "must lie in (0, 1)")
        for name in (
            "zipf_exponent",
            "drift",
            "base_rate_drift_std",
            "dense_logit_std",
            "id_logit_std",
            "interaction_logit_std",
            "effect_head_rank",
            "table_importance_spread",
        ):
            if not getattr(self, name) >= 0.0:
                raise bad(name, "must be >= 0")
        if not 0.0 <= self.vertical_effect_share <= 1.0:
            raise bad("vertical_effect_share", "must lie in [0, 1]")
        v = self.num_verticals
        if self.vertical_ctr is not None and (
            len(self.vertical_ctr) != v or not all(0.0 < c < 1.0 for c in self.vertical_ctr)
        ):
            raise bad("vertical_ctr", f"needs {v} values in (0, 1)")
        if self.vertical_mix is not None and (
            len(self.vertical_mix) != v or min(self.vertical_mix) < 0 or sum(self.vertical_mix) <= 0
        ):
            raise bad("vertical_mix", f"needs {v} non-negative shares with a positive sum")
        if self.vertical_table is not None:
            if not 0 <= self.vertical_table < len(self.table_sizes):
                raise bad("vertical_table", f"must index one of the {len(self.table_sizes)} tables or be None")
            if v > 1 and self.effective_table_sizes[self.vertical_table] < v:
                raise bad("vertical_table", f"its table needs at least num_verticals={v} rows")

    @property
    def effective_table_sizes(self) -> tuple[int, ...]:
        """Table sizes after the ``max_table_size`` cap."""
        cap = self.max_table_size
        return tuple(s if cap is None else min(s, cap) for s in self.table_sizes)

    def mix(self) -> np.ndarray:
        """[V] float64 share of rows per vertical, summing to 1."""
        m = np.ones(self.num_verticals) if self.vertical_mix is None else np.array(self.vertical_mix)
        return m / m.sum()

    def ctr_per_vertical(self) -> np.ndarray:
        """[V] float64 click rate per vertical; by default 0.6x..1.4x the target, mix-weighted to it."""
        if self.vertical_ctr is not None:
            return np.array(self.vertical_ctr)
        spread = np.linspace(0.6, 1.4, self.num_verticals) if self.num_verticals > 1 else np.ones(1)
        rates = self.target_ctr * spread / float(self.mix() @ spread)
        if rates.max() >= 1.0:
            raise ValueError(f"SynthConfig.target_ctr: {self.target_ctr} too high to spread over verticals")
        return rates

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SynthConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"SynthConfig: unknown fields {unknown}")
        return cls(**d)


@dataclass
class Rows:
    """A block of n synthetic rows before labelling (T tables, D dense features)."""

    index: np.ndarray  # [n] int64 row number (example_id for the data stream)
    time: np.ndarray  # [n] float64 time in days
    vertical: np.ndarray  # [n] int64
    ranks: np.ndarray  # [n, T] int64 popularity rank of each id within its (sub-)table
    ids: np.ndarray  # [n, T] int64
    dense: np.ndarray  # [n, D] float32 log1p(count)


class ClickModel:
    """The ground-truth generator and click model of a ``SynthConfig`` (see the module docstring)."""

    def __init__(self, cfg: SynthConfig) -> None:
        self.cfg = cfg
        self.sizes = cfg.effective_table_sizes
        self.num_tables = len(self.sizes)
        self.vt = cfg.vertical_table if cfg.num_verticals > 1 else None
        self.cum_mix = np.cumsum(cfg.mix())
        seed = cfg.seed
        # One permutation per table; the vertical table has one per vertical over its residue class.
        self.perms: list[list[IdPermutation]] = []
        for f, n in enumerate(self.sizes):
            subs = self._sub_sizes(f, n)
            self.perms.append([IdPermutation(m, scalar_key(seed, _PERM, f, v)) for v, m in enumerate(subs)])
        imp = approx_normal(keyed(scalar_key(seed, _IMPORTANCE), np.arange(2 * self.num_tables)))
        imp = np.exp(cfg.table_importance_spread * imp)
        self.effect_weight, self.latent_weight = imp[: self.num_tables], np.sqrt(imp[self.num_tables :])
        # A few strongly interacting fields (think user x ad x site) instead of hundreds of faint pairs:
        # faint pairs are realistic too, but no model learns them from a few million rows.
        m = self.num_tables if cfg.interaction_tables is None else min(cfg.interaction_tables, self.num_tables)
        order = np.argsort(keyed(scalar_key(seed, _IMPORTANCE, 1), np.arange(self.num_tables)))
        self.latent_weight[order[m:]] = 0.0
        self._init_dense(seed)
        self.scale = {"dense": 1.0, "id": 1.0, "pair": 1.0}
        self.dense_mean = np.zeros(cfg.num_dense)
        self.dense_std = np.ones(cfg.num_dense)
        self.intercept = np.zeros(cfg.num_verticals)
        self._calibrate()

    # ----------------------------------------------------------------------------------------- rows
    def _sub_sizes(self, f: int, n: int) -> list[int]:
        v = self.cfg.num_verticals
        return [(n - r + v - 1) // v for r in range(v)] if f == self.vt else [n]

    def _init_dense(self, seed: int) -> None:
        d, k = self.cfg.num_dense, self.cfg.latent_dim
        u = uniform(keyed(scalar_key(seed, _DENSE_PARAM), np.arange(d)[:, None], np.arange(6)[None, :]))
        self.log_count_mean = 0.5 + 4.5 * u[:, 0]  # typical counts from ~2 to ~150
        self.log_count_noise = 0.5 + 0.7 * u[:, 1]
        self.zero_rate = 0.4 * u[:, 2]
        self.loadings = 1.6 * (u[:, 3:5] - 0.5)  # [D, 2]
        h = keyed(scalar_key(seed, _DENSE_PARAM, 1), np.arange(d)[:, None], np.arange(k + 1)[None, :])
        g = approx_normal(h)
        self.dense_beta = g[:, 0]  # [D]
        self.dense_latent = g[:, 1:].T / math.sqrt(max(d, 1))  # [k, D]

    def sample(self, start: int, stop: int) -> Rows:
        """Rows [start, stop) of the data set, unlabelled."""
        idx = np.arange(start, stop, dtype=np.int64)
        time = idx * (self.cfg.num_days / self.cfg.rows)
        u = uniform(keyed(scalar_key(self.cfg.seed, _DATA_STREAM, _VERTICAL), idx))
        vertical = np.minimum(np.searchsorted(self.cum_mix, u), self.cfg.num_verticals - 1)
        return self._rows(idx, _DATA_STREAM, time, vertical)

    def _rows(self, idx: np.ndarray, stream: int, time: np.ndarray, vertical: np.ndarray) -> Rows:
        seed, n, nv = self.cfg.seed, len(idx), self.cfg.num_verticals
        ranks = np.empty((n, self.num_tables), dtype=np.int64)
        ids = np.empty_like(ranks)
        for f, size in enumerate(self.sizes):
            u = uniform(keyed(scalar_key(seed, stream, _RANK, f), idx))
            if f != self.vt:
                ranks[:, f] = zipf_ranks(u, size, self.cfg.zipf_exponent)
                ids[:, f] = self.perms[f][0].forward(ranks[:, f])
                continue
            for v, perm in enumerate(self.perms[f]):
                m = vertical == v
                ranks[m, f] = zipf_ranks(u[m], perm.n, self.cfg.zipf_exponent)
                ids[m, f] = perm.forward(ranks[m, f]) * nv + v
        return Rows(idx, time, vertical, ranks, ids, self._dense(idx, stream))

    def _dense(self, idx: np.ndarray, stream: int) -> np.ndarray:
        d = self.cfg.num_dense
        if d == 0:
            return np.zeros((len(idx), 0), dtype=np.float32)
        seed = self.cfg.seed
        z = approx_normal(keyed(scalar_key(seed, stream, _DENSE_Z), idx[:, None], np.arange(_DENSE_FACTORS)))
        eps = approx_normal(keyed(scalar_key(seed, stream, _DENSE_EPS), idx[:, None], np.arange(d)))
        zero = uniform(keyed(scalar_key(seed, stream, _DENSE_ZERO), idx[:, None], np.arange(d)))
        log_count = self.log_count_mean + z @ self.loadings.T + self.log_count_noise * eps
        counts = np.floor(np.exp(log_count))
        counts[zero < self.zero_rate] = 0.0  # features that are often absent, as in Criteo
        return np.log1p(counts).astype(np.float32)

    # ---------------------------------------------------------------------------------- click model
    def _id_params(
        self, h_id: np.ndarray, h_vert: np.ndarray | None, share: float, knot: np.ndarray, with_latent: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """First-order effect [n] and latent vector [n, k] (or None) of ids hashed to h_id [n] at knot [n]."""
        k = self.cfg.latent_dim
        h = mix64(h_id ^ knot.view(np.uint64))
        effect = approx_normal(h)
        if h_vert is not None:  # part of the effect is specific to the row's vertical
            e_vert = approx_normal(mix64(h_vert ^ knot.view(np.uint64)))
            effect = math.sqrt(1.0 - share) * effect + math.sqrt(share) * e_vert
        if not with_latent:
            return effect, None
        sub = mix64(h[:, None] ^ np.arange(1, (k + 3) // 4 + 1, dtype=np.uint64))  # four coordinates each
        return effect, symmetric_quad(sub).reshape(len(h), -1)[:, :k]

    def _components(self, rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Unscaled parts of the logit: dense, first-order id, pairwise, base drift; each [n] float64."""
        cfg, n = self.cfg, len(rows.index)
        k = cfg.latent_dim
        phase = cfg.drift * rows.time
        knot = np.floor(phase / (math.pi / 2)).astype(np.int64)
        angle = phase - knot * (math.pi / 2)
        cos_a, sin_a = np.cos(angle), np.sin(angle)
        share = cfg.vertical_effect_share if cfg.num_verticals > 1 else 0.0
        first = np.zeros(n)
        pair_sum = np.zeros((n, k))
        pair_sq = np.zeros(n)
        for f in range(self.num_tables):
            ids = rows.ids[:, f]
            interacts = self.latent_weight[f] > 0
            shrink = 1.0 / (1.0 + rows.ranks[:, f] / cfg.effect_head_rank) if cfg.effect_head_rank else 1.0
            h_id = keyed(scalar_key(cfg.seed, _EFFECT, f), ids)
            h_vert = keyed(scalar_key(cfg.seed, _EFFECT_VERT, f), ids, rows.vertical) if share else None
            effect, latent = self._id_params(h_id, h_vert, share, knot, interacts)
            if cfg.drift > 0:  # rotate from this knot's draw towards the next knot's independent draw
                effect_next, latent_next = self._id_params(h_id, h_vert, share, knot + 1, interacts)
                effect = cos_a * effect + sin_a * effect_next
                if interacts:
                    latent = cos_a[:, None] * latent + sin_a[:, None] * latent_next
            first += self.effect_weight[f] * shrink * effect
            if interacts:
                latent = latent * ((self.latent_weight[f] / math.sqrt(k)) * np.asarray(shrink)[..., None])
                pair_sum += latent
                pair_sq += np.einsum("ij,ij->i", latent, latent)
        dense = np.zeros(n)
        if cfg.num_dense:
            g = np.tanh((rows.dense - self.dense_mean) / self.dense_std)
            dense = g @ self.dense_beta
            vec = g @ self.dense_latent.T
            pair_sum += vec
            pair_sq += np.einsum("ij,ij->i", vec, vec)
        pair = 0.5 * (np.einsum("ij,ij->i", pair_sum, pair_sum) - pair_sq)
        base = np.zeros(n)
        if cfg.drift > 0 and cfg.base_rate_drift_std > 0:
            hb = keyed(scalar_key(cfg.seed, _BASE_DRIFT), rows.vertical)
            eta = [approx_normal(mix64(hb ^ kn.view(np.uint64))) for kn in (knot, knot + 1)]
            eta0 = approx_normal(mix64(hb ^ np.uint64(0)))
            base = cfg.base_rate_drift_std * (cos_a * eta[0] + sin_a * eta[1] - eta0)
        return dense, first, pair, base

    def logit_of_rows(self, rows: Rows) -> np.ndarray:
        """True logit [n] float64 of rows from ``sample`` (uses their ranks; no inverse permutation)."""
        dense, first, pair, base = self._components(rows)
        s = self.scale
        return self.intercept[rows.vertical] + base + s["dense"] * dense + s["id"] * first + s["pair"] * pair

    def _calibrate(self) -> None:
        """Fit dense standardisation, part scales and per-vertical intercepts on a calibration sample."""
        cfg = self.cfg
        m = cfg.calibration_rows
        idx = np.arange(m * cfg.num_verticals, dtype=np.int64)
        time = uniform(keyed(scalar_key(cfg.seed, _CALIBRATION_STREAM, _TIME), idx)) * cfg.num_days
        rows = self._rows(idx, _CALIBRATION_STREAM, time, idx // m)
        if cfg.num_dense:
            self.dense_mean = rows.dense.mean(axis=0).astype(np.float64)
            self.dense_std = np.maximum(rows.dense.std(axis=0).astype(np.float64), 1e-6)
        dense, first, pair, base = self._components(rows)
        for name, part, target in (
            ("dense", dense, cfg.dense_logit_std),
            ("id", first, cfg.id_logit_std),
            ("pair", pair, cfg.interaction_logit_std),
        ):
            sd = float(part.std())
            self.scale[name] = target / sd if sd > 0 else 0.0
        z = self.logit_of_rows(rows)  # intercepts are still zero here
        for v, ctr in enumerate(cfg.ctr_per_vertical()):
            zv = z[rows.vertical == v]
            lo, hi = -30.0, 30.0
            for _ in range(60):  # bisection: mean sigmoid is increasing in the intercept
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if _sigmoid(mid + zv).mean() < ctr else (lo, mid)
            self.intercept[v] = 0.5 * (lo + hi)

    def logit(self, ids: np.ndarray, dense: np.ndarray, vertical: np.ndarray, time: np.ndarray) -> np.ndarray:
        """True logit of arbitrary rows: ids [n, T] int, dense [n, D] log1p values, vertical [n], time [n]
        in days (may be fractional) -> [n] float64. Lets experiments score counterfactual rows."""
        ids = np.asarray(ids, dtype=np.int64)
        n = ids.shape[0]
        if ids.shape != (n, self.num_tables):
            raise ValueError(f"ids: shape {ids.shape}, expected ({n}, {self.num_tables})")
        ranks = np.empty_like(ids)
        nv = self.cfg.num_verticals
        for f, size in enumerate(self.sizes):
            col = ids[:, f]
            if n and (col.min() < 0 or col.max() >= size):
                raise ValueError(f"ids column C{f + 1}: values [{col.min()}, {col.max()}] outside [0, {size})")
            if f != self.vt:
                ranks[:, f] = self.perms[f][0].inverse(col)
            else:
                for v, perm in enumerate(self.perms[f]):
                    m = col % nv == v
                    ranks[m, f] = perm.inverse(col[m] // nv)
        dense = np.asarray(dense, np.float32)
        if dense.shape != (n, self.cfg.num_dense):
            raise ValueError(f"dense: shape {dense.shape}, expected ({n}, {self.cfg.num_dense})")
        vertical = np.broadcast_to(np.asarray(vertical, np.int64), (n,))
        if n and (vertical.min() < 0 or vertical.max() >= nv):
            raise ValueError(f"vertical: values [{vertical.min()}, {vertical.max()}] outside [0, {nv})")
        time = np.broadcast_to(np.asarray(time, np.float64), (n,))
        rows = Rows(np.arange(n, dtype=np.int64), time, vertical, ranks, ids, dense)
        return self.logit_of_rows(rows)

    def probability(self, ids: np.ndarray, dense: np.ndarray, vertical: np.ndarray, time: np.ndarray) -> np.ndarray:
        """sigmoid(logit(...)): [n] float64."""
        return _sigmoid(self.logit(ids, dense, vertical, time))


def _sigmoid(x: np.ndarray | float) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x)))  # overflow-free form of 1 / (1 + exp(-x))


def streaming_auc(scores: np.ndarray, labels: np.ndarray, block_rows: int = 1 << 20, group_bins: int = 64) -> float:
    """Exact ROC AUC (ties count 1/2) of [N] float32 scores >= 0 against [N] 0/1 labels, in bounded memory.

    Works on memory maps: the uint32 bit pattern of a non-negative float32 orders like its value, so a
    histogram over the top 16 bits settles every pair in different bins, and one pass per ``group_bins``
    mixed bins histograms the low 16 bits to settle the rest exactly. NaN when one class is missing.
    """
    n = len(scores)

    def blocks():
        for s in range(0, n, block_rows):
            bits = np.ascontiguousarray(scores[s : s + block_rows], dtype=np.float32).view(np.uint32)
            if bits.size and bits.max() >= 0x7F800000:
                raise ValueError(f"streaming_auc: scores must be finite and >= 0 (block at row {s})")
            yield bits, np.asarray(labels[s : s + block_rows]) > 0.5

    pos = np.zeros(1 << 16, dtype=np.int64)
    neg = np.zeros(1 << 16, dtype=np.int64)
    for bits, y in blocks():
        hi = bits >> 16
        pos += np.bincount(hi[y], minlength=1 << 16)
        neg += np.bincount(hi[~y], minlength=1 << 16)
    total_pos, total_neg = int(pos.sum()), int(neg.sum())
    if total_pos == 0 or total_neg == 0:
        return float("nan")
    # Twice the Mann-Whitney count, in integers so it stays exact (int64 holds it up to ~4e9 rows).
    wins2 = 2 * int((pos * (np.cumsum(neg) - neg)).sum())
    mixed = np.flatnonzero((pos > 0) & (neg > 0))
    for g in range(0, len(mixed), group_bins):
        group = mixed[g : g + group_bins]
        slot = np.full(1 << 16, -1, dtype=np.int64)
        slot[group] = np.arange(len(group))
        fpos = np.zeros(len(group) << 16, dtype=np.int64)
        fneg = np.zeros_like(fpos)
        for bits, y in blocks():
            s = slot[bits >> 16]
            keep = s >= 0
            key = (s[keep] << 16) | (bits[keep] & 0xFFFF).astype(np.int64)
            yk = y[keep]
            fpos += np.bincount(key[yk], minlength=fpos.size)
            fneg += np.bincount(key[~yk], minlength=fneg.size)
        fpos, fneg = fpos.reshape(len(group), -1), fneg.reshape(len(group), -1)
        below = np.cumsum(fneg, axis=1) - fneg
        wins2 += int((2 * fpos * below + fpos * fneg).sum())
    return wins2 / (2 * total_pos * total_neg)


def generate(
    cfg: SynthConfig, out_dir: Path, *, chunk_rows: int = 262144, progress: bool = True, overwrite: bool = False
) -> Path:
    """Write ``cfg.rows`` synthetic rows to ``out_dir`` in the prepared format and return the directory.

    Columns: labels, dense (I1..), sparse (C1..), probability (float32 true p), vertical (int16), timestamp
    (int64 day), example_id (int64). ``info`` holds the config, the oracle AUC (true p against the drawn
    labels) and the base rate. Memory is bounded by ``chunk_rows``; the bytes do not depend on it.
    """
    if chunk_rows < 1:
        raise ValueError(f"generate: chunk_rows must be >= 1, got {chunk_rows}")
    model = ClickModel(cfg)
    label_key = scalar_key(cfg.seed, _DATA_STREAM, _LABEL)
    specs = [SparseFeatureSpec(f"C{f + 1}", n) for f, n in enumerate(model.sizes)]
    extras = {"probability": "float32", "vertical": "int16", "timestamp": "int64", "example_id": "int64"}
    dense_names = [f"I{j + 1}" for j in range(cfg.num_dense)]
    clicks = 0
    with (
        PreparedWriter(out_dir, dense_names, specs, extras, overwrite=overwrite) as writer,
        tqdm(total=cfg.rows, unit="row", unit_scale=True, disable=not progress, desc="synth") as bar,
    ):
        for start in range(0, cfg.rows, chunk_rows):
            stop = min(start + chunk_rows, cfg.rows)
            # Compute in cache-sized blocks (about twice as fast as whole chunks) and keep only the compact
            # output columns until the chunk is written.
            cols: dict[str, list[np.ndarray]] = {k: [] for k in _OUTPUT_COLUMNS}
            for b in range(start, stop, _BLOCK_ROWS):
                rows = model.sample(b, min(b + _BLOCK_ROWS, stop))
                # float32 p, clipped so that it stays inside (0, 1) after rounding; labels use the stored p.
                p = np.clip(_sigmoid(model.logit_of_rows(rows)), 1e-7, 1.0 - 1e-7).astype(np.float32)
                for k, v in (
                    ("labels", (uniform(keyed(label_key, rows.index)) < p).astype(np.float32)),
                    ("dense", rows.dense),
                    ("sparse", rows.ids.astype(np.int32)),
                    ("probability", p),
                    ("vertical", rows.vertical.astype(np.int16)),
                    ("timestamp", (rows.index * cfg.num_days) // cfg.rows),
                    ("example_id", rows.index),
                ):
                    cols[k].append(v)
            chunk = {k: np.concatenate(v) for k, v in cols.items()}
            clicks += int(chunk["labels"].sum())
            writer.write(**chunk)
            bar.update(stop - start)
        for f in ("probability", "labels"):
            writer.files[f].flush()
        stored = {
            f: np.memmap(writer.tmp_dir / f"{f}.bin", dtype=np.float32, mode="r", shape=(cfg.rows,))
            for f in ("probability", "labels")
        }
        oracle = streaming_auc(stored["probability"], stored["labels"], block_rows=max(chunk_rows, 1 << 16))
        del stored
        writer.info = {
            "generator": "recstack.data.synth",
            "config": cfg.to_dict(),
            "oracle_auc": None if math.isnan(oracle) else oracle,
            "base_rate": clicks / cfg.rows,
            "vertical_intercepts": model.intercept.tolist(),
            "logit_scales": dict(model.scale),
        }
    return Path(out_dir)


__all__ = ["CRITEO_KAGGLE_TABLE_SIZES", "ClickModel", "Rows", "SynthConfig", "generate", "streaming_auc"]
