"""Shared fixtures and helpers: a small prepared data set with a learnable click signal and the real Criteo
samples; a small model and a short training run on them (in process, or as a `recstack` command line, also under
torchrun); a training run killed after its N-th checkpoint; a free TCP port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recstack.config import Config, load_config
from recstack.data.batch import Batch
from recstack.data.format import SparseFeatureSpec
from recstack.data.prepared_writer import PreparedWriter

REPO = Path(__file__).resolve().parents[1]
# beside the checkout (../shared/data); RECSTACK_SHARED_DATA names it for a checkout elsewhere (a worktree)
SHARED_DATA = Path(os.environ.get("RECSTACK_SHARED_DATA", REPO.parent / "shared" / "data"))
if str(REPO) not in sys.path:  # the tests of bench/ scripts import them as ``bench.<script>``
    sys.path.insert(0, str(REPO))


RECSTACK = [sys.executable, "-m", "recstack"]  # `recstack` as a user runs it, in this interpreter
# A small model and single-threaded steps: what the training tests on the tiny data set start from.
SMALL = [
    "model.embedding_dim=8",
    "model.bottom_mlp=[32, 8]",
    "model.top_mlp=[32, 1]",
    "train.batch_size=64",
    "train.threads=1",
    "train.progress=false",
    'optim.sparse="rowwise_adagrad"',
]
_CHECKPOINT = re.compile(r"^(ckpt|step)_\d{9}(\.pt)?$")  # single-process files/directories, sharded directories


def torchrun(n: int = 2, *options: str) -> list[str]:
    """The command that starts ``recstack`` on ``n`` local ranks under torchrun, as a user runs it (``options``:
    torchrun's own, such as ``--max-restarts 1``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *options,
            "-m", "recstack"]


def write_tiny_dataset(path: Path, rows: int = 20000, seed: int = 0) -> Path:
    """13 dense + 4 sparse features; the label depends on a dense feature and on one sparse id class."""
    rng = np.random.default_rng(seed)
    sizes = [50, 300, 7, 1000]
    dense = rng.random((rows, 13)).astype(np.float32)
    sparse = np.stack([rng.zipf(1.3, rows) % n for n in sizes], 1)
    logit = 3 * dense[:, 0] - 1.5 + 2.0 * (sparse[:, 0] % 5 == 0)
    prob = 1 / (1 + np.exp(-logit))
    labels = (rng.random(rows) < prob).astype(np.float32)
    specs = [SparseFeatureSpec(f"C{i + 1}", n) for i, n in enumerate(sizes)]
    with PreparedWriter(path, [f"I{i + 1}" for i in range(13)], specs, {"probability": "float32"}) as w:
        w.write(labels, dense, sparse, probability=prob)
    return path


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("tiny") / "data")


@pytest.fixture(scope="session")
def churn_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic stream of raw int64 ids with a third of them replaced each day (what dynamic id tables are
    tested on): 6,000 rows, 3 days, tables of 800, 200 and 30 ids."""
    from recstack.data.synth.generate import SynthConfig, generate

    cfg = SynthConfig(rows=6000, num_dense=2, table_sizes=(800, 200, 30), num_days=3, id_churn=0.3, raw_ids=True,
                      calibration_rows=2048)
    return generate(cfg, tmp_path_factory.mktemp("churn") / "data", progress=False)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "criteo_kaggle_sample.tsv").is_file():
        pytest.skip(f"real Criteo samples not found at {SHARED_DATA}")
    return SHARED_DATA


class StoppedRun(Exception):
    """Raised in place of a training step: the run stops between two steps, as a killed one does."""


def _stop_at(trainer, step: int) -> None:
    """Train ``trainer`` until ``step`` steps are done, then stop it between two steps."""
    train_step = trainer.train_step

    def step_or_stop(batch):
        if trainer.step == step:
            raise StoppedRun
        return train_step(batch)

    trainer.train_step = step_or_stop
    with pytest.raises(StoppedRun):
        trainer.train()


@pytest.fixture
def stop_at():
    """``stop_at(trainer, step)``: train until ``step`` steps are done, then stop between two steps."""
    return _stop_at


def set_options(options: Iterable[str]) -> list[str]:
    """``--set O`` for every config override ``O``."""
    return [arg for o in options for arg in ("--set", o)]


def train_args(out: Path, data: Path | None, options: Iterable[str] = (), *flags: str) -> list[str]:
    """The arguments of ``recstack train`` into ``out`` on the prepared set ``data`` (None: the config's own, such
    as data.synth) with the overrides ``options`` and further ``flags`` (``--resume``, ``--overwrite``)."""
    data_option = [f'data.train="{data}"'] if data is not None else []
    return ["train", "--output-dir", str(out), *set_options([*data_option, *options]), *flags]


def run_cli(args: list[str], *, launcher: list[str] = RECSTACK, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``recstack ARGS`` in a subprocess (``launcher``: how, such as ``torchrun(2)``; ``env``: its environment,
    default this one) -> the finished process, its stdout and stderr captured as text."""
    return subprocess.run([*launcher, *args], env=env, capture_output=True, text=True, timeout=timeout)


def start_cli(args: list[str], *, launcher: list[str] = RECSTACK,
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``recstack ARGS`` in the background: stdout discarded, stderr piped as text."""
    return subprocess.Popen([*launcher, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def cli_train(out: Path, data: Path | None, options: Iterable[str] = (), *flags: str,
              launcher: list[str] = RECSTACK, timeout: float = 300, log: list[str] | None = None) -> dict[str, Any]:
    """A ``recstack train`` run (see ``train_args``) that must succeed -> its summary.json (its stdout is appended
    to ``log`` when given)."""
    res = run_cli(train_args(out, data, options, *flags), launcher=launcher, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    if log is not None:
        log.append(res.stdout)
    return json.loads((out / "summary.json").read_text())


def count_checkpoints(directory: Path) -> int:
    """Complete checkpoints in ``directory`` (ckpt_<step>.pt, ckpt_<step>/, step_<step>/; never a .tmp)."""
    return sum(bool(_CHECKPOINT.match(p.name)) for p in directory.iterdir()) if directory.is_dir() else 0


def kill_after_checkpoints(args: list[str], ckpt_dir: Path, n: int, *, launcher: list[str] = RECSTACK,
                           worker: bool = False, timeout: float = 120) -> subprocess.Popen[str]:
    """Start ``recstack ARGS`` (as ``start_cli``), wait until ``ckpt_dir`` holds ``n`` checkpoints (or the process
    ends, or ``timeout`` seconds pass) and SIGKILL it -> the process, ended (its returncode is -SIGKILL unless it
    finished first). ``worker``: kill the newest child process instead (a torchrun worker, its agent living on:
    the process returned is then still running)."""
    proc = start_cli(args, launcher=launcher)
    deadline = time.time() + timeout
    while count_checkpoints(ckpt_dir) < n and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    if worker:
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert workers and proc.poll() is None, "training ended before a worker could be killed"
        os.kill(int(workers[-1]), signal.SIGKILL)
        return proc
    proc.send_signal(signal.SIGKILL)  # nothing is sent to a process that already ended
    proc.communicate()
    return proc


class Payload:
    """Unpickled unrestricted (``pickle.loads``, ``torch.load(weights_only=False)``), it runs ``touch <marker>``:
    what the crafted-file tests put into the files they craft (the marker file must never appear)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_step(net: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
    """One hand-written training step (no Trainer): the logloss of ``net(batch)``, backward (the embeddings
    update themselves in it), the dense optimizer's step -> the loss, detached."""
    loss = F.binary_cross_entropy_with_logits(net(batch), batch.labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def small_config(data: Path | None, extra: Iterable[str] = (), base: Iterable[str] = SMALL) -> Config:
    """The config of a run on ``data`` (None: no data.train) with the overrides ``base`` then ``extra``."""
    data_option = [f'data.train="{data}"'] if data is not None else []
    return load_config(None, [*data_option, *base, *extra])


def train_steps(data: Path, out: Path | None, extra: Iterable[str] = (), base: Iterable[str] = SMALL) -> dict[str, Any]:
    """A short training run in this process (``extra`` says how short: train.max_steps=...) -> its summary."""
    from recstack.training.trainer import Trainer  # here: collecting the tests of lower layers needs no trainer

    return Trainer(small_config(data, extra, base), out).train()


# A short run that leaves two checkpoints (steps 2 and 4): what the checkpoint fault and security tests damage.
CHECKPOINT_STEPS = ["train.max_steps=4", "train.checkpoint_every=2", "train.batch_size=64", "train.eval_every=0"]


@pytest.fixture(scope="module")
def sharded_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank torchrun run of ``CHECKPOINT_STEPS`` (one per test module)."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    res = run_cli(train_args(run, tiny_dataset, [*SMALL, *CHECKPOINT_STEPS]), launcher=torchrun(2), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def single_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single-process run of ``CHECKPOINT_STEPS`` (one per test module)."""
    run = tmp_path_factory.mktemp("single") / "run"
    train_steps(tiny_dataset, run, CHECKPOINT_STEPS)
    return run


def snapshot_files(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` -> a SHA-256 of its bytes: compare two to see that nothing was added, removed
    or changed (what a refused command must leave)."""
    import hashlib

    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def rank_errors(stderr: str, command: str = "train") -> list[str]:
    """The one-line errors ``recstack COMMAND`` printed on each rank, from the stderr of torchrun (the ranks
    share it and may write at once, so two errors can share a line)."""
    marker = f"recstack {command}: error: "
    return [part.split("\n")[0] for part in stderr.split(marker)[1:]]
