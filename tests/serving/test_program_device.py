"""An exported dense program is device-independent: traced on the CPU, loaded on another device it
holds no operator that still makes tensors on the CPU (a QR model's combine makes an identity row;
``Module.to`` left its ``device=cpu``, so ``serve --device cuda`` failed). ``meta`` stands for the
other device here; the device check (scripts/gpu_check.sh) serves such a model on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recstack.config import Config
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.models.build import build_model
from recstack.serving.export import DenseProgram, export_program
from recstack.serving.model import load_program


def _qr_model(operation: str):  # type: ignore[no-untyped-def]
    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 4, [8, 4], [8, 1]
    cfg.model.qr_collisions, cfg.model.qr_threshold, cfg.model.qr_operation = 4, 10, operation
    return build_model(
        cfg.model,
        sparse_optimizer_config(cfg.optim),
        3,
        [5, 100, 37],
        seed=0,
        names=["a", "b", "c"],
    )


def _devices(gm: torch.nn.Module) -> set[str]:
    """Every device a node of the program's graph names, and its parameters' and buffers'."""
    out = {str(t.device) for t in [*gm.parameters(), *gm.buffers()]}
    for node in gm.graph.nodes:  # type: ignore[union-attr]
        dev = node.kwargs.get("device")
        if dev is not None:
            out.add(str(dev))
    return out


@pytest.mark.parametrize("operation", ["mult"])
def test_a_qr_program_traced_on_the_cpu_moves_whole_to_another_device(
    operation: str, tmp_path: Path
) -> None:
    model = _qr_model(operation).eval()
    path = tmp_path / "dense.pt2"
    export_program(model, path)
    on_cpu = load_program(path, torch.device("cpu"))
    assert "cpu" in _devices(on_cpu)  # the traced program does name a device: the test can see one
    assert _devices(load_program(path, torch.device("meta"))) == {"meta"}
    pooled, dense = torch.randn(6, model.qr.num_split_features, 4), torch.randn(6, 3)
    with torch.no_grad():
        rows = torch.arange(6)  # each row its own dense features
        assert torch.equal(on_cpu(pooled, dense, rows), DenseProgram(model)(pooled, dense))
