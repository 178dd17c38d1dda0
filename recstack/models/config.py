"""``[model]``: the DLRM architecture."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """DLRM architecture. ``bottom_mlp`` ends in ``embedding_dim`` for the dot interaction; ``top_mlp``
    ends in 1 (a logit). ``max_table_size`` caps every table's rows (0 = no cap); ids are taken modulo it.
    ``qr_collisions`` m >= 2 turns every table of more than ``qr_threshold`` rows into quotient-remainder
    tables (ceil(n / m) + m rows, combined by ``qr_operation``; ``recstack.embedding.qr``); 0 = off."""

    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    interaction: str = "dot"  # dot | cat | dcn
    interaction_itself: bool = False
    dcn_layers: int = 3
    dcn_low_rank: int = 512
    max_table_size: int = 0
    qr_collisions: int = 0
    qr_threshold: int = 200
    qr_operation: str = "mult"  # mult | add
