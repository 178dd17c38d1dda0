"""Quotient-remainder (QR) embeddings: a table of n rows as two small tables that together give every id its
own vector (Shi et al., "Compositional Embeddings Using Complementary Partitions", the DLRM reference's
``--qr-flag``).

Id i of a table with n > ``threshold`` rows is looked up as q = i // m in a quotient table of ceil(n / m)
rows and r = i % m in a remainder table of m rows, and the two pooled vectors are combined (``mult``:
elementwise product, ``add``: sum). No two ids share both parts, unlike hashing ids modulo a smaller table,
and the rows shrink from n to about n / m + m. As in the reference, the two bags are pooled separately and
then combined (per-sample weights apply to both).

Split as data: the split tables are ordinary ``TableConfig``s, so every collection (fused, sharded, tiered)
holds, shards, caches, checkpoints and compresses them like any other table. The quotient table keeps the
table's name and its features; the remainder table is ``<name>_rem`` and reads extra feature slots F, F+1,
... (one per split feature, in feature order), whose ids ``split`` appends after the F original features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recstack.data.batch import SparseFeatures
from recstack.embedding.collection import TableConfig

OPERATIONS = ("mult", "add")
REMAINDER_SUFFIX = "_rem"


def split_rows(rows: int, collisions: int, threshold: int) -> tuple[int, int] | None:
    """(quotient rows, remainder rows) of a table of ``rows`` split by m = ``collisions``, or None when it
    is not split (off, or not more than ``threshold`` rows, or not more than m)."""
    if collisions < 2 or rows <= max(threshold, collisions):
        return None
    return -(-rows // collisions), collisions


@dataclass(frozen=True)
class QRSplit:
    """How F features over ``raw_tables`` become F + K features over ``tables`` (K = split features).

    split_features: the K features whose tables are split, in remainder-slot order.
    divisors: [F] int64, m for split features and 1 for the others (i // 1 = i).
    partner: [F] int64, each feature's remainder slot among [0, K), K (the operation's identity) if not split.
    """

    raw_tables: tuple[TableConfig, ...]
    tables: tuple[TableConfig, ...]
    num_features: int
    split_features: tuple[int, ...]
    m: int
    operation: str
    divisors: torch.Tensor
    partner: torch.Tensor

    @staticmethod
    def build(tables: list[TableConfig], collisions: int, threshold: int, operation: str) -> QRSplit | None:
        """Split every table with more than ``threshold`` rows (and more than ``collisions``) by m =
        ``collisions``; None when ``collisions`` is 0 or no table qualifies."""
        if operation not in OPERATIONS:
            raise ValueError(f"model.qr_operation: {operation!r} is not one of {', '.join(OPERATIONS)}")
        if collisions < 0 or threshold < 0:
            raise ValueError(f"model.qr_collisions and model.qr_threshold: must be >= 0, got {collisions}, {threshold}")
        if collisions < 2:  # 0: off; 1 would keep the whole table and add a one-row remainder
            return None
        num_features = sum(len(t.features) for t in tables)
        split = {t.name for t in tables if split_rows(t.num_embeddings, collisions, threshold)}
        if not split:
            return None
        taken = {t.name for t in tables}
        split_features = tuple(sorted(f for t in tables if t.name in split for f in t.features))
        slot = {f: num_features + k for k, f in enumerate(split_features)}
        out = []
        remainders = []
        for t in tables:
            if t.name not in split:
                out.append(t)
                continue
            rem_name = t.name + REMAINDER_SUFFIX
            if rem_name in taken:
                raise ValueError(f"model.qr_collisions: table {t.name!r} cannot be split, a table {rem_name!r} exists")
            q_rows, r_rows = split_rows(t.num_embeddings, collisions, threshold)  # type: ignore[misc]
            out.append(TableConfig(t.name, q_rows, t.embedding_dim, t.features, init_bound=t.init_bound))
            remainders.append(TableConfig(rem_name, r_rows, t.embedding_dim, tuple(slot[f] for f in t.features),
                                          init_bound=t.init_bound))
        divisors = torch.ones(num_features, dtype=torch.int64)
        divisors[list(split_features)] = collisions
        partner = torch.full((num_features,), len(split_features), dtype=torch.int64)
        partner[list(split_features)] = torch.arange(len(split_features))
        return QRSplit(tuple(tables), tuple(out + remainders), num_features, split_features, collisions, operation,
                       divisors, partner)

    @property
    def num_split_features(self) -> int:
        """F + K: the features the collection of split tables reads."""
        return self.num_features + len(self.split_features)

    def split(self, sparse: SparseFeatures) -> SparseFeatures:
        """F features of ids (as the data has them) -> F + K features: quotients in place, remainders of the
        split features appended (same bag lengths). Already split features pass through unchanged."""
        if sparse.num_features == self.num_split_features:
            return sparse
        if sparse.num_features != self.num_features:
            raise ValueError(f"got {sparse.num_features} sparse features, the QR split expects {self.num_features}")
        bounds = sparse.feature_bounds  # [F + 1]
        div = self.divisors.to(sparse.ids.device).repeat_interleave(bounds.diff(), output_size=sparse.ids.numel())
        starts = bounds.tolist()
        rem = [sparse.ids[starts[f] : starts[f + 1]] % self.m for f in self.split_features]
        ids = torch.cat([torch.div(sparse.ids, div, rounding_mode="floor"), *rem])  # quotients, then remainders
        lengths = sparse.lengths.view(self.num_features, sparse.batch_size)  # [F, B]
        new_lengths = torch.cat([lengths, lengths[list(self.split_features)]]).reshape(-1)
        offsets = torch.cat([new_lengths.new_zeros(1), new_lengths.cumsum(0)])
        weights = None
        if sparse.weights is not None:
            w = sparse.weights
            weights = torch.cat([w, *(w[starts[f] : starts[f + 1]] for f in self.split_features)])
        return SparseFeatures(ids, offsets, self.num_split_features, weights)

    def combine(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled embeddings of the split features [B, F + K, D] -> [B, F, D]: each split feature's quotient
        bag combined with its remainder bag, the others as they are."""
        f = self.num_features
        quotient, remainder = pooled[:, :f], pooled[:, f:]  # [B, F, D], [B, K, D]
        b, _, d = pooled.shape
        # Features not split take the operation's identity (a ones / zeros row in slot K).
        identity = (torch.ones if self.operation == "mult" else torch.zeros)(b, 1, d, dtype=pooled.dtype,
                                                                            device=pooled.device)
        index = self.partner.to(pooled.device)
        partner = torch.index_select(torch.cat([remainder, identity], dim=1), 1, index)  # [B, F, D]
        return quotient * partner if self.operation == "mult" else quotient + partner

    def rows(self) -> tuple[int, int]:
        """(rows before, rows after) over all tables."""
        return sum(t.num_embeddings for t in self.raw_tables), sum(t.num_embeddings for t in self.tables)


__all__ = ["OPERATIONS", "QRSplit", "REMAINDER_SUFFIX", "split_rows"]
