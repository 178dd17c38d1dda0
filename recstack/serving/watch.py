"""Hot swap: the model being served, and the task that switches it to a newer exported version.

``recstack export`` writes each version as ``ROOT/<version>/`` (an increasing integer) and renames it into place
only when it is complete, so a version directory with a manifest is whole. The watcher polls ``--watch DIR``
for a version newer than the one served, loads it in a thread (``ServingModel.load`` verifies every checksum)
and, when that succeeds, makes it the current model: requests encoded from then on use it, the ones already
queued finish on the old one (see ``batching``). A version that fails to load is refused once (logged, counted
in ``recstack_model_refused_total``) and never tried again, and the old model keeps serving; every other newer
version is still tried (the newest loadable one wins), so a refused directory blocks nothing. A directory whose
number is not its manifest's version (a copied ``models/5`` as ``models/6``) is refused the same way: serving
it would report the wrong version (and, taken for newer than it is, it would be reloaded at every poll).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from recstack.serving.artifact import MANIFEST, ArtifactError, list_versions
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
            log.info("recstack serve [pid %d]: switched from model version %s to version %s (%s)", os.getpid(),
                     old, model.version, model.path.resolve())
        else:
            log.info("recstack serve [pid %d]: serving model version %s (%s)", os.getpid(), model.version,
                     model.path.resolve())

    async def load(self, path: Path, version: int | None = None) -> bool:
        """Load ``path`` in a thread and serve it; on failure log, count, keep the old model -> whether it loaded.
        ``version``: the version its directory name says (its manifest must say the same)."""
        try:
            model = await asyncio.to_thread(ServingModel.load, path, self.device)
            if version is not None and model.version != version:
                raise ArtifactError(f"{path / MANIFEST}: version {model.version}, but the directory says "
                                    f"{version} (a copied version directory?)")
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
            for version in reversed(list_versions(root)):  # newest first, down to the one served
                if self.current is not None and version <= self.version:  # type: ignore[operator]
                    break
                if version in self.refused:
                    continue
                if await self.load(root / str(version), version):
                    break
                self.refused.add(version)
            await asyncio.sleep(interval_s)
