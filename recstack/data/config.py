"""``[data]``: where the training and evaluation rows come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    """Where training and evaluation rows come from.

    ``train``/``eval`` are prepared directories (``recstack data prepare`` / ``recstack data synth``). When
    ``eval`` is empty, the last ``eval_fraction`` of the training rows (the latest in time) are held out.
    A non-empty ``[data.synth]`` table generates a synthetic set into ``<output_dir>/data`` (or ``train``
    when given) before training, with those generator options (see ``recstack.data.synth.SynthConfig``).
    """

    train: str = ""
    eval: str = ""
    eval_fraction: float = 0.1
    synth: dict[str, Any] = field(default_factory=dict)
