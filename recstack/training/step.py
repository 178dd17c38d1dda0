"""What every training loop shares (the trainer's step moves here with the trainer's restructuring)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``train.device``: auto (CUDA when there is one) | cpu | cuda | cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
