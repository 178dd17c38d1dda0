"""Durable and atomic file writes, and JSON without NaN: the one home of the write-fsync-rename sequence.

A file that readers must see whole or not at all (a checkpoint, a committed marker, a rewritten log) is written
to ``<name>.tmp`` beside its final name, fsynced, renamed over it, and its directory fsynced so that the rename
itself survives a power cut. A crash before the rename leaves the old file (or none) and a stray ``.tmp``; the
writers that care remove stray ones when they start. Files written inside a directory that is renamed into place
later only need their bytes on disk before that rename: ``open_synced`` / ``fsync_file``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_dir(directory: str | Path) -> None:
    """Make the entries of ``directory`` (new files, renames) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Put the bytes of a file that another writer (``torch.save``, ``pq.write_table``) has closed on disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextmanager
def open_synced(path: str | Path) -> Iterator[IO[bytes]]:
    """``open(path, "wb")`` whose bytes are flushed and fsynced before it closes (no rename: for files inside a
    directory that becomes visible as a whole)."""
    with open(path, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def atomic_path(path: str | Path, sync_dir: bool = True) -> Iterator[Path]:
    """Yields ``<path>.tmp`` for the caller to write and close; then fsyncs it, renames it over ``path`` and (with
    ``sync_dir``) fsyncs the directory. On an exception nothing is renamed: ``path`` keeps what it held."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    yield tmp
    fsync_file(tmp)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, sync_dir: bool = True) -> None:
    """Replace ``path`` by ``data`` atomically (see ``atomic_path``)."""
    with atomic_path(path, sync_dir) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str, sync_dir: bool = True) -> None:
    """Replace ``path`` by ``text`` (UTF-8) atomically (see ``atomic_path``)."""
    atomic_write_bytes(path, text.encode("utf-8"), sync_dir)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float, in dicts and lists too (an AUC of NaN on a one-class set), replaced by
    None: JSON has no NaN, and ``json.dumps(..., allow_nan=False)`` then checks that none is left."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value
