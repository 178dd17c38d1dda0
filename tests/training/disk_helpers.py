"""Disks that are full or read-only, for the disk-fault tests, as real as this machine allows.

Full (:func:`small_disk`): where this process may mount file systems (root with CAP_SYS_ADMIN), a small tmpfs;
``fill(free)`` writes a filler file that leaves ``free`` bytes, so writes past them fail with ENOSPC as on a real
full disk. Elsewhere ``fill(free)`` caps the size of any one file that the commands started afterwards write
(``RLIMIT_FSIZE``, with SIGXFSZ ignored): a write past ``free`` bytes fails with EFBIG. That emulates a disk with
less room left than one file needs, not one that other files filled: it is a real limit of the kernel, and the
writer sees a failed ``write`` either way.

Read-only (:func:`read_only_dir`): a tmpfs mounted read-only (EROFS) where mounting works; else, for a user
other than root, a directory of mode 0o555 (EACCES); else (root, whom modes do not stop, without mount) a
regular file where the directory should be, so creating anything under it fails with ENOTDIR.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RECSTACK = [sys.executable, "-m", "recstack"]


@functools.cache
def can_mount() -> bool:
    """Whether this process can mount (and unmount) a tmpfs (never with RECSTACK_TEST_NO_MOUNT=1 set: to run the
    fallbacks where mounting works)."""
    if os.geteuid() != 0 or os.environ.get("RECSTACK_TEST_NO_MOUNT") == "1":
        return False
    probe = tempfile.mkdtemp(prefix="recstack-mount-probe-")
    try:
        ok = _mount(probe, "size=64k")
        if ok:
            subprocess.run(["umount", probe], check=True)
        return ok
    finally:
        os.rmdir(probe)


def _mount(path: str | Path, options: str) -> bool:
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


class Disk:
    """A directory (``path``) whose disk :meth:`fill` makes full for the commands :meth:`run` starts."""

    def __init__(self, path: Path, mounted: bool) -> None:
        self.path, self.mounted = path, mounted
        self.limit: int | None = None  # RLIMIT_FSIZE of the children (without a tmpfs)
        self.filler = path / ".filler"

    @property
    def error(self) -> str:
        """What a write that does not fit is told (os.strerror of ENOSPC or EFBIG)."""
        return "No space left on device (ENOSPC)" if self.mounted else "File too large (EFBIG)"

    def fill(self, free: int) -> None:
        """Leave ``free`` bytes for what the next commands write (see the module's docstring)."""
        if not self.mounted:
            self.limit = free
            return
        st = os.statvfs(self.path)
        left = st.f_bavail * st.f_frsize - free
        with open(self.filler, "wb") as f:
            while left > 0:
                n = min(left, 1 << 20)
                f.write(b"\0" * n)
                left -= n

    def free_up(self) -> None:
        self.filler.unlink(missing_ok=True)
        self.limit = None

    def _limit(self) -> None:  # in the child, before exec: inherited by whatever it starts (torchrun's ranks)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        if self.limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.limit))

    def run(self, args: list[str], launcher: list[str] = RECSTACK, timeout: float = 300
            ) -> subprocess.CompletedProcess[str]:
        """``recstack ARGS`` in a subprocess on this disk's terms."""
        return subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=timeout,
                              preexec_fn=self._limit)


@contextmanager
def small_disk(tmp_path: Path, size: str = "16m") -> Iterator[Disk]:
    """A :class:`Disk` of ``size`` (a tmpfs where possible, else a directory of ``tmp_path``)."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = can_mount() and _mount(path, f"size={size}")
    try:
        yield Disk(path, mounted)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


@contextmanager
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A path under which nothing can be created (see the module's docstring): outputs go to ``<it>/out``."""
    path = tmp_path / "ro"
    if can_mount():
        path.mkdir()
        assert _mount(path, "ro,size=64k")
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
    elif os.geteuid() != 0:
        path.mkdir(mode=0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
    else:
        path.write_text("a file where a directory should be\n")
        yield path


def error_line(res: subprocess.CompletedProcess[str]) -> str:
    """The one-line error of a command that failed on a disk fault: exit code 2, no traceback -> its last line."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, res.stderr[-3000:]
    return errors[0]


def leftovers(directory: Path) -> list[str]:
    """Temporary files and directories left anywhere under ``directory`` (``*.tmp``, ``.*.tmp-*``)."""
    if not directory.is_dir():
        return []
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.name.endswith(".tmp") or ".tmp-" in p.name)
