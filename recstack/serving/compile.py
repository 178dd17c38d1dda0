"""The served dense program as native code: AOTInductor, compiled by the server from the verified program.

An artifact's dense part is a ``torch.export`` program (``model.load_program``): a graph of aten operators run
one by one from Python. At the batch sizes a lone request brings, the per-operator overhead is most of the model
call (batch 1 of the Criteo reference model: 0.17 ms as a graph, 0.08 ms compiled, measured in
docs/serving.md). So the server compiles the program it verified into a shared library with AOTInductor and
calls that instead:

* **no code from the artifact**: the artifact still holds only the graph and its weights (pickle-free, checked
  by ``check_program_pickle_free``); the native code is generated on the serving machine, by its own torch and
  C++ compiler, from that graph;
* **never in the way**: a version is served by its graph from the moment it loads; once it has been served
  ``watch.SETTLE_S`` seconds without a newer one (a trainer publishing every few seconds keeps its versions on
  their graphs instead of compiling each), the compile runs in a child
  process at a lower priority (``python -m recstack.serving.compile``: it holds none of the server's GIL), and
  the compiled program replaces the graph once it is built, loaded and checked to give the graph's outputs
  (within ``ATOL`` / ``RTOL``) on a probe batch. A failure (no compiler, a timeout, a mismatch) is logged once
  and the graph keeps serving;
* **once per program**: packages are cached under ``--compile-cache`` (default ``~/.cache/recstack/compiled``)
  by the sha256 of the program file, the torch version and the device, so a restart, another worker (a file
  lock makes them wait for one compile) or a version with an unchanged dense part load it in milliseconds; the
  ``KEEP`` newest packages are kept.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

if TYPE_CHECKING:
    from recstack.serving.model import ServingModel

log = logging.getLogger("uvicorn.error")
TIMEOUT_S = 900.0  # a compile that takes longer is given up (the graph keeps serving)
KEEP = 8  # compiled packages kept in the cache (a publishing trainer makes a new dense program per version)
ATOL, RTOL = 1e-5, 1e-4  # the compiled program's logits against the graph's on the probe batch
PROBE_ROWS = 5


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "recstack" / "compiled"


def package_key(program: Path, device: torch.device) -> str:
    """The cache name of ``program``'s compiled package: its bytes, this torch, this machine and device."""
    h = hashlib.sha256(program.read_bytes())
    h.update(f"{torch.__version__}|{platform.machine()}|{device.type}".encode())
    return h.hexdigest()[:32]


def example_inputs(ep: torch.export.ExportedProgram, rows: int = 2) -> tuple[torch.Tensor, ...]:
    """Zeros shaped like the program's user inputs, its batch dimension (symbolic) at ``rows``."""
    names = set(ep.graph_signature.user_inputs)
    out = []
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            val = node.meta["val"]
            shape = [rows if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
            out.append(torch.zeros(shape, dtype=val.dtype))
    return tuple(out)


def compile_package(program: Path, out: Path, device: str) -> None:
    """``program`` (a pickle-free ``.pt2``) -> an AOTInductor package at ``out`` (written whole or not at all)."""
    from torch.export.passes import move_to_device_pass

    from recstack.serving.model import check_program_pickle_free

    check_program_pickle_free(program)
    dev = torch.device(device)
    ep = move_to_device_pass(torch.export.load(program), dev)
    ep.example_inputs = (tuple(t.to(dev) for t in example_inputs(ep)), {})
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp.pt2")
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


async def ensure_package(program: Path, device: torch.device, cache: Path, timeout_s: float = TIMEOUT_S) -> Path:
    """The compiled package of ``program`` in ``cache``, compiled by a child process if it is not there yet
    (one compile at a time per package: other processes wait on its lock). Raises ``RuntimeError`` with the
    child's last lines when it fails; cancelled, it kills the child."""
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = await asyncio.to_thread(package_key, program, device)
    out = cache / f"{key}.pt2"
    with open(cache / f"{key}.lock", "w") as lock:
        while True:  # polled, not blocking: a cancelled wait leaves no thread behind
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.2)
        if not out.is_file():
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "recstack.serving.compile", str(program), str(out), "--device", str(device),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            try:
                text, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
            except BaseException:  # a timeout, or the server stopping: the child goes too
                proc.kill()
                await proc.wait()
                raise
            if proc.returncode != 0 or not out.is_file():
                tail = " | ".join(text.decode(errors="replace").strip().splitlines()[-3:])
                raise RuntimeError(f"the compile exited {proc.returncode}: {tail}")
        os.utime(out)  # the newest used: kept by the pruning below
    _prune(cache)
    return out


def _prune(cache: Path) -> None:
    packages = [p for p in cache.glob("*.pt2") if not p.name.startswith(".")]  # not a compile's temporary
    packages.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for p in packages[KEEP:]:
        p.unlink(missing_ok=True)
        p.with_suffix(".lock").unlink(missing_ok=True)


def direct_call(runner: Any, probe: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``runner`` (an ``aoti_load_package`` model) called without its wrapper's work on every call (two tree
    specs parsed from JSON, the inputs flattened, the output unflattened: 20 of a batch-1 call's 80 us,
    measured in docs/serving.md), when the program takes the positional tensors ``probe`` stands for and
    returns one tensor, as the dense program does; ``runner`` itself otherwise."""
    loader = runner.loader
    in_spec, out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
    if pytree.tree_flatten(((*probe,), {}))[1] != in_spec or not out_spec.is_leaf():
        return runner

    def call(*args: torch.Tensor) -> torch.Tensor:
        return loader.boxed_run(list(args))[0]

    return call


def load_checked(package: Path, model: ServingModel) -> Callable[..., torch.Tensor]:
    """The compiled program of ``package``, after it gave the graph's logits on a probe batch of ``model``'s
    input shapes (random values; random rows for the integer ``dense_row``); a ``RuntimeError`` naming the
    difference when it does not."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        probe = [(torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point()
                  else torch.randint(0, PROBE_ROWS, t.shape, generator=g)).to(model.device)  # dense_row: rows
                 for t in model.probe_inputs(PROBE_ROWS)]
        runner = direct_call(torch._inductor.aoti_load_package(str(package)), probe)
        want, got = model.graph_forward(*probe).float(), runner(*probe).float()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        diff = (got - want).abs().max().item() if got.shape == want.shape else f"shape {list(got.shape)}"
        raise RuntimeError(f"the compiled program differs from the graph on a probe batch ({diff})")
    return runner


@dataclass
class CompileSpec:
    """``recstack serve --compile``: ``mode`` aoti or none; where packages are cached."""

    mode: str = "aoti"
    cache: str = ""  # empty: default_cache()


class DenseCompiler:
    """Follows the served model (``watch.ModelHolder``) and gives each version its compiled dense program."""

    def __init__(self, spec: CompileSpec, on_compiled: Callable[[ServingModel], None]) -> None:
        self.cache = Path(spec.cache) if spec.cache else default_cache()
        self.on_compiled = on_compiled
        self.failed: set[str] = set()  # programs whose compile failed: not tried again, logged once

    async def compile(self, model: ServingModel) -> None:
        """Compile ``model``'s program in a child process, load it, check it, switch ``model`` to it."""
        program = model.program_path
        if str(program) in self.failed:
            return
        start = time.monotonic()
        try:
            package = await ensure_package(program, model.device, self.cache)
            runner = await asyncio.to_thread(load_checked, package, model)
        except Exception as e:  # noqa: BLE001 (any failure leaves the graph serving)
            self.failed.add(str(program))
            log.warning("recstack serve: model version %s keeps its graph, compiling it failed: %s: %s",
                        model.version, type(e).__name__, e)
            return
        model.use_compiled(runner)
        self.on_compiled(model)
        log.info("recstack serve [pid %d]: model version %s runs its compiled dense program (%s, %.1f s)",
                 os.getpid(), model.version, package, time.monotonic() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m recstack.serving.compile",
                                description="compile a served dense program with AOTInductor")
    p.add_argument("program", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    os.nice(10)  # the compile yields the cores to the server's requests
    torch.set_num_threads(1)
    compile_package(a.program, a.out, a.device)


if __name__ == "__main__":
    main()
