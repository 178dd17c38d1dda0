"""The ground truth of the synthetic click logs (``recstack.data.synth``): how rows are drawn and clicked.

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

Every random quantity is a hash of integer keys (recstack.data.synth.zipf): per-row values of (seed, row),
per-id parameters of (seed, table, id, drift knot), so a row does not depend on the chunk it is written in
and a 10M-row table costs nothing. The scales c_* and intercepts b_v are fitted on a calibration sample
drawn the same way, so each part has the configured logit standard deviation and each vertical its CTR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from recstack.data.synth.zipf import (
    IdPermutation,
    approx_normal,
    keyed,
    mix64,
    scalar_key,
    symmetric_quad,
    uniform,
    zipf_ranks,
)

if TYPE_CHECKING:
    from recstack.data.synth.generate import SynthConfig

# Hash purposes: every stream of randomness gets its own key so streams never correlate (LABEL and
# DATA_STREAM also key the labels that ``synth.generate`` draws).
_VERTICAL, _TIME, _RANK, _DENSE_Z, _DENSE_EPS, _DENSE_ZERO, LABEL = range(1, 8)
_PERM, _EFFECT, _EFFECT_VERT, _IMPORTANCE, _DENSE_PARAM, _BASE_DRIFT = range(10, 16)
_CHURN, RAW_ID = 16, 17
DATA_STREAM, _CALIBRATION_STREAM = 0, 1
_DENSE_FACTORS = 2  # shared latent "activity" factors that make the dense counts correlated


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
        u = uniform(keyed(scalar_key(self.cfg.seed, DATA_STREAM, _VERTICAL), idx))
        vertical = np.minimum(np.searchsorted(self.cum_mix, u), self.cfg.num_verticals - 1)
        return self._rows(idx, DATA_STREAM, time, vertical)

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
        if self.cfg.id_churn > 0:
            ids = self._churned(ids, time)
        return Rows(idx, time, vertical, ranks, ids, self._dense(idx, stream))

    def _churned(self, ids: np.ndarray, time: np.ndarray) -> np.ndarray:
        """``id_churn``: each id slot (an id of [0, size), with its popularity) is held by a new identity every
        1 / id_churn days, at a phase of its own, so a share id_churn of each table's ids leaves and as many new
        ones arrive each day. Identity g of slot s is s + stride * g (stride a multiple of num_verticals, so the
        vertical table still reveals the vertical); effects are hashed from it, so a new id has new effects."""
        out = np.empty_like(ids)
        day = np.floor(time)
        for f, size in enumerate(self.sizes):
            nv = self.cfg.num_verticals if f == self.vt else 1
            stride = -(-size // nv) * nv
            phase = uniform(keyed(scalar_key(self.cfg.seed, _CHURN, f), ids[:, f]))
            gen = np.floor(day * self.cfg.id_churn + phase).astype(np.int64)
            out[:, f] = ids[:, f] + stride * gen
        return out

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
                lo, hi = (mid, hi) if sigmoid(mid + zv).mean() < ctr else (lo, mid)
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
        return sigmoid(self.logit(ids, dense, vertical, time))


def sigmoid(x: np.ndarray | float) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x)))  # overflow-free form of 1 / (1 + exp(-x))
