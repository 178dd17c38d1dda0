"""Dynamic batching: requests that arrive together share one model call and each gets its own slice back.

Every request is validated and encoded on its own before it is queued (so a bad request fails alone and never
reaches a batch). The batching task takes the first queued request, then keeps collecting until the batch holds
``max_batch`` rows or ``max_wait_us`` has passed since it started, and runs the model once on the joined batch
in a worker thread (torch releases the GIL, so the event loop keeps accepting requests meanwhile; the requests
that arrive while the model runs form the next batch). A batch holds requests encoded by one model only: after a
hot swap the requests already encoded by the old version are still scored by it, so the switch falls between
batches and no request sees two versions.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from recstack.serving.metrics import ServerMetrics
from recstack.serving.model import EncodedBatch, ServingModel


@dataclass
class _Pending:
    model: ServingModel
    batch: EncodedBatch
    rows: int
    future: asyncio.Future  # -> (logits [rows], probabilities [rows]) as float32 arrays


def _score(model: ServingModel, batches: list[EncodedBatch]) -> tuple[np.ndarray, np.ndarray]:
    """In the model thread: one model call on the joined batches -> (logits [B], probabilities [B])."""
    logits = model.score(EncodedBatch.concat(batches))  # float32 [B] on the CPU
    return logits.numpy(), torch.sigmoid(logits).numpy()


class Batcher:
    """Collects encoded requests into model calls. ``start()`` inside the event loop, ``await stop()`` at
    shutdown (after the server has answered its in-flight requests)."""

    def __init__(self, max_batch: int, max_wait_us: int, metrics: ServerMetrics) -> None:
        self.max_batch = max_batch
        self.max_wait = max_wait_us / 1e6
        self.metrics = metrics
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        # One thread: the model runs one batch at a time (its own torch threads parallelise inside a call).
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="recstack-model")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="recstack-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while not self._queue.empty():  # nothing should be left: the server drained its requests first
            p = self._queue.get_nowait()
            if not p.future.done():
                p.future.set_exception(RuntimeError("the server is shutting down"))
        self._executor.shutdown(wait=True)

    async def score(self, model: ServingModel, batch: EncodedBatch, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """One encoded request [rows] -> its (logits [rows], probabilities [rows]), scored in some batch."""
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(model, batch, rows, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        carry: _Pending | None = None  # a request that did not fit the previous batch: it opens the next one
        while True:
            first = carry if carry is not None else await self._queue.get()
            carry = None
            group, rows = [first], first.rows
            deadline = loop.time() + self.max_wait
            while rows < self.max_batch:
                try:
                    p = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        p = await asyncio.wait_for(self._queue.get(), left)
                    except TimeoutError:
                        break
                if p.model is not first.model or rows + p.rows > self.max_batch:
                    carry = p
                    break
                group.append(p)
                rows += p.rows
            try:
                await self._call(group)
            except Exception as e:  # never let the batching task die: later requests would wait forever
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(e)

    async def _call(self, group: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        try:
            logits, prob = await loop.run_in_executor(self._executor, _score, group[0].model,
                                                      [p.batch for p in group])
        except Exception as e:
            if len(group) > 1:  # isolate the request that failed: each one alone, so the others still succeed
                for p in group:
                    await self._call([p])
                return
            if not group[0].future.done():
                group[0].future.set_exception(e)
            return
        self.metrics.observe_batch(len(logits), len(group))
        start = 0
        for p in group:
            if not p.future.done():  # not cancelled meanwhile
                p.future.set_result((logits[start:start + p.rows], prob[start:start + p.rows]))
            start += p.rows
