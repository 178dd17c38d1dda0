"""Faults between ranks, in real gloo processes: a stopped rank (also rank 0 while it generates the data) makes the
others fail with a PeerFailure within ``dist.timeout_s`` (every process group has that timeout), and ranks started
with different configs, shardings, data or world layouts stop at start-up with one error naming the first
difference, before any training collective."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL, free_port, set_options, start_cli, torchrun, train_args, write_tiny_dataset

TIMEOUT_S = 10  # dist.timeout_s of these runs
MARGIN_S = 25  # the collective in flight started up to one step before the stop; two shared CPU cores


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie waiting for its parent counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _train_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return sum('"train"' in line for line in path.read_text().splitlines()) if path.is_file() else 0


def test_stopped_rank_fails_the_other_within_the_timeout(tiny_dataset: Path, tmp_path: Path) -> None:
    """SIGSTOP one of two ranks mid-training: the other exits with a PeerFailure (exit 3) within dist.timeout_s and
    a margin, in whichever collective it waits (embedding all-to-alls, the pipelined input distribution, DDP)."""
    out = tmp_path / "run"
    options = [*SMALL, "train.max_steps=100000", "train.log_every=1", f"dist.timeout_s={TIMEOUT_S}",
               'dist.sharding="row_wise"']
    proc = start_cli(train_args(out, tiny_dataset, options), launcher=torchrun(2))
    stopped = None
    try:
        deadline = time.time() + 120
        while _train_lines(out) < 3 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        assert len(workers) == 2 and proc.poll() is None, "training did not get under way"
        stopped, other = workers
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        while _alive(other) and time.time() - t0 < TIMEOUT_S + 2 * MARGIN_S:
            time.sleep(0.1)
        waited = time.time() - t0
        assert not _alive(other), f"the running rank still waits {waited:.0f} s after its peer stopped"
        assert waited < TIMEOUT_S + MARGIN_S, f"the running rank gave up only after {waited:.0f} s"
        os.kill(stopped, signal.SIGKILL)  # (the launcher may have killed it already)
        _, err = proc.communicate(timeout=60)  # the launcher does not hang either
    finally:
        if proc.poll() is None:
            if stopped is not None and _alive(stopped):
                os.kill(stopped, signal.SIGKILL)
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "recstack train: error: rank" in err and "dist.timeout_s=10 s" in err, err[-3000:]
    assert "exitcode  : 3" in err or "exitcode: 3" in err, err[-3000:]


def _start_ranks(per_rank: list[list[str]], out: Path, cwds: list[Path] | None = None,
                 envs: list[dict[str, str]] | None = None, flags: list[list[str]] | None = None
                 ) -> list[subprocess.Popen]:
    """``recstack train`` as ranks 0..n-1 of one job, each with its own overrides (torchrun gives every rank the
    same arguments; this is what ranks started by hand, or on nodes with other files, look like); ``envs``: more
    environment of each rank (over torchrun's variables), ``flags``: more command-line flags of each rank."""
    port, world = free_port(), len(per_rank)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    procs = []
    for rank, options in enumerate(per_rank):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(envs[rank] if envs else {})
        cmd = [sys.executable, "-m", "recstack", "train", "--output-dir", str(out), *set_options(options),
               *(flags[rank] if flags else [])]
        procs.append(subprocess.Popen(cmd, env=env, cwd=cwds[rank] if cwds else None, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 90) -> list[str]:
    """Wait for every rank (killing all of them after ``timeout`` s) -> their stderr; each must have exited 2."""
    errs, t0 = [], time.time()
    try:
        for p in procs:
            errs.append(p.communicate(timeout=max(1.0, timeout - (time.time() - t0)))[1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [2] * len(procs), [e[-2000:] for e in errs]
    return errs


def _common(data: str) -> list[str]:
    return [*SMALL, f'data.train="{data}"', "train.max_steps=50", "dist.timeout_s=30"]


def test_ranks_with_different_batch_sizes_stop_at_start(tiny_dataset: Path, tmp_path: Path) -> None:
    common = _common(str(tiny_dataset))
    errs = _finish(_start_ranks([[*common, "train.batch_size=128"], [*common, "train.batch_size=64"]],
                                tmp_path / "run"))
    for e in errs:
        assert "train.batch_size: rank 0 has 128, rank 1 has 64" in e, e[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_ranks_with_different_shardings_stop_at_start(tiny_dataset: Path, tmp_path: Path) -> None:
    common = _common(str(tiny_dataset))
    errs = _finish(_start_ranks([[*common, 'dist.sharding="table_wise"'], [*common, 'dist.sharding="row_wise"']],
                                tmp_path / "run"))
    for e in errs:
        assert "dist.sharding: rank 0 has 'table_wise', rank 1 has 'row_wise'" in e, e[-2000:]


def test_ranks_with_different_data_stop_at_start(tmp_path: Path) -> None:
    """The same data.train (relative) names other files on each rank: the data fingerprints differ."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for seed, cwd in enumerate(cwds):
        write_tiny_dataset(cwd / "data", rows=4000 + 1000 * seed, seed=seed)
    errs = _finish(_start_ranks([_common("data")] * 2, tmp_path / "run", cwds))
    for e in errs:
        assert "the data (data.train" in e and "rank 0 has" in e and "rows=4000" in e and "rows=5000" in e, e[-2000:]


def test_ranks_with_different_plans_stop_at_start(tiny_dataset: Path, tmp_path: Path) -> None:
    """The same dist.plan path holds another plan on each rank: the resolved placements differ (today: a
    ``split_with_sizes`` error deep in the first all-to-all)."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    tables = ["C1", "C2", "C3", "C4"]
    for cwd, kind in zip(cwds, ["table_wise", "row_wise"], strict=True):
        cwd.mkdir()
        plan = {"world_size": 2, "tables": [{"name": t, "sharding": kind, "ranks": [0] if kind == "table_wise" else
                                             [0, 1]} for t in tables]}
        (cwd / "plan.json").write_text(json.dumps(plan))
    common = [*_common(str(tiny_dataset)), 'dist.plan="plan.json"']
    errs = _finish(_start_ranks([common, common], tmp_path / "run", cwds))
    for e in errs:
        assert "the resolved placements (dist.plan" in e and "C1" in e, e[-2000:]


@pytest.mark.parametrize(("envs", "flags", "difference"), [
    ([{}, {"LOCAL_WORLD_SIZE": "1"}], None,
     "ranks per node (dist.ranks_per_node or LOCAL_WORLD_SIZE): rank 0 has 2, rank 1 has 1"),
    (None, [["--resume"], []], "--resume: rank 0 has True, rank 1 has False"),
], ids=["ranks-per-node", "resume"])
def test_ranks_with_different_world_layouts_stop_at_start(tiny_dataset: Path, tmp_path: Path,
                                                          envs: list[dict[str, str]] | None,
                                                          flags: list[list[str]] | None, difference: str) -> None:
    """The same config, but one rank told another layout (LOCAL_WORLD_SIZE: 1 rank per node, where the other
    has 2) or started with ``--resume`` alone: every rank stops at start-up (exit 2, not a timeout's exit 3)
    with the same error naming the difference, before it writes anything."""
    run = tmp_path / "run"
    errs = _finish(_start_ranks([_common(str(tiny_dataset))] * 2, run, envs=envs, flags=flags))
    for e in errs:
        assert f"disagree on their config and world layout: {difference}" in e, e[-2000:]
        assert "Traceback" not in e, e[-2000:]
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_other_output_dirs_or_overwrite_stop_before_removing(tiny_dataset: Path,
                                                             tmp_path: Path) -> None:
    """``--output-dir run`` from two working directories (the same text, two directories: each rank
    would hold part of every sharded checkpoint), and ``--overwrite`` on rank 0 alone over an
    earlier run: every rank stops at start-up naming the difference, and the earlier run is still
    whole (rank 0 used to remove it first)."""
    earlier = tmp_path / "a" / "run"
    (earlier / "checkpoints" / "step_000000002").mkdir(parents=True)
    (earlier / "checkpoints" / "step_000000002" / "trainer.pt").write_bytes(b"an earlier one")
    (earlier / "metrics.jsonl").write_text('{"step": 2}\n')
    before = sorted(p.relative_to(earlier) for p in earlier.rglob("*"))
    (tmp_path / "b").mkdir()
    other = tmp_path / "b" / "run"
    cases = [([tmp_path / "a", tmp_path / "b"], None,
              f"--output-dir (resolved): rank 0 has '{earlier}', rank 1 has '{other}'"),
             ([tmp_path / "a"] * 2, [["--overwrite"], []],
              "--overwrite: rank 0 has True, rank 1 has False")]
    common = [_common(str(tiny_dataset))] * 2
    for cwds, flags, difference in cases:
        errs = _finish(_start_ranks(common, Path("run"), cwds=cwds, flags=flags))
        for e in errs:
            assert f"disagree on their config and world layout: {difference}" in e, e[-2000:]
            assert "Traceback" not in e, e[-2000:]
        assert sorted(p.relative_to(earlier) for p in earlier.rglob("*")) == before
        assert not (tmp_path / "b" / "run" / "checkpoints").exists()


def test_first_difference_names_the_first_field_and_groups_the_ranks() -> None:
    from recstack.distributed.agreement import first_difference

    same = {"train.batch_size": 64, "dist.sharding": "row_wise"}
    assert first_difference([same, dict(same), dict(same)]) is None
    other = [same, {**same, "dist.sharding": "table_wise"}, same, {"train.batch_size": 32}]
    assert first_difference(other) == "train.batch_size: ranks 0, 1, 2 have 64, rank 3 has 32"
    assert first_difference(other[:3]) == "dist.sharding: ranks 0, 2 have 'row_wise', rank 1 has 'table_wise'"


def _leave_worker(rank: int, world: int, init_file: str, out: str, peer_dies: bool) -> None:
    """Join a gloo job with a subgroup and pending collectives' results, then leave it (``leave_job``) -> writes
    what rank 0 saw to ``out``; with ``peer_dies`` rank 1 ends without leaving."""
    import datetime

    import torch
    import torch.distributed as dist

    from recstack.distributed.agreement import leave_job
    from recstack.errors import PeerFailure

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=5))
    sub = dist.new_group(backend="gloo")
    t = torch.ones(4)
    dist.all_reduce(t, group=sub, async_op=True).wait()
    if peer_dies and rank == 1:
        os._exit(0)
    try:
        leave_job()
        seen = f"left {dist.is_initialized()} {t.tolist()}"
    except PeerFailure as e:
        seen = f"PeerFailure {e}"
    if rank == 0:
        Path(out).write_text(seen)
    os._exit(0)  # (a rank whose peer died holds a broken group: skip its teardown, as the CLI does)


def test_leave_job_tears_every_group_down_together(tmp_path: Path) -> None:
    """A finished rank waits for the others, then destroys every process group (no group is left to the
    interpreter's exit); a peer that ended without leaving makes it a PeerFailure within the timeout."""
    import torch.multiprocessing as mp

    from recstack.distributed.agreement import leave_job

    leave_job()  # outside a job: nothing to do
    out = tmp_path / "seen"
    mp.spawn(_leave_worker, args=(2, str(tmp_path / "init"), str(out), False), nprocs=2, join=True)
    assert out.read_text() == "left False [2.0, 2.0, 2.0, 2.0]"
    t0 = time.time()
    mp.spawn(_leave_worker, args=(2, str(tmp_path / "init2"), str(out), True), nprocs=2, join=True)
    assert out.read_text().startswith("PeerFailure rank 0: the other ranks did not finish"), out.read_text()
    assert time.time() - t0 < 60


def _rank0_worker(rank: int, init_file: str, out: str, mode: str) -> None:
    """Rank ``rank`` of 2 in ``on_rank0`` with dist.timeout_s = 2: rank 0's work takes 3 timeouts (``slow``),
    fails (``fails``) or stops its process, heartbeat thread and all (``stops``) -> what rank 1 saw, in ``out``."""
    import datetime

    import torch.distributed as dist

    from recstack.distributed.agreement import on_rank0

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=2))

    def generate() -> None:
        if mode == "stops":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(6)
        if mode == "fails":
            raise OSError("disk full")

    t0 = time.time()
    try:
        on_rank0(generate, "generate the data", timeout_s=2)
        seen = "done"
    except Exception as e:
        seen = f"{type(e).__name__}: {e}"
    if rank == 1:
        Path(out).write_text(json.dumps({"seen": seen, "waited": time.time() - t0}))
    os._exit(0)  # (a rank whose peer stopped holds a broken group: skip its teardown, as the CLI does)


@pytest.mark.parametrize("mode", ["slow", "fails", "stops"])
def test_ranks_wait_for_rank0_on_heartbeats(tmp_path: Path, mode: str) -> None:
    """While rank 0 generates [data.synth] data the others wait on its heartbeats: longer than dist.timeout_s
    while it works, with its error when it fails, and a PeerFailure within dist.timeout_s when it stops."""
    import multiprocessing

    ctx, out = multiprocessing.get_context("spawn"), tmp_path / "seen.json"
    procs = [ctx.Process(target=_rank0_worker, args=(r, str(tmp_path / "init"), str(out), mode)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        procs[1].join(timeout=60)
        assert procs[1].exitcode == 0, "rank 1 did not finish"
        seen = json.loads(out.read_text())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    if mode == "slow":
        assert seen["seen"] == "done" and seen["waited"] >= 6, seen
    elif mode == "fails":
        assert seen["seen"] == "ValueError: rank 0 could not generate the data: OSError: disk full", seen
    else:
        assert seen["seen"].startswith("PeerFailure: rank 1: rank 0 stopped answering while it was to generate "
                                       "the data (no heartbeat within dist.timeout_s=2 s)"), seen
        assert seen["waited"] < 2 + MARGIN_S, seen


@pytest.mark.parametrize("bad", [0, 1])
def test_a_typo_on_one_rank_stops_the_others_with_its_error(bad: int, tiny_dataset: Path,
                                                            tmp_path: Path) -> None:
    """A config typo on one rank only (its node's file): that rank exits 2 with its one line; the
    others do not wait out the rendezvous (dist.timeout_s=300 here; DistStoreError after it) but
    exit 3 at once with a line naming the rank and its error. Either rank: rank 0 also hosts the
    job's store."""
    common = [*_common(str(tiny_dataset)), "dist.timeout_s=300"]
    per_rank = [common, common]
    per_rank[bad] = [*common, "train.batchsize=64"]
    procs = _start_ranks(per_rank, tmp_path / "run")
    try:
        # a bound on a hang, far below dist.timeout_s
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    good = 1 - bad
    assert procs[bad].returncode == 2 and procs[good].returncode == 3, [e[-2000:] for e in errs]
    typo = "--set train.batchsize=64.train: unknown key 'batchsize'"
    for rank, err in enumerate(errs):
        assert "Traceback" not in err, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("recstack train: error: ")]
        assert len(lines) == 1, err[-3000:]
        want = typo if rank == bad else f"rank {bad} stopped at start-up: {typo}"
        assert want in lines[0], lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
