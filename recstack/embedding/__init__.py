"""Embedding tables: the collection interface, its single-device fused implementation, sparse optimizers."""

from recstack.embedding.collection import EmbeddingCollection, TableConfig
from recstack.embedding.fused import FusedEmbeddingBagCollection
from recstack.embedding.sparse_optim import SparseOptimizer, SparseOptimizerConfig

__all__ = [
    "EmbeddingCollection",
    "FusedEmbeddingBagCollection",
    "SparseOptimizer",
    "SparseOptimizerConfig",
    "TableConfig",
]
