"""``[model]``: the DLRM architecture."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recstack.errors import ConfigError


@dataclass
class ModelConfig:
    """DLRM architecture. ``bottom_mlp`` ends in ``embedding_dim`` for the dot interaction; ``top_mlp``
    ends in 1 (a logit). ``max_table_size`` caps every table's rows (0 = no cap); ids are taken modulo it.
    ``qr_collisions`` m >= 2 turns every table of more than ``qr_threshold`` rows into quotient-remainder
    tables (ceil(n / m) + m rows, combined by ``qr_operation``; ``recstack.embedding.qr``); 0 = off.

    Regularisation of both MLPs' hidden layers (every layer but the last of each MLP): ``mlp_norm`` normalises
    each hidden layer's output before its ReLU (``batch``: BatchNorm1d, ``layer``: LayerNorm), ``dropout``
    zeroes each hidden activation with that probability in training (after the ReLU; identity in eval).
    Both off by default, and then the MLPs are exactly today's (the fused training step, same numerics)."""

    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    interaction: Literal["dot", "cat", "dcn"] = "dot"
    interaction_itself: bool = False
    dcn_layers: int = 3
    dcn_low_rank: int = 512
    max_table_size: int = 0
    qr_collisions: int = 0
    qr_threshold: int = 200
    qr_operation: Literal["mult", "add"] = "mult"
    dropout: float = 0.0
    mlp_norm: Literal["none", "batch", "layer"] = "none"

    def validate(self) -> None:
        """Ranges and widths; each ConfigError names the field. The widths the interaction needs of the bottom
        MLP depend on the data (a data set without dense features has no bottom MLP): ``check_dense``."""
        if self.embedding_dim <= 0:
            raise ConfigError("model.embedding_dim: must be positive")
        for name, low in (("dcn_layers", 0), ("dcn_low_rank", 1), ("max_table_size", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"model.{name}: must be >= {low}, got {getattr(self, name)}")
        for name, widths in (("bottom_mlp", self.bottom_mlp), ("top_mlp", self.top_mlp)):
            if any(w < 1 for w in widths):
                raise ConfigError(f"model.{name}: every width must be >= 1, got {widths}")
        if self.qr_collisions < 0 or self.qr_collisions == 1 or self.qr_threshold < 0:
            raise ConfigError(f"model.qr_collisions / model.qr_threshold: need qr_collisions 0 (off) or >= 2 and "
                              f"qr_threshold >= 0, got {self.qr_collisions} / {self.qr_threshold}")
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ConfigError(f"model.top_mlp: must end in 1 (a logit), got {self.top_mlp}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")

    def check_dense(self, num_dense: int) -> None:
        """The bottom MLP against the data's ``num_dense`` dense features, checked when the model is built (only
        then is the data known): with dense features the dot interaction needs it to end in ``embedding_dim``;
        without them there is no bottom MLP and ``bottom_mlp`` is not used."""
        if num_dense and self.interaction == "dot" and self.bottom_mlp and self.bottom_mlp[-1] != self.embedding_dim:
            raise ConfigError(f"model.bottom_mlp: the dot interaction needs it to end in "
                              f"embedding_dim={self.embedding_dim}, got {self.bottom_mlp}")
