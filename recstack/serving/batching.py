"""Adaptive batching: a request that arrives alone is scored at once; requests that arrive together,
or while the model is busy, share its next call, and each gets its own slice back.

Every request is validated and encoded on its own before it reaches the batcher (so a bad request
fails alone and never joins a batch). Its handler then queues it, and the batcher decides one turn
of the event loop later, once every request whose bytes arrived in the same turn has been read and
queued too (under load the loop reads many connections in one turn, and their handlers run one
after the other without waiting for anything: deciding at once, each would look alone):

* **alone** (one request queued, the model idle, no other request being read or encoded): the model
  runs right away in the event loop's own thread. No timer, no thread hand-off: the cost of a lone
  request is the model call and one turn of the loop.
* **under load**: whenever the model is idle and more is queued, everything queued (up to
  ``max_batch`` rows) goes to the model thread as one call (torch releases the GIL, so the event
  loop keeps reading and encoding requests meanwhile; those queue up and form the next call as soon
  as this one returns). The batch size thus follows the load with no waiting: one request at a time
  when requests are sparse, large batches when they pile up.
* ``max_wait_us`` > 0 (off by default) lets a batch wait up to that long for requests that have been
  received but are still being read or encoded; it never delays a request that is alone.

A batch holds requests encoded by one model only: after a hot swap the requests already encoded by
the old version are still scored by it, so the switch falls between batches and no request sees two
versions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from recstack.serving.metrics import ServerMetrics
from recstack.serving.model import EncodedBatch, ServingModel

Scores = tuple[np.ndarray, np.ndarray]  # (logits [rows], probabilities [rows]) float32


@dataclass
class _Pending:
    model: ServingModel
    batch: EncodedBatch
    rows: int
    future: asyncio.Future  # -> Scores


def _score(model: ServingModel, batches: list[EncodedBatch]) -> Scores:
    """One model call on the joined batches -> (logits [B], probabilities [B])."""
    logits = model.score(EncodedBatch.concat(batches))  # float32 [B] on the CPU
    return logits.numpy(), torch.sigmoid(logits).numpy()


def _fail(p: _Pending, error: BaseException) -> None:
    if not p.future.done():  # not cancelled meanwhile
        p.future.set_exception(error)


class Batcher:
    """Scores encoded requests, alone or batched (see the module docstring). Used from one event
    loop; ``await stop()`` at shutdown (after the server has answered its in-flight requests)."""

    def __init__(self, max_batch: int, max_wait_us: int, metrics: ServerMetrics) -> None:
        self.max_batch = max_batch
        self.max_wait = max_wait_us / 1e6
        self.metrics = metrics
        self._queue: deque[_Pending] = deque()
        self._queued_rows = 0
        self._busy = False  # a model call is running (inline or in the model thread)
        self._arriving = 0  # requests received and still being read or encoded
        self._timer: asyncio.TimerHandle | None = None
        self._turn: asyncio.Handle | None = None  # the decision scheduled for the loop's next turn
        # One thread: one batch at a time (its torch threads parallelise inside a call).
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="recstack-model")

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Wrap the reading and encoding of a request: while it lasts, another request is not alone
        (and, with ``max_wait_us``, a batch may wait for this one)."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
            if self._timer is not None and not self._arriving:
                self._kick()

    async def score(self, model: ServingModel, batch: EncodedBatch, rows: int) -> Scores:
        """One encoded request [rows] -> its (logits [rows], probabilities [rows])."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append(_Pending(model, batch, rows, future))
        self._queued_rows += rows
        if self._turn is None and not self._busy:
            # Decide next turn: the handlers of requests that arrived with this one queue theirs first.
            self._turn = loop.call_soon(self._next_turn)
        return await future

    def _next_turn(self) -> None:
        self._turn = None
        if self._busy or not self._queue:
            return
        if len(self._queue) == 1 and not self._arriving:  # alone: here and now, no thread hand-off
            p = self._queue.popleft()
            self._queued_rows -= p.rows
            self._busy = True
            try:
                self._deliver([p], _score(p.model, [p.batch]))
            except Exception as e:
                _fail(p, e)
            finally:
                self._busy = False
            return
        self._kick()

    def _kick(self) -> None:
        """Start a model call on what is queued, if the model is idle (or arm the ``max_wait_us``
        timer)."""
        if self._busy or not self._queue:
            return
        if self.max_wait and self._arriving and self._queued_rows < self.max_batch:
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.max_wait, self._on_timer)
            return
        self._dispatch()

    def _on_timer(self) -> None:
        self._timer = None
        if not self._busy and self._queue:
            self._dispatch()

    def _dispatch(self) -> None:
        """Queued requests of one model, up to ``max_batch`` rows (a larger request alone) -> one
        call in the model thread; its answer comes back as a callback in the event loop."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        first = self._queue.popleft()
        group, rows = [first], first.rows
        while (
            self._queue
            and self._queue[0].model is first.model
            and rows + self._queue[0].rows <= self.max_batch
        ):
            p = self._queue.popleft()
            group.append(p)
            rows += p.rows
        self._queued_rows -= rows
        self._busy = True
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._executor, _score, first.model, [p.batch for p in group])
        call.add_done_callback(lambda f: self._done(group, f))

    def _done(self, group: list[_Pending], call: asyncio.Future) -> None:
        self._busy = False
        error = call.exception() if not call.cancelled() else asyncio.CancelledError()
        if error is None:
            self._deliver(group, call.result())
        elif (
            len(group) > 1
        ):  # isolate the request that failed: each one alone, so the others still succeed
            self._busy = True
            asyncio.get_running_loop().create_task(self._one_by_one(group))
            return
        else:
            _fail(group[0], error)
        self._kick()

    def _deliver(self, group: list[_Pending], scores: Scores) -> None:
        """One model call's (logits [B], probabilities [B]) -> each request of ``group`` its own rows."""
        logits, prob = scores
        self.metrics.observe_batch(len(logits), len(group))
        start = 0
        for p in group:
            if not p.future.done():  # not cancelled meanwhile
                p.future.set_result((logits[start : start + p.rows], prob[start : start + p.rows]))
            start += p.rows

    async def _one_by_one(self, group: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        for p in group:
            try:
                self._deliver([p], await loop.run_in_executor(self._executor, _score, p.model, [p.batch]))
            except Exception as e:
                _fail(p, e)
        self._busy = False
        self._kick()

    async def stop(self) -> None:
        for handle in (self._timer, self._turn):
            if handle is not None:
                handle.cancel()
        while self._queue:  # nothing should be left: the server drained its requests first
            p = self._queue.popleft()
            if not p.future.done():
                p.future.set_exception(RuntimeError("the server is shutting down"))
        await asyncio.to_thread(self._executor.shutdown, wait=True)
