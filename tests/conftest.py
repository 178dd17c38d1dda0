"""Shared fixtures: a small prepared data set with a learnable click signal, and the real Criteo samples; the
torchrun command the distributed tests start."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from recstack.data.format import PreparedWriter, SparseFeatureSpec

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
if str(REPO) not in sys.path:  # the tests of bench/ scripts import them as ``bench.<script>``
    sys.path.insert(0, str(REPO))


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
