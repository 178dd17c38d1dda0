"""The one command line: ``recstack train | eval | predict | data prepare | data synth | data inspect | plan |
analyze-a2a | exfm | export | serve``."""

from __future__ import annotations

import argparse
import sys

from recstack import __version__
from recstack.cli import compression, data, evaluate, exfm, plan, serving, train
from recstack.errors import RecstackError

COMMAND_GROUPS = (train, evaluate, data, plan, compression, exfm, serving)  # each adds its commands, in --help order


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
        print(f"recstack {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"recstack {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
