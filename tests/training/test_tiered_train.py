"""Tiered tables in the trainer: same results as all-in-memory training, directory checkpoints that stream
tables, and SIGKILL + resume of an ssd-cached table."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import SMALL, kill_after_checkpoints, run_cli, small_config, train_args, train_steps

from recstack.config import load_config
from recstack.data.batch import SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from recstack.embedding.tiered.collection import TablePlacement, TieredEmbeddingCollection
from recstack.errors import ConfigError
from recstack.training.checkpoint.single import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from recstack.training.trainer import Trainer

METRICS = ("auc", "logloss", "ne", "calibration", "accuracy", "steps", "train_samples")
# The tiny data set's tables hold 50, 300, 7 and 1000 rows of 36 bytes (8 weights + an accumulator).
# 4392 bytes of device memory: C1 and C3 stay, C2 (host-cached, 32-row cache) and C4 (ssd-cached, 33 rows).
MIXED = ['memory.device="4392"', 'memory.host="10800"']
# 16452 bytes: C1, C2 and C3 stay, C4 gets a 100-row cache (10%) over a file.
SSD = ['memory.device="16452"', 'memory.host="0"']


def test_trainer_with_budgets_matches_all_in_memory(
    tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    extra = ["train.max_steps=60", "train.eval_every=25", "train.shuffle=true", "train.log_every=20"]
    ref = train_steps(tiny_dataset, None, extra)
    assert "embedding placement" not in capsys.readouterr().out
    run = train_steps(tiny_dataset, tmp_path / "run", [*extra, *MIXED, f'memory.ssd_dir="{tmp_path / "ssd"}"'])
    plan = capsys.readouterr().out
    assert "host-cached" in plan and "ssd-cached" in plan, plan
    assert {k: ref[k] for k in METRICS} == {k: run[k] for k in METRICS}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert all(x["cache_requests"] > 0 and 0 <= x["cache_hits"] <= x["cache_requests"] for x in train)
    (ckpt,) = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert ckpt.is_dir() and (ckpt / "state.pt").is_file() and len(list((ckpt / "tables").iterdir())) == 4


def test_trainer_close_releases_the_table_files(tiny_dataset: Path, tmp_path: Path) -> None:
    """`recstack train` closes the trainer at its end; a library user calls ``Trainer.close`` (an SSD tier keeps a
    file open until then)."""
    import os

    def open_in(directory: Path) -> list[str]:
        fds = Path("/proc/self/fd")
        links = [os.readlink(fd) for fd in fds.iterdir() if fd.is_symlink()] if fds.is_dir() else []
        return [x for x in links if x.startswith(str(directory))]

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to see open files")
    cfg = small_config(tiny_dataset, ["train.max_steps=5", *SSD, f'memory.ssd_dir="{tmp_path / "ssd"}"'])
    trainer = Trainer(cfg, None)
    trainer.train()
    assert open_in(tmp_path / "ssd")
    trainer.close()
    assert open_in(tmp_path / "ssd") == []


def test_memory_config_errors_name_the_key(tiny_dataset: Path) -> None:
    with pytest.raises(ConfigError, match="memory.device: '2 parsecs' is not a size"):
        load_config(None, ['memory.device="2 parsecs"'])
    with pytest.raises(ConfigError, match="memory.cache_policy: 'mru' is not one of lru, lfu"):
        load_config(None, ['memory.cache_policy="mru"'])
    with pytest.raises(ValueError, match="set memory.ssd_dir"):
        train_steps(tiny_dataset, None, SSD)


def _collection(placement: TablePlacement, ssd: Path) -> TieredEmbeddingCollection:
    tables = [TableConfig("u", 40, 4, (0,)), TableConfig("v", 500, 4, (1,))]
    return TieredEmbeddingCollection(tables, SparseOptimizerConfig("rowwise_adagrad", 0.2),
                                     [TablePlacement(), placement], seed=2, ssd_dir=ssd)


def test_directory_checkpoint_restores_into_any_tier(tmp_path: Path) -> None:
    src = _collection(TablePlacement("ssd-cached", 64, "lfu"), tmp_path / "ssd")
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.stack([torch.randint(0, 40, (32,), generator=g), torch.randint(0, 500, (32,), generator=g)], 1)
        src(SparseFeatures.from_dense_ids(ids)).square().sum().backward()
    expect = {n: src.table_state(n) for n in ("u", "v")}
    path = save_checkpoint(tmp_path / "ck", 5, {"model": src.state_dict()}, files=src.checkpoint_files())
    assert path.name == "ckpt_000000005" and sorted(p.name for p in path.iterdir()) == ["state.pt", "tables"]
    for placement in (TablePlacement(), TablePlacement("host-cached", 32), TablePlacement("ssd-cached", 1)):
        dst = _collection(placement, tmp_path / "ssd2")
        state = latest_checkpoint(tmp_path / "ck")
        dst.load_state_dict(state["model"])
        with pytest.raises(RuntimeError, match="restore_files"):  # loaded without its rows: refuse to run
            dst(SparseFeatures.from_dense_ids(torch.zeros(1, 2, dtype=torch.int64)))
        dst.restore_files(state["checkpoint_dir"])
        for n, (w, acc) in expect.items():
            w2, acc2 = dst.table_state(n)
            assert torch.equal(w, w2) and torch.equal(acc, acc2), (placement, n)
    (path / "tables" / "001.f32").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match=r"001\.f32: 100 bytes, expected 10000"):
        dst.restore_files(path)


def test_directory_checkpoints_are_atomic(tmp_path: Path) -> None:
    def writer(data: bytes):
        return lambda p: p.write_bytes(data)

    def crash(p: Path) -> None:
        p.write_bytes(b"half")
        raise OSError("disk full")

    save_checkpoint(tmp_path, 1, {"x": 1})
    save_checkpoint(tmp_path, 2, {"x": 2}, files={"t/a.bin": writer(b"two")})
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 3, {"x": 3}, files={"t/a.bin": crash})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_000000001.pt", "ckpt_000000002"]
    state = latest_checkpoint(tmp_path)
    assert state["x"] == 2 and Path(state["checkpoint_dir"], "t", "a.bin").read_bytes() == b"two"
    save_checkpoint(tmp_path, 2, {"x": 22}, files={"t/a.bin": writer(b"again")})  # the same step again
    save_checkpoint(tmp_path, 3, {"x": 3}, files={"t/a.bin": writer(b"three")}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_000000002", "ckpt_000000003"]
    assert latest_checkpoint(tmp_path)["x"] == 3
    assert (tmp_path / "ckpt_000000002" / "t" / "a.bin").read_bytes() == b"again"
    (tmp_path / "ckpt_000000003" / "state.pt").unlink()  # a directory without its state is not a checkpoint
    with pytest.warns(UserWarning, match="incomplete checkpoint directory"):
        assert latest_checkpoint(tmp_path)["x"] == 22
    with pytest.raises(ValueError, match="outside"):
        save_checkpoint(tmp_path, 4, {}, files={"../escape.bin": writer(b"")})
    assert not (tmp_path / "escape.bin").exists()
    with pytest.raises(CheckpointError, match="incomplete checkpoint directory"):
        load_checkpoint(tmp_path / "ckpt_000000003")


def test_sigkill_then_resume_ssd_cached_matches_uninterrupted(tiny_dataset: Path, tmp_path: Path) -> None:
    """The SSD table is rewritten by evictions after every checkpoint; the resumed run must start from the
    checkpoint's copy of it, never from what the file held when the process died."""
    extra = ["train.max_steps=150", "train.checkpoint_every=40", "train.shuffle=true", *SSD]
    ref = run_cli(train_args(tmp_path / "ref", tiny_dataset, [*SMALL, *extra,
                                                              f'memory.ssd_dir="{tmp_path / "ssd_ref"}"']))
    assert ref.returncode == 0, ref.stderr
    assert "ssd-cached" in ref.stdout

    run = train_args(tmp_path / "run", tiny_dataset, [*SMALL, *extra, f'memory.ssd_dir="{tmp_path / "ssd"}"'])
    killed = kill_after_checkpoints(run, tmp_path / "run" / "checkpoints", 2)
    assert killed.returncode == -signal.SIGKILL, "training finished before it could be killed"
    assert not (tmp_path / "run" / "summary.json").exists()
    assert list((tmp_path / "ssd").iterdir()) == []  # the live table file died with the process

    resumed = run_cli([*run, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: continuing from" in resumed.stdout
    a = json.loads((tmp_path / "ref" / "summary.json").read_text())
    b = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {k: a[k] for k in METRICS} == {k: b[k] for k in METRICS}


def test_fused_and_tiered_checkpoints_do_not_mix(tmp_path: Path) -> None:
    tables = [TableConfig("u", 40, 4, (0,)), TableConfig("v", 500, 4, (1,))]
    fused = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig())
    tiered = _collection(TablePlacement("host-cached", 32), tmp_path)
    with pytest.raises(RuntimeError, match="_extra_state"):
        tiered.load_state_dict(fused.state_dict())


def _stopped_run(data: Path, out: Path, extra: list[str], step: int, stop_at) -> None:
    """Train until ``step`` steps are done, then stop between two steps (as a killed run does)."""
    t = Trainer(small_config(data, extra), out)
    stop_at(t, step)
    t.close()


def test_resume_across_memory_layouts_matches_uninterrupted(tiny_dataset: Path, tmp_path: Path, stop_at) -> None:
    """Budgets under which every table fits build the all-in-memory collection (a ckpt_<step>.pt), tighter
    ones cached tiers (a ckpt_<step>/ of table files): a run resumes from either under the other."""
    extra = ["train.max_steps=100", "train.checkpoint_every=40", "train.eval_every=30", "train.shuffle=true"]
    tight = [*MIXED, f'memory.ssd_dir="{tmp_path / "ssd"}"']
    roomy = ['memory.device="1MB"']
    ref = train_steps(tiny_dataset, None, extra)
    for first, then in ((tight, roomy), (roomy, tight)):
        out = tmp_path / f"run{len(first)}"
        _stopped_run(tiny_dataset, out, [*extra, *first], 60, stop_at)
        (ckpt,) = [p for p in list_checkpoints(out / "checkpoints") if p.name.startswith("ckpt_000000040")]
        assert ckpt.is_dir() == (first is tight)
        cfg = small_config(tiny_dataset, [*extra, *then])
        t = Trainer(cfg, out, resume=True)
        assert t.step == 40 and t.model.embeddings.stores_rows_in_files == (then is tight)
        run = t.train()
        assert {k: ref[k] for k in METRICS} == {k: run[k] for k in METRICS}, (first, then)


def test_eval_and_predict_take_a_checkpoint_directory(tiny_dataset: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """A tiered run's checkpoint is a directory; eval prints only JSON on stdout (the placement to stderr)."""
    from recstack.cli.main import main

    s = train_steps(tiny_dataset, tmp_path / "run",
                    ["train.max_steps=30", *MIXED, f'memory.ssd_dir="{tmp_path / "ssd"}"'])
    (ckpt,) = list_checkpoints(tmp_path / "run" / "checkpoints")
    capsys.readouterr()
    for where in (ckpt, tmp_path / "run"):
        assert main(["eval", "--checkpoint", str(where)]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["auc"] == pytest.approx(s["auc"], abs=1e-9)
        assert "embedding placement" in err and "host-cached" in err
    assert main(["predict", "--checkpoint", str(ckpt), "--data", str(tiny_dataset),
                 "--out", str(tmp_path / "p.npy")]) == 0
