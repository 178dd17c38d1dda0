"""Hot swap: the model being served, and the task that switches it to a newer exported or published version.

``recstack export`` writes each version as ``ROOT/<version>/`` (an increasing integer) and renames it into place
only when it is complete, so a version directory with a manifest is whole. The watcher polls ``--watch DIR``
for versions newer than the one served, loads them in a thread (``ServingModel.load`` verifies every checksum)
and, when that succeeds, makes the result the current model: requests encoded from then on use it, the ones
already queued finish on the old one (see ``batching``).

Versions are full artifacts or deltas (``delta``, written by ``publish.Publisher``). Of the newer versions the
newest full one that loads is the starting point (older full ones are superseded); the deltas after it are then
applied in order, each on the model it was made on, the served arrays never written. A version that fails to load
(damage, a delta whose base is not the version in use) is refused once (logged, counted in
``recstack_model_refused_total``) and never tried again, and the old model keeps serving; a later full version
recovers. A directory whose number is not its manifest's version (a copied ``models/5`` as ``models/6``) is refused
the same way: serving it would report the wrong version (and, taken for newer than it is, it would be reloaded at
every poll). ``load_newest`` resolves the same chain at start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from recstack.serving.artifact import MANIFEST, ArtifactError, list_versions
from recstack.serving.compile import DenseCompiler
from recstack.serving.delta import delta_base
from recstack.serving.metrics import ServerMetrics
from recstack.serving.model import ServingModel

log = logging.getLogger("uvicorn.error")  # configured by uvicorn in every worker process
SETTLE_S = 5.0  # a version is compiled once it has been served this long without a newer one


class ModelHolder:
    """The current model (None until the first one loads), its version and the version loads it refused."""

    def __init__(self, metrics: ServerMetrics, device: str) -> None:
        self.metrics = metrics
        self.device = device
        self.current: ServingModel | None = None
        self.refused: set[int] = set()
        self.changed = asyncio.Event()  # set by every switch (what ``compile.DenseCompiler`` follows)

    @property
    def version(self) -> int | None:
        return None if self.current is None else int(self.current.version)

    def set(self, model: ServingModel) -> None:
        old = self.version
        self.current = model  # one reference assignment: a request reads either the old model or the new one
        self.metrics.version.set(int(model.version))
        self.metrics.compiled.set(int(model.compiled))
        self.changed.set()
        arrived = (model.manifest.get("freshness") or {}).get("arrived_at")
        if isinstance(arrived, int | float):  # a published version: how old its newest training data is
            self.metrics.data_arrival.set(arrived)
            self.metrics.freshness.set(max(time.time() - arrived, 0.0))
        if old is not None:
            self.metrics.swaps.inc()
            log.info("recstack serve [pid %d]: switched from model version %s to version %s (%s)", os.getpid(),
                     old, model.version, model.path.resolve())
        else:
            log.info("recstack serve [pid %d]: serving model version %s (%s)", os.getpid(), model.version,
                     model.path.resolve())

    async def load(self, path: Path, version: int | None = None) -> bool:
        """Load ``path`` in a thread (a delta on the current model) and serve it; on failure log, count, keep the
        old model -> whether it loaded. ``version``: the version its directory name says (its manifest must say
        the same)."""
        try:
            model = await asyncio.to_thread(ServingModel.load, path, self.device, True, self.current)
            if version is not None and model.version != version:
                raise ArtifactError(f"{path / MANIFEST}: version {model.version}, but the directory says "
                                    f"{version} (a copied version directory?)")
        except Exception as e:  # ArtifactError (checksum, truncation, base), or anything a broken artifact causes
            self.metrics.refused.inc()
            log.error("recstack serve: refused model %s: %s: %s (still serving version %s)", path,
                      type(e).__name__, e, self.version)
            return False
        self.set(model)
        return True

    async def poll(self, root: Path) -> None:
        """Switch to the newest state ``root`` offers: the newest full version that loads, then every delta
        after it in order."""
        served = self.version
        newer = [v for v in list_versions(root) if v not in self.refused and (served is None or v > served)]
        is_full = {v: peek_base(root / str(v)) is None for v in newer}
        start = 0
        for i in reversed(range(len(newer))):  # newest full first; a refused one leaves the older ones to try
            v = newer[i]
            if is_full[v]:
                if await self.load(root / str(v), v):
                    start = i + 1
                    break
                self.refused.add(v)
        for v in newer[start:]:
            if not is_full[v] and not await self.load(root / str(v), v):
                self.refused.add(v)

    def compiled(self, model: ServingModel) -> None:
        """``model`` now runs its compiled dense program."""
        if model is self.current:
            self.metrics.compiled.set(1)

    async def follow(self, compiler: DenseCompiler, settle_s: float = SETTLE_S) -> None:
        """Compile each version that stays served ``settle_s`` seconds without a newer one (a trainer publishing
        every few seconds keeps its versions on their graphs rather than compiling each); runs until
        cancelled."""
        while True:
            await self.changed.wait()
            self.changed.clear()
            try:  # a newer version within settle_s starts the wait again
                await asyncio.wait_for(self.changed.wait(), settle_s)
                continue
            except TimeoutError:
                pass
            model = self.current
            if model is not None and not model.compiled:
                await compiler.compile(model)

    async def watch(self, root: Path, interval_s: float) -> None:
        """Poll ``root`` every ``interval_s`` seconds and switch to each newer version that loads (runs until
        cancelled)."""
        while True:
            await self.poll(root)
            await asyncio.sleep(interval_s)


def peek_base(path: Path) -> int | None:
    """The base version of a delta directory; None for a full artifact (or an unreadable manifest, which its
    load then reports)."""
    try:
        return delta_base(json.loads((path / MANIFEST).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def load_newest(root: Path, device: str) -> ServingModel:
    """The newest version of a versions directory: its chain of deltas back to a full artifact, loaded and
    applied in order (what ``recstack serve ROOT`` starts with). Raises ArtifactError naming the version at fault."""
    versions = list_versions(root)
    chain = [versions[-1]]
    while (base := peek_base(root / str(chain[-1]))) is not None:
        if base not in versions or base >= chain[-1]:
            raise ArtifactError(f"{root / str(chain[-1]) / MANIFEST}: a delta on version {base}, which {root} "
                                "does not hold")
        chain.append(base)
    model: ServingModel | None = None
    for v in reversed(chain):
        model = ServingModel.load(root / str(v), device, base=model)
        if model.version != v:
            raise ArtifactError(f"{root / str(v) / MANIFEST}: version {model.version}, but the directory says {v} "
                                "(a copied version directory?)")
    assert model is not None
    return model
