"""What a training loop tells the components that follow it: a partition of a stream was trained on.

A stream loop calls every ``PartitionHook`` after each partition it trained on (``after_partition``) and once at
the end (``close``); a fixed-set loop may call them at its own boundaries. The hooks own their cadence (a
publisher decides itself whether enough time passed to publish again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from recstack.training.trainer import Trainer


@dataclass(frozen=True)
class PartitionInfo:
    """One partition the trainer has just trained on.

    name: its file name; index: its position in the stream (0, 1, ...); arrived_at: ``time.time()`` when it
    appeared under its final name; rows: its rows; step: the trainer's step after training on it."""

    name: str
    index: int
    arrived_at: float
    rows: int
    step: int


class PartitionHook(Protocol):
    def after_partition(self, trainer: Trainer, info: PartitionInfo) -> None: ...

    def close(self, trainer: Trainer) -> None: ...
