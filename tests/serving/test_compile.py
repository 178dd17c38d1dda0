"""``recstack serve --compile aoti``: a served version switches from its exported graph to the program compiled
from it (AOTInductor, in a child process), scores as offline before and after, reuses the cache on a restart;
a compiled program that differs from the graph, or a compile that fails, leaves the graph serving."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from server_helpers import raw_criteo_rows, request_rows, running, shared_artifacts  # noqa: F401 (a fixture)

from recstack.serving.compile import CompileSpec, DenseCompiler, ensure_package, load_checked
from recstack.serving.model import ServingModel

ROWS = request_rows(raw_criteo_rows(24, seed=3))


def offline(model: ServingModel, rows: list[dict]) -> np.ndarray:
    with torch.inference_mode():
        return torch.sigmoid(model.score(model.encode(rows))).numpy()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compiled")


def wait_compiled(server, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("recstack_model_compiled") != 1:
        assert server.proc.poll() is None, server.output()
        assert "compiling it failed" not in server.output(), server.output()
        assert time.monotonic() < deadline, f"not compiled after {timeout} s:\n{server.output()}"
        time.sleep(0.5)


def test_a_served_version_switches_to_its_compiled_program(shared_artifacts, cache, tmp_path) -> None:  # noqa: F811
    models = shared_artifacts["models"]
    want = offline(ServingModel.load(models / "1"), ROWS)
    args = [str(models), "--compile", "aoti", "--compile-cache", str(cache)]
    with running(args, tmp_path / "first.log") as server:
        before = np.array(server.score({"rows": ROWS}).json()["scores"])  # the graph, or already compiled
        wait_compiled(server)
        after = server.score({"rows": ROWS}).json()
        assert after["model_version"] == 1
        assert "runs its compiled dense program" in server.output()
    np.testing.assert_allclose(before, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(after["scores"]), want, rtol=0, atol=1e-5)
    assert len(list(cache.glob("*.pt2"))) == 1
    # A restart finds the package in the cache: compiled within seconds, nothing compiled again.
    with running(args, tmp_path / "second.log") as server:
        start = time.monotonic()
        wait_compiled(server, timeout=60)
        assert time.monotonic() - start < 30
        np.testing.assert_allclose(np.array(server.score({"rows": ROWS}).json()["scores"]), want, rtol=0, atol=1e-5)
    assert len(list(cache.glob("*.pt2"))) == 1


def test_the_compiled_program_is_called_through_its_loader(shared_artifacts, cache) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    package = asyncio.run(ensure_package(model.program_path, model.device, cache))
    wrapped = torch._inductor.aoti_load_package(str(package))
    runner = load_checked(package, model)
    assert runner is not wrapped  # direct_call: the loader's boxed_run, not the wrapper's __call__
    user = {k: v for k, v in ROWS[0].items() if k.startswith("I") or int(k[1:]) <= 13}
    for batch in (model.encode(ROWS), model.encode_candidates(user, [{k: v for k, v in r.items() if k not in user}
                                                                      for r in ROWS])):
        with torch.inference_mode():
            args = (model.collection(batch.sparse, True), batch.dense, batch.dense_rows())
            assert torch.equal(runner(*args), wrapped(*args))
            np.testing.assert_allclose(runner(*args).numpy(), model.graph_forward(*args).numpy(), rtol=0, atol=1e-5)


def test_a_compiled_program_that_differs_from_the_graph_is_refused(shared_artifacts, cache) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    package = asyncio.run(ensure_package(model.program_path, model.device, cache))
    load_checked(package, model)  # the same program: accepted
    with torch.no_grad():  # now the graph's last bias differs from the one compiled in
        dict(model.program.named_parameters())["top.2.bias"].add_(0.5)
    with pytest.raises(RuntimeError, match="differs from the graph on a probe batch"):
        load_checked(package, model)


def test_a_failed_compile_leaves_the_graph_serving(shared_artifacts, tmp_path, monkeypatch, caplog) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    monkeypatch.setenv("CXX", "/bin/false")  # inductor's C++ compiler, in the compile's child process
    seen: list[ServingModel] = []
    compiler = DenseCompiler(CompileSpec("aoti", str(tmp_path / "cache")), seen.append)
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        asyncio.run(compiler.compile(model))
        asyncio.run(compiler.compile(model))  # not tried again
    assert not model.compiled and not seen
    failures = [r for r in caplog.records if "compiling it failed" in r.getMessage()]
    assert len(failures) == 1
    np.testing.assert_allclose(offline(model, ROWS), offline(ServingModel.load(model.path), ROWS), rtol=0, atol=0)
