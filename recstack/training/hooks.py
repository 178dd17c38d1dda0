"""The seam a stream run offers at every partition boundary: a ``PartitionHook`` is called after each partition
was evaluated, trained on and checkpointed (a publisher exports the model there), and once at the end.

Register one with ``StreamTrainer.add_hook(hook)`` (``recstack.training.stream``) before ``train()``. A hook sees
the run through ``TrainingRun``: the ``Trainer`` is one, an ExFM vertical model's window stream another
(``recstack.exfm.vm_publish``), so a hook such as the serving ``Publisher`` follows either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from recstack.config import Config
    from recstack.data.format import DataDescription
    from recstack.models.dlrm import DLRM


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


class RecordLog(Protocol):
    def log(self, step: int, kind: str, values: Mapping[str, Any]) -> None:
        """Record ``values`` of one ``kind`` at ``step`` (``MetricsLogger.log``)."""
        ...


class TrainingRun(Protocol):
    """What a hook reads of the run it follows: ``model`` (the DLRM it would serve, tables whole), ``cfg`` (the
    root Config of that model: its ``[model]`` and ``[data]`` at least), ``world`` (processes), ``step`` (the
    run's progress counter), ``logger`` and the data the model trains on."""

    model: DLRM
    cfg: Config
    world: int

    @property
    def step(self) -> int: ...

    @property
    def logger(self) -> RecordLog: ...

    def data_description(self) -> DataDescription: ...


class PartitionHook(Protocol):
    def after_partition(self, trainer: TrainingRun, info: PartitionInfo) -> None:
        """After the partition's checkpoint; the model holds the weights trained on it. Errors stop the run."""
        ...

    def close(self, trainer: TrainingRun) -> None:
        """Once, when the stream ended (idle), after the last partition's hooks."""
        ...
