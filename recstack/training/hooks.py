"""The seam a stream run offers at every partition boundary: a ``PartitionHook`` is called after each partition
was evaluated, trained on and checkpointed (a publisher exports the model there), and once at the end.

Register one with ``StreamTrainer.add_hook(hook)`` (``recstack.training.stream``) before ``train()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from recstack.training.trainer import Trainer


@dataclass(frozen=True)
class PartitionInfo:
    """The partition just consumed. ``name``: its stable name (the stream position); ``index``: 0-based;
    ``arrived_at``: ``time.time()`` when it appeared under its final name; ``rows``: rows trained on; ``step``:
    the run's step after training on it (the step of the checkpoint that records it)."""

    name: str
    index: int
    arrived_at: float
    rows: int
    step: int


class PartitionHook(Protocol):
    def after_partition(self, trainer: Trainer, info: PartitionInfo) -> None:
        """After the partition's checkpoint; the model holds the weights trained on it. Errors stop the run."""
        ...

    def close(self, trainer: Trainer) -> None:
        """Once, when the stream ended (idle), after the last partition's hooks."""
        ...
