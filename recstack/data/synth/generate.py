"""Synthetic click logs with a known ground-truth click model (``recstack.data.synth.click_model``), written in the
prepared format: ``SynthConfig`` says what to draw, ``generate`` writes the rows with their true click
probability and the oracle AUC.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from recstack.data.format import RAW_ID_RANGE, SparseFeatureSpec
from recstack.data.prepared_writer import PreparedWriter
from recstack.data.synth.click_model import DATA_STREAM, LABEL, RAW_ID, ClickModel, sigmoid
from recstack.data.synth.zipf import keyed, scalar_key, uniform
from recstack.metrics import streaming_auc

# DLRM's embedding-table sizes for Criteo Kaggle (C1..C26), as listed in facebookresearch/dlrm
# tools/visualize.py (copied by value from the project's shared criteo_cardinalities.json).
CRITEO_KAGGLE_TABLE_SIZES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

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
    # A stream whose ids come and go: each day a share id_churn of every table's ids is replaced by new ones
    # (``ClickModel._churned``); needs raw_ids, as the ids then leave [0, table size).
    id_churn: float = 0.0
    raw_ids: bool = False  # ids written as raw int64 values (hashed, large and sparse) for dynamic id tables

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
        if not 0.0 <= self.id_churn <= 1.0:
            raise bad("id_churn", "must lie in [0, 1] (the share of ids replaced per day)")
        if self.id_churn and not self.raw_ids:
            raise bad("id_churn", "needs raw_ids = true (churned ids leave the table's id range)")
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


def raw_ids(ids: np.ndarray, keys: list[np.uint64]) -> np.ndarray:
    """ids [n, T] -> raw ids [n, T] int64 in [0, 2**62): a keyed hash per table, as a log's hashed ids look."""
    return np.stack([(keyed(k, ids[:, f]) >> np.uint64(2)).astype(np.int64) for f, k in enumerate(keys)], axis=1)


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
    label_key = scalar_key(cfg.seed, DATA_STREAM, LABEL)
    specs = [SparseFeatureSpec(f"C{f + 1}", RAW_ID_RANGE if cfg.raw_ids else n) for f, n in enumerate(model.sizes)]
    raw_keys = [scalar_key(cfg.seed, RAW_ID, f) for f in range(len(model.sizes))]
    extras = {"probability": "float32", "vertical": "int16", "timestamp": "int64", "example_id": "int64"}
    dense_names = [f"I{j + 1}" for j in range(cfg.num_dense)]
    clicks = 0
    with (
        PreparedWriter(out_dir, dense_names, specs, extras, overwrite=overwrite, raw_ids=cfg.raw_ids) as writer,
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
                p = np.clip(sigmoid(model.logit_of_rows(rows)), 1e-7, 1.0 - 1e-7).astype(np.float32)
                for k, v in (
                    ("labels", (uniform(keyed(label_key, rows.index)) < p).astype(np.float32)),
                    ("dense", rows.dense),
                    ("sparse", raw_ids(rows.ids, raw_keys) if cfg.raw_ids else rows.ids.astype(np.int32)),
                    ("probability", p),
                    ("vertical", rows.vertical.astype(np.int16)),
                    ("timestamp", (rows.index * cfg.num_days) // cfg.rows),
                    ("example_id", rows.index),
                ):
                    cols[k].append(v)
            chunk: dict[str, Any] = {k: np.concatenate(v) for k, v in cols.items()}
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


__all__ = ["CRITEO_KAGGLE_TABLE_SIZES", "SynthConfig", "generate"]
