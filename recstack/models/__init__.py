"""Models built on an EmbeddingCollection; single-device, no distributed code."""

from recstack.models.dlrm import DLRM, mlp

__all__ = ["DLRM", "mlp"]
