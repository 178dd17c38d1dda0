"""``train.autocast = "bf16"`` runs the training step's matrix products in bfloat16 (on the CPU
too, so it is tested here), and ``train.tf32`` sets torch's TF32 switches (they act on a GPU only;
the device check scripts/gpu_check.sh times both)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import train_steps

from recstack.training.step import dense_autocast, set_tf32


def test_bf16_autocast_casts_the_matrix_products_only() -> None:
    lin, emb = torch.nn.Linear(4, 2), torch.nn.EmbeddingBag(5, 4, mode="sum")
    x = torch.randn(3, 4)
    with dense_autocast(torch.device("cpu"), "bf16"):
        assert lin(x).dtype == torch.bfloat16
        assert emb(torch.tensor([[1, 2]])).dtype == torch.float32  # lookups stay fp32
    with dense_autocast(torch.device("cpu"), "none"):
        assert lin(x).dtype == torch.float32


def test_bf16_training_follows_fp32_and_tf32_is_switched(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    steps = ["train.max_steps=40", "train.log_every=40"]
    try:
        fp32 = train_steps(tiny_dataset, tmp_path / "fp32", steps)
        assert not torch.backends.cuda.matmul.allow_tf32
        bf16 = train_steps(
            tiny_dataset, tmp_path / "bf16", [*steps, 'train.autocast="bf16"', "train.tf32=true"]
        )
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        set_tf32(False)
    assert bf16["logloss"] != fp32["logloss"]  # the products did run in bf16
    assert bf16["logloss"] == pytest.approx(fp32["logloss"], abs=0.02)
    assert bf16["auc"] == pytest.approx(fp32["auc"], abs=0.03)
