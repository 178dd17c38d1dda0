"""Hot swap: the model being served, and the task that switches it to a newer exported version.

``recstack export`` writes each version as ``ROOT/<version>/`` (an increasing integer) and renames it into place
only when it is complete, so a version directory with a manifest is whole. The watcher polls ``--watch DIR``
for a version newer than the one served, loads it in a thread (``ServingModel.load`` verifies every checksum)
and, when that succeeds, makes it the current model: requests encoded from then on use it, the ones already
queued finish on the old one (see ``batching``). A version that fails to load is refused once (logged, counted
in ``recstack_model_refused_total``) and the old model keeps serving; a later, newer version is tried again.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from recstack.serving.artifact import list_versions
from recstack.serving.metrics import ServerMetrics
from recstack.serving.model import ServingModel

log = logging.getLogger("uvicorn.error")  # configured by uvicorn in every worker process


class ModelHolder:
    """The current model (None until the first one loads), its version and the version loads it refused."""

    def __init__(self, metrics: ServerMetrics, device: str) -> None:
        self.metrics = metrics
        self.device = device
        self.current: ServingModel | None = None
        self.refused: set[int] = set()

    @property
    def version(self) -> int | None:
        return None if self.current is None else int(self.current.version)

    def set(self, model: ServingModel) -> None:
        old = self.version
        self.current = model  # one reference assignment: a request reads either the old model or the new one
        self.metrics.version.set(int(model.version))
        if old is not None:
            self.metrics.swaps.inc()
            log.info("recstack serve: switched from model version %s to %s", old, model.version)

    async def load(self, path: Path) -> bool:
        """Load ``path`` in a thread and serve it; on failure log, count, keep the old model -> whether it loaded."""
        try:
            model = await asyncio.to_thread(ServingModel.load, path, self.device)
        except Exception as e:  # ArtifactError (checksum, truncation), or anything else a broken artifact causes
            self.metrics.refused.inc()
            log.error("recstack serve: refused model %s: %s: %s (still serving version %s)", path,
                      type(e).__name__, e, self.version)
            return False
        self.set(model)
        return True

    async def watch(self, root: Path, interval_s: float) -> None:
        """Poll ``root`` every ``interval_s`` seconds and switch to each newer version that loads (runs until
        cancelled)."""
        while True:
            versions = list_versions(root)
            if versions:
                version, current = versions[-1], self.version
                if (current is None or version > current) and version not in self.refused:
                    if not await self.load(root / str(version)):
                        self.refused.add(version)
            await asyncio.sleep(interval_s)
