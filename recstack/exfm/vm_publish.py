"""A vertical model's window stream as a ``recstack.training.hooks.TrainingRun``, so that a ``PartitionHook``
(the serving ``Publisher``: full artifact, then deltas) follows a VM while it trains, window by window.

What the hook sees: ``model`` is the VM's serving head (its body, a ``DLRM``, with the dynamic id maps it scores
raw ids with), ``cfg`` a root ``Config`` holding the VM's ``[model]`` / ``[optim]`` and the stream as
``data.train``, ``step`` the windows trained on so far (the stream's own position: a resumed VM counts on from its
checkpoint), ``logger`` the ``publish`` records (kept in ``records`` and written to ``<out>/publish/metrics.jsonl``).

The hooks run at the window's end before its checkpoint (``StreamTrainer``'s ``on_window_end``): a VM killed in
between publishes that window again when it resumes (its new ``Publisher`` starts a chain with a full version), it
never skips one. ``result.json``'s ``published`` lists the versions of the process that finished the task; every
process's are in ``publish/metrics.jsonl``.

exfm does not import serving (``docs/architecture.md``): the hook is built in the task's process by a
``PublisherFactory`` that the caller hands to ``ExperimentRunner`` (``recstack exfm run`` hands it the
``Publisher``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from recstack.config import Config
from recstack.data.config import DataConfig
from recstack.data.format import DataDescription
from recstack.exfm.config import NetSpec
from recstack.models.dlrm import DLRM
from recstack.training.hooks import PartitionHook, PartitionInfo
from recstack.training.logger import MetricsLogger

# (model root, seconds between versions (0: every window), table width such as "fp32") -> the hook
PublisherFactory = Callable[[str, float, str], PartitionHook]


class PublishLog:
    """The ``publish`` records of a VM's hooks: kept in ``records`` and appended to ``<dir>/metrics.jsonl``."""

    def __init__(self, log_dir: Path) -> None:
        self.records: list[dict[str, Any]] = []
        self._logger = MetricsLogger(log_dir, tensorboard=False)

    def log(self, step: int, kind: str, values: Mapping[str, Any]) -> None:
        self.records.append({"window_step": step, "kind": kind, **values})
        self._logger.log(step, kind, values)

    def close(self) -> None:
        self._logger.close()


class VMRun:
    """One VM stream seen by its hooks (module docstring); ``windows`` is set by ``WindowHooks``."""

    world = 1

    def __init__(self, body: DLRM, spec: NetSpec, ds: DataDescription, log_dir: Path, windows: int) -> None:
        """``ds``: what the VM's data says of its features and transforms (``WindowSource.describe``)."""
        self.model = body
        self.cfg = Config(data=DataConfig(train=str(ds.path)), model=spec.model, optim=spec.optim)
        self.ds = ds
        self.windows = windows
        self.log = PublishLog(log_dir)

    @property
    def step(self) -> int:
        return self.windows

    @property
    def logger(self) -> PublishLog:
        return self.log

    def data_description(self) -> DataDescription:
        return self.ds


class WindowHooks:
    """Calls ``hooks`` at each window end (``StreamTrainer(on_window_end=...)``) as at a partition's end: the
    partition is the window, ``arrived_at`` the time the VM started on it (its rows and FM labels were there),
    ``rows`` the rows it trained on."""

    def __init__(self, run: VMRun, hooks: Sequence[PartitionHook], rows: Callable[[int], int]) -> None:
        self.run, self.hooks, self.rows = run, list(hooks), rows
        self.started: dict[int, float] = {}

    def window_started(self, window: int) -> None:
        self.started.setdefault(window, time.time())

    def window_end(self, window: int) -> None:
        self.run.windows = window + 1
        info = PartitionInfo(f"window-{window}", window, self.started.pop(window, time.time()), self.rows(window),
                             window + 1)
        for hook in self.hooks:
            hook.after_partition(self.run, info)

    def close(self) -> list[dict[str, Any]]:
        """The hooks' ``close`` (a last version unless the newest state is out) -> the ``publish`` records."""
        try:
            for hook in self.hooks:
                hook.close(self.run)
        finally:
            self.run.log.close()
        return self.run.log.records
