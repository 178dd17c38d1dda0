"""Durable and atomic file writes, and JSON without NaN: the one home of the write-fsync-rename sequence.

A file that readers must see whole or not at all (a checkpoint, a committed marker, a rewritten log) is written
to ``<name>.tmp`` beside its final name, fsynced, renamed over it, and its directory fsynced so that the rename
itself survives a power cut. A crash before the rename leaves the old file (or none) and a stray ``.tmp``; the
writers that care remove stray ones when they start. Files written inside a directory that is renamed into place
later only need their bytes on disk before that rename: ``open_synced`` / ``fsync_file``.

Disk faults (a read-only or full disk, no permission) are one :class:`DiskError` naming the path and the cause:
``writing`` turns the ``OSError`` a writer raises (or that torch or numpy raise while wrapping one, such as
torch.save's "unexpected pos") into it and removes what was half-written; ``atomic_path`` does so for its
``.tmp``. ``check_writable`` finds an unwritable output before a command does its work,
``check_free_space`` one too small for what it will hold. A file written through a memory map has
its blocks reserved first (``reserve``): a store to a mapped page that the disk cannot back kills
the process with SIGBUS, where a failed ``fallocate`` is an ``OSError`` like any other.
"""

from __future__ import annotations

import errno
import gzip
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from recstack.errors import DiskError, RecstackError
from recstack.units import format_bytes


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
    with writing(path, remove=[tmp]):
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


def read_text(path: str | Path, error: type[Exception]) -> str:
    """The UTF-8 text of the file at ``path``; text that is not UTF-8 (or a file that cannot be
    read) raises ``error`` naming the file and where, not a ``UnicodeDecodeError`` naming
    neither."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror or e})") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}; save the file as "
                    "UTF-8)") from None


def read_json(path: str | Path, error: type[Exception]) -> Any:
    """The JSON document in the file at ``path``; text that is not UTF-8, invalid JSON or JSON
    nested too deeply for the parser (a crafted ``[[[[...``: a RecursionError otherwise) raises
    ``error`` naming the file."""
    text = read_text(path, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: invalid JSON ({e})") from e
    except RecursionError:
        raise error(f"{path}: invalid JSON (nested too deeply)") from None


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float, in dicts and lists too (an AUC of NaN on a one-class set), replaced by
    None: JSON has no NaN, and ``json.dumps(..., allow_nan=False)`` then checks that none is left."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def os_error_in(error: BaseException | None) -> OSError | None:
    """The ``OSError`` that ``error`` is or was raised while handling (its cause or context chain), else None.
    torch.save reports a full disk as a RuntimeError ("unexpected pos") raised while the OSError was handled."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ if error.__cause__ is not None else \
            None if error.__suppress_context__ else error.__context__
    return None


def disk_error(error: OSError, path: str | Path | None = None, action: str | None = "write") -> DiskError:
    """One line naming the file (the error's own, else ``path``) and the cause, e.g. ``cannot write
    run/metrics.jsonl: No space left on device (ENOSPC)`` (``action`` None: ``run/metrics.jsonl: ...``)."""
    name = error.filename if error.filename is not None else path
    if error.filename2 is not None:
        name = f"{name} -> {error.filename2}"
    cause = error.strerror or str(error) or type(error).__name__
    code = errno.errorcode.get(error.errno, "") if isinstance(error.errno, int) else ""
    where = "I/O error: " if name is None else f"cannot {action} {name}: " if action else f"{name}: "
    return DiskError(where + cause + (f" ({code})" if code else ""))


@contextmanager
def writing(path: str | Path, remove: Iterable[str | Path] = ()) -> Iterator[None]:
    """Around code that writes ``path``: on a failure, the files or directories in ``remove`` (what was
    half-written) are removed; an ``OSError`` (or an error raised while handling one) becomes a
    :class:`DiskError` naming the failing file (``path`` when the error names none, as a failed ``write`` does).
    A :class:`RecstackError`, and gzip's BadGzipFile (an ``OSError`` about the data, not the disk) pass through as
    they are."""
    try:
        yield
    except BaseException as e:
        for p in remove:
            _remove_quietly(Path(p))
        cause = None if isinstance(e, RecstackError) else os_error_in(e)
        if cause is None or isinstance(cause, gzip.BadGzipFile):
            raise
        raise disk_error(cause, path) from e


def _remove_quietly(path: Path) -> None:
    """Remove a file or directory tree if it is there; a removal that fails too (the disk is gone) is left."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def check_writable(path: str | Path, *, directory: bool, inside: bool = False) -> None:
    """Before the work: can ``path`` (a file, or with ``directory`` a directory) be written? The nearest existing
    directory on the way (``path`` itself with ``inside``, for a directory written into rather than renamed into
    place) must take a new file: a probe file is created there and removed. A :class:`DiskError` naming the path
    and the cause otherwise, also when ``path`` exists as the other kind (a file where a directory goes)."""
    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            raise DiskError(f"cannot write {path}: it is a file, not a directory (ENOTDIR)")
        if not directory and path.is_dir():
            raise DiskError(f"cannot write {path}: it is a directory (EISDIR)")
    start = path if inside and directory and path.is_dir() else path.parent
    probe_dir = start.absolute()
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise DiskError(f"cannot write {path}: {probe_dir} is not a directory (ENOTDIR)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".recstack-write-check-", dir=probe_dir)
    except OSError as e:
        where = path if probe_dir == path.absolute() else f"{path} (no new file in {probe_dir})"
        raise disk_error(OSError(e.errno, e.strerror), where) from None
    os.close(fd)
    os.unlink(probe)


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still put on the file system of ``path`` (or of its nearest
    existing parent)."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize


def check_free_space(path: str | Path, need: int, what: str) -> None:
    """Before the work: a :class:`DiskError` naming ``path`` when its file system has less than
    ``need`` bytes free for ``what`` (e.g. "the artifact"). A lower bound only: the writes still
    handle ENOSPC."""
    free = free_bytes(path)
    if free < need:
        raise DiskError(f"cannot write {path}: {what} needs about {format_bytes(need)}, the disk "
                        f"has {format_bytes(free)} free: No space left on device (ENOSPC)")


def reserve(path: str | Path, nbytes: int) -> None:
    """Allocate the blocks of the first ``nbytes`` of ``path`` (created when missing) before it is
    written through a memory map: ENOSPC is then an ``OSError`` here instead of a SIGBUS at the
    first store to a page the disk cannot back."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if nbytes > 0:
            os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
