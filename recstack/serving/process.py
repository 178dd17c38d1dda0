"""The processes of ``recstack serve``: one uvicorn server that drains before it stops, and, under
``--workers N``, a pre-fork supervisor.

Drain (``DrainingServer``): the first SIGTERM / SIGINT does not stop the server. It turns
``/readyz`` (and ``/v2/health/ready``) to 503, so that a load balancer stops sending, marks every
answer ``Connection: close`` (a keep-alive client opens a new connection for its next request
instead of sending it on one about to close), and keeps serving. Once no scoring request has been in
flight for ``DRAIN_QUIET_S`` (so that a keep-alive client sending back to back has had its
``Connection: close``; checked every 0.1 s), or ``drain_timeout_s`` has passed, uvicorn's shutdown
runs: the listening socket closes, the requests still in flight are answered (bounded by what is
left of the drain timeout), the app stops its tasks. A second SIGINT forces the exit.

Workers (``run_workers``): the parent loads the model once, opens the listening socket, and forks N
workers that inherit both: the tables (read into memory, ``artifact.read_array``) and the imported
runtime are shared copy-on-write instead of being loaded N times. The parent forwards SIGTERM /
SIGINT to the workers, restarts a worker that dies unexpectedly, and exits 0 when all of them
stopped cleanly.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn

log = logging.getLogger("uvicorn.error")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DRAIN_QUIET_S = 0.5


class Drainable(Protocol):
    """What the server needs of the app to drain it."""

    def start_drain(self) -> None: ...

    @property
    def active(self) -> int: ...  # scoring requests in flight

    @property
    def last_active(
        self,
    ) -> float: ...  # time.monotonic() when a scoring request last began or ended


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains on the first SIGTERM / SIGINT (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, app: Drainable, drain_timeout_s: float) -> None:
        config.timeout_graceful_shutdown = max(1, int(drain_timeout_s))
        super().__init__(config)
        self.app_state, self.drain_timeout_s = app, drain_timeout_s
        self._drain_since: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_since is None and not self.should_exit:
            self._drain_since = time.monotonic()
            self.app_state.start_drain()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_since is not None and not self.should_exit:
            waited = time.monotonic() - self._drain_since
            quiet = time.monotonic() - self.app_state.last_active >= DRAIN_QUIET_S
            if (self.app_state.active == 0 and quiet) or waited >= self.drain_timeout_s:
                left = max(0.0, self.drain_timeout_s - waited)
                self.config.timeout_graceful_shutdown = max(1, int(left + 0.999))
                self.should_exit = True
        return await super().on_tick(counter)


def run_server(server: DrainingServer, sockets: list[socket.socket] | None = None) -> None:
    """Run until drained and stopped. uvicorn re-raises the signal that stopped it once it is done:
    handlers that ignore it make the process end with 0 after the graceful shutdown instead of dying
    of the signal."""
    for sig in _SIGNALS:
        signal.signal(sig, lambda signum, frame: None)
    server.run(sockets=sockets)


def run_workers(workers: int, sock: socket.socket, start: Callable[[], None]) -> int:
    """Fork ``workers`` processes that each call ``start()`` (which serves on ``sock`` until
    drained) -> 0 when every worker exited 0, else 1. Runs in the parent, which has loaded the model
    already."""
    children: dict[int, int] = {}  # pid -> worker index
    stopping = False
    failed = False

    def fork(index: int) -> None:
        signal.pthread_sigmask(
            signal.SIG_BLOCK, _SIGNALS
        )  # no signal between fork and the child's handlers
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for sig in _SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
                start()
            except BaseException:  # noqa: BLE001 (the worker reports and exits; the parent restarts it)
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = index
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in _SIGNALS:
        signal.signal(sig, forward)
    for i in range(workers):
        fork(i)
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        index = children.pop(pid, None)
        if index is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed = True
            if not stopping:  # died on its own: a fresh fork of the loaded model takes its place
                log.error(
                    "recstack serve: worker %d (pid %d) exited %d; restarting it", index, pid, code
                )
                fork(index)
                failed = False
    sock.close()
    return 1 if failed else 0
