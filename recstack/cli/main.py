"""The one command line: ``recstack train | tune | eval | predict | data prepare | data synth | data inspect |
plan | analyze-a2a | exfm | export | serve``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from recstack import __version__
from recstack.cli import compression, data, evaluate, exfm, plan, serving, train, tune
from recstack.errors import PeerFailure, RecstackError
from recstack.io import disk_error, os_error_in

# each adds its commands, in --help order
COMMAND_GROUPS = (train, tune, evaluate, data, plan, compression, exfm, serving)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recstack", description=__doc__)
    p.add_argument("--version", action="version", version=f"recstack {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except RecstackError as e:  # bad input (2) or a failed peer (3): a message, not a traceback
        return _fail(args.command, str(e), e.exit_code, isinstance(e, PeerFailure))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        return _fail(args.command, str(e), 2)
    except Exception as e:  # any other OSError (a disk fault no writer named), or torch's error wrapping one
        cause = os_error_in(e)
        if cause is None:
            raise
        return _fail(args.command, str(disk_error(cause, action=None)), 2)
    if "torch.distributed" in sys.modules:  # only a command that ran torch can have joined a job
        from recstack.distributed.agreement import leave_job
        try:
            leave_job()
        except PeerFailure as e:
            print(f"recstack {args.command}: error: {e}", file=sys.stderr)
            _leave_without_teardown(e.exit_code)
    return 0


def _fail(command: str, message: str, code: int, peer: bool = False) -> int:
    """Print the one line; -> ``code``. A rank that fails while its job is still joined (a disk
    fault in the middle of training, its peers in a collective with it) leaves without teardown too,
    as after a peer's failure: its process group still holds that collective."""
    print(f"recstack {command}: error: {message}", file=sys.stderr)
    if peer or _in_job():
        _leave_without_teardown(code)
    return code


def _in_job() -> bool:
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _leave_without_teardown(code: int) -> NoReturn:
    """Exit now, skipping the interpreter's teardown. After a peer died, the process group still holds the
    collective that timed out; destroying it (at exit, or by hand) either waits on the dead peer or makes gloo call
    std::terminate (SIGABRT, exit -6 instead of ``code``). What must outlive the process is already on disk: the
    metrics log is flushed per line and checkpoints are written whole or not at all."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
