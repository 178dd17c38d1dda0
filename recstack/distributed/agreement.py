"""Start-up agreement: before the first training collective, every rank checks that the others run the same job.

Ranks that disagree on the config, the sharding plan, the data or the world layout do not fail cleanly later:
different batch sizes train for a while and then hang in a collective whose sizes no longer match, different
shardings die with a shape error deep inside an all-to-all. So each rank gathers every rank's facts (one
``all_gather_object`` of a small dict) and, where they differ, every rank raises the same ConfigError naming
the first differing fact and each rank's value.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recstack.data.integrity import fingerprint
from recstack.data.prepared_dataset import PreparedDataset
from recstack.distributed.config import DistConfig
from recstack.embedding.collection import TableConfig
from recstack.errors import ConfigError, PeerFailure, RecstackError

_MISSING = "<not set>"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections -> ``{"train.batch_size": 128, ...}`` (the dotted names ``--set`` takes)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def first_difference(facts: list[dict[str, Any]]) -> str | None:
    """facts[r]: rank r's facts -> None when every rank has the same, else "NAME: rank 0 has A, rank 1 has B"
    for the first name (in rank 0's order) that differs; ranks with one value are listed together."""
    names = list(dict.fromkeys(name for f in facts for name in f))
    for name in names:
        values = [f.get(name, _MISSING) for f in facts]
        if all(v == values[0] for v in values[1:]):
            continue
        groups: list[tuple[Any, list[int]]] = []
        for rank, v in enumerate(values):
            for value, ranks in groups:
                if value == v:
                    ranks.append(rank)
                    break
            else:
                groups.append((v, [rank]))
        parts = [f"rank {ranks[0]} has {_show(v)}" if len(ranks) == 1 else
                 f"ranks {', '.join(map(str, ranks))} have {_show(v)}" for v, ranks in groups]
        return f"{name}: {', '.join(parts)}"
    return None


def check_agreement(facts: dict[str, Any], what: str, timeout_s: float) -> None:
    """Every rank calls this with its own ``facts`` (name -> a picklable value compared with ``==``); each returns
    when all agree, else each raises the same ConfigError (exit 2) naming the first difference. ``what``: the
    kind of facts, for the message; ``timeout_s``: the collective's bound, for the message when a rank never
    comes (it died first, or waits somewhere else): that is a PeerFailure."""
    gathered: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, facts)
    except (RuntimeError, torch.distributed.DistError) as e:
        raise PeerFailure(
            f"rank {dist.get_rank()}: the start-up check of every rank's {what} failed (a rank died, or none "
            f"answered within dist.timeout_s={timeout_s:g} s): {e}") from e
    diff = first_difference(gathered)
    if diff is not None:
        # Every rank saw the same facts and stops here: leave the job together (barrier, then every group torn
        # down), so that no rank's gloo connections die under a peer still closing its own (SIGABRT at exit).
        dist.barrier()
        dist.destroy_process_group()
        raise ConfigError(f"the ranks of this job disagree on their {what}: {diff}; every rank must run the same "
                          "command on the same files")


def check_job(config: dict[str, Any], dist_cfg: DistConfig, world: int, resume: bool,
              resume_on_new_data: bool = False, output_dir: Path | None = None,
              overwrite: bool = False) -> None:
    """Collective, first of the run, before anything is written or removed: every rank has the same
    config (every field), world size, ranks per node, ``--resume``, ``--resume-on-new-data``,
    ``--overwrite`` and output directory (resolved: "run" and "./run" are one; ranks writing into
    different ones would each hold part of every sharded checkpoint); else every rank raises the
    same ConfigError naming the first difference."""
    rpn = dist_cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_agreement({**flatten(config), "world size": world,
                     "ranks per node (dist.ranks_per_node or LOCAL_WORLD_SIZE)": rpn, "--resume": resume,
                     "--resume-on-new-data": resume_on_new_data, "--overwrite": overwrite,
                     "--output-dir (resolved)": str(output_dir.resolve()) if output_dir else None},
                    "config and world layout", dist_cfg.timeout_s)


def check_placements_and_data(dist_cfg: DistConfig, tables: list[TableConfig],
                              placements: list[tuple[str, list[int]]], data: dict[str, PreparedDataset]) -> None:
    """Collective, before sharding: the same config may still name other files on another node, so every rank
    compares the resolved placement of every table (the plan's content) and a fingerprint of each data set
    (``data``: config key -> the set it names)."""
    facts: dict[str, Any] = {
        f"the resolved placements (dist.plan={dist_cfg.plan!r}) of table {table.name}": f"{kind} on ranks {ranks}"
        for table, (kind, ranks) in zip(tables, placements, strict=True)}
    for key, ds in data.items():
        facts[f"the data ({key}={str(ds.path)!r})"] = fingerprint(ds)
    check_agreement(facts, "sharding plan and data", dist_cfg.timeout_s)


def on_rank0(generate: Callable[[], None], what: str, timeout_s: float) -> None:
    """Run ``generate`` on rank 0 only (every rank writing the same files would race); the other ranks wait for
    it and stop with its error when it fails. A large set takes longer to generate than a collective may last,
    so rank 0 sends a heartbeat (a broadcast on a group of its own, every ``timeout_s`` / 4 seconds) while it
    works: a waiting rank gives up with a PeerFailure once no heartbeat came for ``timeout_s`` (rank 0 stopped
    or died), never later, however long a live rank 0 takes."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        if dist.get_rank() == 0:
            _heartbeat_until_done(generate, group, timeout_s)
            return
        status = _wait_for_rank0(group, what, timeout_s)
    finally:
        dist.destroy_process_group(group)
    if status is not None:
        raise ValueError(f"rank 0 could not {what}: {status}")


def _heartbeat_until_done(generate: Callable[[], None], group: Any, timeout_s: float) -> None:
    """Rank 0: ``generate`` in this thread, heartbeats ("running") from another, then the outcome (None or the
    error's text) to the waiting ranks. Re-raises the generator's error; a heartbeat or outcome that no longer
    reaches a rank is a PeerFailure (that rank died meanwhile)."""
    done, lost = threading.Event(), []

    def beat() -> None:
        while not done.wait(timeout_s / 4):
            try:
                dist.broadcast_object_list(["running"], src=0, group=group)
            except (RuntimeError, dist.DistError) as e:
                lost.append(e)
                return

    beater = threading.Thread(target=beat, name="recstack-rank0-heartbeat", daemon=True)
    beater.start()
    try:
        generate()
        error = None
    except Exception as e:  # re-raised below, after the other ranks have been told
        error = e
    done.set()
    beater.join()
    try:
        if lost:
            raise lost[0]
        dist.broadcast_object_list([None if error is None else f"{type(error).__name__}: {error}"], src=0,
                                   group=group)
    except (RuntimeError, dist.DistError) as e:
        if error is not None:
            raise error from e
        raise PeerFailure(f"rank 0: a rank stopped answering while this one generated the data (dist.timeout_s="
                          f"{timeout_s:g} s): {e}") from e
    if error is not None:
        raise error


def _wait_for_rank0(group: Any, what: str, timeout_s: float) -> str | None:
    """The other ranks: heartbeats until rank 0's outcome -> None (done) or the error's text."""
    while True:
        msg: list[Any] = [None]
        try:
            dist.broadcast_object_list(msg, src=0, group=group)
        except (RuntimeError, dist.DistError) as e:
            raise PeerFailure(f"rank {dist.get_rank()}: rank 0 stopped answering while it was to {what} (no "
                              f"heartbeat within dist.timeout_s={timeout_s:g} s): {e}") from e
        if msg[0] != "running":
            return msg[0]


def leave_job() -> None:
    """After a command succeeded on this rank: wait for every rank (barrier), then tear down every process group
    while the interpreter is still whole. A group left to the interpreter's exit dies at a different moment on
    each rank, while gloo's threads may still hold work that refers to Python objects; now and then that ends
    the process in std::terminate (SIGABRT, exit -6) after the run had written everything. A no-op outside a
    job. A peer that died at the very end is a PeerFailure."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except (RuntimeError, torch.distributed.DistError) as e:
        raise PeerFailure(f"rank {dist.get_rank()}: the other ranks did not finish with this one: {e}") from e
    dist.destroy_process_group()


def gather_failures(error: BaseException | None,
                    plain: type[BaseException] = RecstackError) -> list[tuple[int, str]]:
    """Collective: every rank says whether it failed (``error``, None when it did not) -> (rank, message) of
    every rank that failed, the same list on every rank (the message of a ``plain`` error as it is, others
    with their type)."""
    report = None if error is None else str(error) if isinstance(error, plain) else \
        f"{type(error).__name__}: {error}"
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return [(r, m) for r, m in enumerate(reports) if m is not None]


def fail_together(error: BaseException | None, what: str) -> None:
    """Collective: every rank says whether it could ``what`` (``error``: its failure, None when it could). When
    any rank failed, every rank leaves the job together (barrier, groups torn down, as ``check_agreement`` does)
    and raises: a failed rank its own error, the others a ConfigError naming the lowest failed rank and its
    message. So an error of one rank's shards (a memory budget too small for them) never leaves the others
    waiting in a later collective."""
    failed = gather_failures(error)
    if not failed:
        return
    world = dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    if error is not None:
        raise error
    rank, message = failed[0]
    raise ConfigError(f"rank {rank} of {world} could not {what}: {message}")
