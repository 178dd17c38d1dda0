"""``recstack`` under torchrun with every collective of ``torch.distributed`` recorded: what op, on
which process group, from which thread, in the order this rank issued them. Run as ``torchrun ...
tests/distributed/collective_recorder.py OUT_DIR recstack-args...``; each rank writes
``OUT_DIR/rank<r>.json`` when ``recstack`` returns (DDP's all-reduce goes through its comm hook,
which calls ``dist.all_reduce`` from Python, so it is recorded too)."""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from pathlib import Path

import torch.distributed as dist

COLLECTIVES = (
    "all_to_all_single",
    "all_to_all",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)


def record(calls: list[tuple[str, str, str]]) -> None:
    """Wrap every collective of ``torch.distributed`` so that each call appends (op, group,
    thread)."""
    for name in COLLECTIVES:
        real = getattr(dist, name)

        @functools.wraps(real)
        def wrapper(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            group = kwargs.get("group")
            label = "default" if group is None else str(group.group_name)
            calls.append((_name, label, threading.current_thread().name))
            return _real(*args, **kwargs)

        setattr(dist, name, wrapper)


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    calls: list[tuple[str, str, str]] = []
    record(calls)
    from recstack.cli.main import main as recstack_main

    try:
        return recstack_main(argv)
    finally:
        rank = os.environ["RANK"]
        (out / f"rank{rank}.json").write_text(json.dumps(calls))


if __name__ == "__main__":
    sys.exit(main())
