"""Writers that need room they may not get: ``recstack export`` (its tables written through memory
maps, its dense program through torch's zip writer) and the SSD store of ``ssd-cached`` tables
(files that grow while the run trains), on a disk that fills up. Each ends with exit code 2 (3 for
the ranks whose peer failed) and one line naming the path and the cause, never a crash by signal
(SIGBUS from a store into a mapped page the disk cannot back, SIGABRT from torch's zip writer or
gloo at exit), and leaves nothing half-written behind.

These need a disk that is really full (ENOSPC for every file, mapped ones included): a tmpfs, which
the tests mount where they may (``disk_helpers``); elsewhere they are skipped, saying why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SMALL, torchrun, train_args
from disk_helpers import Disk, error_line, leftovers, small_disk

PAGE = 4096


def tmpfs_or_skip(disk: Disk) -> None:
    if not disk.mounted:
        pytest.skip("needs a tmpfs (root with CAP_SYS_ADMIN): a per-file size limit does not fill "
                    "a memory map")


def pages(root: Path) -> int:
    """Bytes the files under ``root`` take on a tmpfs (whole pages)."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in root.rglob("*") if p.is_file())


def test_export_to_a_disk_that_fills_up(single_run: Path, tmp_path: Path) -> None:
    """Too little room for the tables: refused before the work. Room for the tables but not for the
    whole artifact: the write that does not fit fails (the mapped table files' blocks are allocated
    before they are mapped; the dense program is written as plain bytes), one line, no
    ``.<out>.tmp-*`` left. With room, the same command succeeds."""
    ckpt = str(single_run / "checkpoints" / "ckpt_000000004.pt")
    with small_disk(tmp_path) as disk:
        tmpfs_or_skip(disk)
        out = disk.path / "artifact"
        ref = disk.run(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "ref")])
        assert ref.returncode == 0, ref.stderr[-2000:]
        whole = pages(tmp_path / "ref")
        for free, before in ((PAGE, True), (whole - 2 * PAGE, False)):
            disk.fill(free)
            line = error_line(disk.run(["export", "--checkpoint", ckpt, "--out", str(out)]))
            assert line.startswith(f"recstack export: error: cannot write {out}: ") and \
                line.endswith(disk.error), line
            assert ("the artifact needs about" in line) == before, line
            assert sorted(p.name for p in disk.path.iterdir()) == [".filler"], leftovers(disk.path)
            disk.free_up()
        assert disk.run(["export", "--checkpoint", ckpt, "--out", str(out)]).returncode == 0
        assert sorted(p.name for p in disk.path.iterdir()) == ["artifact"]


# 2 ranks, row-wise: on each rank C2 and C4's shards in SSD files of 5.3 and 17.6 KiB, behind
# caches of ~21%; every step appends the rows it evicts to those files.
SSD = [*SMALL, 'dist.sharding="row_wise"', 'memory.device="6000"', 'memory.host="1"',
       "train.max_steps=60", "train.eval_every=0"]


@pytest.mark.parametrize("free", [8 * 1024, 96 * 1024])
def test_an_ssd_dir_that_fills_up_under_torchrun(tiny_dataset: Path, tmp_path: Path,
                                                  free: int) -> None:
    """``memory.ssd_dir`` on a disk with room for less than the tables (the store's first write
    fails) or for them but not for what the run appends: the rank whose file does not grow says so
    in one line naming its directory and the cause and exits with 2, the other exits with 3 naming
    that rank's failure; no rank dies by a signal, and no table file is left."""
    with small_disk(tmp_path) as disk:
        tmpfs_or_skip(disk)
        ssd = disk.path / "ssd"
        disk.fill(free)
        args = train_args(tmp_path / "run", tiny_dataset, [*SSD, f'memory.ssd_dir="{ssd}"'])
        res = disk.run(args, launcher=torchrun(2), timeout=400)
        assert res.returncode != 0
        codes = [int(c) for c in re.findall(r"exitcode\s*: (-?\d+)", res.stderr)]
        assert codes and all(c in (2, 3, -15) for c in codes) and 2 in codes, res.stderr[-4000:]
        assert "terminate called" not in res.stderr, res.stderr[-4000:]
        assert "]: Traceback" not in res.stderr, res.stderr[-4000:]
        errors = re.findall(r"recstack train: error: (.*)", res.stderr)
        mine = [e for e in errors if "No space left on device (ENOSPC)" in e]
        assert mine and all(re.search(rf"cannot write {ssd}/rank_[01]\b", e) for e in mine), errors
        assert not any(f.is_file() for f in ssd.rglob("*")), sorted(ssd.rglob("*"))
