"""Joining a job, and leaving it before joining: a rank that fails at start-up tells the others.

A rank whose own input is wrong (a typo in its config file or ``--set``, on one node only) stops
before it joins the process group. Without a word from it, the other ranks wait in the rendezvous
until ``dist.timeout_s`` runs out and die with torch's ``DistStoreError`` (a traceback that names
neither the rank nor the cause). So a rank that fails first posts its one-line error in the job's
store (:func:`report_startup_failure`), and every rank checks in there before it joins
(:func:`join_job`): a rank that finds a posted failure stops at once with a :class:`PeerFailure`
(exit 3) naming the failed rank and its error.

Keys live under the same per-attempt prefix as the process group's (``recstack/attempt_<n>``): a
failure of an earlier torchrun attempt is not read by the next.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from recstack.errors import PeerFailure

_ARRIVED = "startup/arrived"  # ranks that checked in (an add counter)
_FAILED = "startup/failed"  # the first failed rank's message
_DONE = "startup/done"  # ranks that failed, or read a failure (the store's host waits for them)
_POLL_S = 0.05
# How long a failed rank tries to reach the others (its config, dist.timeout_s too, did not load).
REPORT_TIMEOUT_S = 60.0


def job_store(timeout_s: float) -> tuple[dist.Store, bool]:
    """The store of the job this process is a rank of (torchrun's environment: ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), under this attempt's prefix -> (store, whether this
    process hosts it: rank 0 when torchrun's agent does not). Waits up to ``timeout_s`` for the
    host."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's agent hosts the store and keeps it across restarts (--max-restarts); without a
    # prefix per attempt, the restarted workers would find the dead workers' addresses for every
    # process group.
    host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=host, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"recstack/attempt_{attempt}", store), host


def join_job(store: dist.Store, world: int, timeout_s: float) -> None:
    """Check in and wait until all ``world`` ranks have, or one of them posted a start-up failure
    (then a PeerFailure with its message), or ``timeout_s`` passed (a PeerFailure naming how many
    came)."""
    store.add(_ARRIVED, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([_FAILED]):
            message = store.get(_FAILED).decode("utf-8", "replace")
            store.add(_DONE, 1)
            raise PeerFailure(message)
        arrived = store.add(_ARRIVED, 0)
        if arrived >= world:
            return
        if time.monotonic() > deadline:
            raise PeerFailure(f"only {arrived} of {world} ranks started within dist.timeout_s="
                              f"{timeout_s:g} s (a rank was not started, or cannot reach "
                              "MASTER_ADDR:MASTER_PORT)")
        time.sleep(_POLL_S)


def report_startup_failure(error: BaseException) -> None:
    """On a rank that fails before it joins its job (started by torchrun or by hand with ``RANK``
    and ``WORLD_SIZE`` > 1 set): post ``error`` for the others (:func:`join_job`). Best effort: a
    job whose store cannot be reached has no one to tell. The rank that hosts the store keeps it up
    until every other rank has read the failure or failed too (at most ``REPORT_TIMEOUT_S``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        return
    rank = int(os.environ["RANK"])
    try:
        store, host = job_store(REPORT_TIMEOUT_S)
        if store.add(_FAILED + "/count", 1) == 1:  # the first failed rank's message is reported
            store.set(_FAILED, f"rank {rank} stopped at start-up: {error}")
        store.add(_DONE, 1)
        deadline = time.monotonic() + REPORT_TIMEOUT_S
        while host and store.add(_DONE, 0) < world and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    except (RuntimeError, OSError, ValueError):  # no store to reach (DistError: a RuntimeError)
        pass
