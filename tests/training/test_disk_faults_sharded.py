"""A full disk during a sharded (DCP) checkpoint under torchrun: every rank stops with exit code 2 and one line
(the rank that could not write names the file and the cause, instead of torch's "unexpected pos"), no
``step_<step>.tmp`` is left, and the last good checkpoint stays the one ``eval`` and ``--resume`` take.
``disk_helpers`` says how the full disk is made (a tmpfs, else a per-file size limit)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import CHECKPOINT_STEPS, run_cli, torchrun, train_args
from disk_helpers import leftovers, small_disk
from test_disk_faults import FREE, WIDE

from recstack.training.checkpoint.sharded import list_sharded


def test_a_full_disk_during_a_sharded_checkpoint(tiny_dataset: Path, tmp_path: Path) -> None:
    with small_disk(tmp_path) as disk:
        run = disk.path / "run"
        res = disk.run(train_args(run, tiny_dataset, [*WIDE, *CHECKPOINT_STEPS]), launcher=torchrun(2), timeout=400)
        assert res.returncode == 0, res.stderr[-3000:]
        ckpts = run / "checkpoints"
        assert [p.name for p in list_sharded(ckpts)] == ["step_000000002", "step_000000004"]
        disk.fill(FREE)
        more = [*WIDE, *CHECKPOINT_STEPS, "train.max_steps=6"]
        res = disk.run(train_args(run, tiny_dataset, more, "--resume"), launcher=torchrun(2), timeout=400)
        assert res.returncode != 0
        # One line per rank that got to print it (torchrun stops the others once one has exited; the ranks
        # write at once, so two lines may share one of the captured stderr): the rank that could not write names
        # its file and the cause, the other names that rank's failure.
        errors = re.findall(r"recstack train: error: (.*?\(E[A-Z]+\))", res.stderr)
        assert errors and all(f"cannot write {ckpts / 'step_000000006.tmp'}: {disk.error}" in e for e in errors), \
            res.stderr[-4000:]
        assert "unexpected pos" not in res.stderr and "]: Traceback" not in res.stderr  # none from a rank
        root_cause = res.stderr.split("Root Cause")[-1]
        assert re.search(r"exitcode\s*: 2 ", root_cause), res.stderr[-3000:]
        assert leftovers(run) == [] and [p.name for p in list_sharded(ckpts)] == ["step_000000002",
                                                                                  "step_000000004"]
        disk.free_up()
        res = run_cli(["eval", "--checkpoint", str(run)])
        assert res.returncode == 0, res.stderr[-3000:]
        assert str(ckpts / "step_000000004") in res.stderr
