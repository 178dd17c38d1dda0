"""The steps of the device check (``scripts/gpu_check.sh`` runs each in its own bounded process):

    python3 scripts/gpu_check.py STEP --device cuda|cpu --work DIR --out DIR

Each step appends one JSON line ``{"step": STEP, "status": "pass" | "fail", ...numbers}`` to
``OUT/results.jsonl`` (``result_line``); what it makes (data, runs, artifacts, logs) stays under
``--work``. With ``--device cpu`` every step runs the same code and the same assertions on the CPU
(the rehearsal): the CPU-against-device comparisons then compare the CPU with itself, and CUDA-only
numbers (syncs, GPU memory) are null. The steps of training runs and serving are in
``gpu_check_runs.py``; docs/gpu.md says what each step proves.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

if TYPE_CHECKING:
    import torch

started = time.monotonic()  # a step's seconds count from here (its process's own start)

MAX_OUT_FILES = 8  # what comes back from a device machine's $OUT
# The tests that need CUDA (they skip without it; on the CPU the rest of each file runs).
CUDA_TESTS = [
    "tests/distributed/test_device_placement.py",
    "tests/training/test_fused_optimizer.py",
    "tests/serving/test_program_device.py",
    "tests/training/test_precision.py",
    "tests/compression/test_compression.py::test_cuda_tensors_stay_on_the_device",
    "tests/training/test_train.py::test_eval_and_predict_device",
]
# CPU against device: max |difference| of losses, weights and decoded payloads (fp32 math)
STEP_BOUND = 1e-4


def result_line(out: Path, step: str, ok: bool, **numbers: Any) -> dict[str, Any]:
    """Append ``{"step", "status", ...numbers}`` as one line to ``out/results.jsonl`` (the only
    file a step writes to ``out``) -> the record. Floats, also nested ones, are rounded to 6
    significant digits."""
    rec = {"step": step, "status": "pass" if ok else "fail", **_rounded(numbers)}
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


def out_files(out: Path) -> list[Path]:
    """Every file under ``out`` (what a device call brings back: at most ``MAX_OUT_FILES``)."""
    return sorted(p for p in out.rglob("*") if p.is_file())


def device_of(name: str) -> torch.device:
    import torch

    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {name}: no CUDA device here (torch {torch.__version__})")
    return torch.device(name)


class Timer:
    """Seconds of device work between ``start`` and ``stop``: CUDA events on a GPU
    (``perf_counter`` around asynchronous work would measure launches), the wall clock on the CPU.
    """

    def __init__(self, device: torch.device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        if self.cuda:
            self.a, self.b = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )

    def start(self) -> None:
        if self.cuda:
            self.a.record()
        else:
            import time

            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b) / 1e3
        import time

        return time.perf_counter() - self.t0


# -- steps ------------------------------------------------------------------------------------
def step_env(a: argparse.Namespace) -> dict[str, Any]:
    """The machine: Python, torch, the device, the C extension, the carried packages."""
    import torch

    from recstack.compression.eb import native

    mods = {}
    for name in ("zstandard", "uvicorn", "starlette", "msgspec", "prometheus_client", "httpx", "pyarrow"):
        try:
            mods[name] = getattr(__import__(name), "__version__", "?")
        except ImportError:
            mods[name] = None
    dev = device_of(a.device)
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor(),
        "c_extension": native.available(),
        "packages": mods,
    }
    return {"ok": all(v is not None for v in mods.values()), **info}


def step_cuda_tests(a: argparse.Namespace) -> dict[str, Any]:
    """The tests that need CUDA, with pytest (the rest of their files too)."""
    xml = a.work / "cuda_tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        *CUDA_TESTS,
    ]
    log = a.work / "cuda_tests.log"
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"ok": rc == 0 and n["failures"] + n["errors"] == 0 and n["tests"] > 0, **n}


def _embedding_update(dev: torch.device, steps: int = 5) -> torch.Tensor:
    """A fused collection (row-wise Adagrad) after ``steps`` updates of fixed ids and gradients."""
    import torch

    from recstack.data.batch import SparseFeatures
    from recstack.embedding.collection import TableConfig
    from recstack.embedding.fused import FusedEmbeddingBagCollection
    from recstack.embedding.sparse_optim import SparseOptimizerConfig

    tables = [TableConfig("a", 1000, 16, (0,)), TableConfig("b", 50, 16, (1,))]
    torch.manual_seed(0)
    coll = FusedEmbeddingBagCollection(
        tables, SparseOptimizerConfig("rowwise_adagrad", 0.1), device=dev
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.stack([torch.randint(0, n, (256,), generator=gen) for n in (1000, 50)], 1)
        grad = torch.randn(256, 2, 16, generator=gen)
        out = coll(SparseFeatures.from_dense_ids(ids).to(dev))  # [B, F, D]
        out.backward(grad.to(dev))
    return coll.weight.detach().cpu()


def _codec_payloads(dev: torch.device) -> dict[str, tuple[float, float]]:
    """Every codec: (fraction of payload bytes equal to the CPU's, max |decoded - CPU decoded|)."""
    from typing import get_args

    import torch

    from recstack.compression.registry import get_codec
    from recstack.distributed.config import Codec

    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(2)) * 0.1
    out = {}
    for name in get_args(Codec):
        codec = get_codec(name)
        ref, got = codec.encode(x), codec.encode(x.to(dev))
        same = float((ref == got.cpu()).float().mean()) if ref.numel() == got.numel() else 0.0
        diff = float(
            (codec.decode(ref, tuple(x.shape)) - codec.decode(got, tuple(x.shape)).cpu())
            .abs()
            .max()
        )
        out[name] = (same, diff)
    return out


def _model_losses(dev: torch.device, steps: int = 20) -> list[float]:
    """The loss trace of a small DLRM (Adam dense, row-wise Adagrad tables) on fixed batches."""
    import torch

    from recstack.config import Config
    from recstack.data.batch import Batch, SparseFeatures
    from recstack.embedding.sparse_optim import sparse_optimizer_config
    from recstack.models.build import build_model
    from recstack.training.step import build_dense_optimizer, optimizer_step

    cfg = Config()
    cfg.model.embedding_dim, cfg.model.bottom_mlp, cfg.model.top_mlp = 16, [64, 16], [64, 1]
    cfg.optim.dense, cfg.optim.dense_lr = "adam", 0.01
    sizes = [50, 300, 7, 1000]
    torch.manual_seed(0)  # the dense layers draw from the global generator
    model = build_model(
        cfg.model, sparse_optimizer_config(cfg.optim), 13, sizes, seed=0, device=dev
    )
    opt = build_dense_optimizer(cfg.optim, model.dense_parameters())
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        ids = torch.stack([torch.randint(0, n, (512,), generator=gen) for n in sizes], 1)
        batch = Batch(
            torch.rand(512, 13, generator=gen),
            SparseFeatures.from_dense_ids(ids),
            (torch.rand(512, generator=gen) < 0.3).float(),
        )

        def loss_fn(b: Batch) -> torch.Tensor:
            return torch.nn.functional.binary_cross_entropy_with_logits(model(b), b.labels)

        losses.append(optimizer_step(loss_fn, opt, batch, dev))
    return losses


def step_parity(a: argparse.Namespace) -> dict[str, Any]:
    """CPU against the device (TF32 off): the embedding update, every codec's payload, a model's
    loss trace."""
    import numpy as np
    import torch

    from recstack.training.step import set_tf32

    dev = device_of(a.device)
    set_tf32(False)
    cpu = torch.device("cpu")
    cpu_emb, cpu_losses = _embedding_update(cpu), _model_losses(cpu)  # the references, once
    same = dev == cpu  # the rehearsal: the device's results are the references
    emb = float((cpu_emb - (cpu_emb if same else _embedding_update(dev))).abs().max())
    codecs = _codec_payloads(dev)
    dev_losses = cpu_losses if same else _model_losses(dev)
    loss = float(np.abs(np.array(cpu_losses) - np.array(dev_losses)).max())
    codec_ok = all(d <= STEP_BOUND for _, d in codecs.values())
    return {
        "ok": emb <= STEP_BOUND and loss <= STEP_BOUND and codec_ok,
        "bound": STEP_BOUND,
        "embedding_update_max_diff": emb,
        "loss_trace_max_diff": loss,
        "final_loss": dev_losses[-1],
        "codecs": {
            k: {"bytes_equal": round(s, 4), "decoded_max_diff": float(f"{d:.3g}")}
            for k, (s, d) in codecs.items()
        },
    }


# gpu_check.sh's order
STEPS = ("env", "parity", "cuda_tests", "two_ranks", "tiers", "serve", "throughput")


def steps() -> dict[str, Callable[[argparse.Namespace], dict[str, Any]]]:
    from gpu_check_runs import RUN_STEPS

    return {"env": step_env, "cuda_tests": step_cuda_tests, "parity": step_parity, **RUN_STEPS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "step", help="a step name, or 'record NAME WHY': a fail line for a step that wrote none"
    )
    p.add_argument("rest", nargs="*")
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"))
    p.add_argument("--out", type=Path, default=Path("/tmp/gpu_check_out"))
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    # the shell's line for a step that was killed or crashed before writing its own
    if a.step == "record":
        result_line(a.out, a.rest[0], False, error=" ".join(a.rest[1:]))
        return 1
    if a.step not in STEPS:
        result_line(a.out, a.step, False, error=f"unknown step (the steps: {', '.join(STEPS)})")
        return 1
    try:
        res = steps()[a.step](a)
    except Exception as e:  # the step failed: its line says why (the traceback goes to the log)
        traceback.print_exc()
        result_line(a.out, a.step, False, error=f"{type(e).__name__}: {e}"[:500])
        return 1
    ok = bool(res.pop("ok"))
    res["seconds"] = time.monotonic() - started  # the step's own time, its imports included
    print(json.dumps(result_line(a.out, a.step, ok, **res)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
