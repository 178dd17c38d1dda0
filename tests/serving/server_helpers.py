"""Real artifacts and real server processes for the server tests: a tiny model trained by ``recstack train`` on
a raw Criteo TSV prepared by ``recstack data prepare``, exported by ``recstack export``, served by
``python -m recstack serve`` on a free port of 127.0.0.1 and stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
[data]
train = "{data}"
eval_fraction = 0.0
[model]
embedding_dim = 4
bottom_mlp = [8, 4]
top_mlp = [8, 1]
interaction = "dot"
[optim]
dense = "sgd"
dense_lr = 0.1
sparse = "sgd"
sparse_lr = 0.1
[train]
batch_size = 64
epochs = 1
log_every = 1000
eval_every = 100000
checkpoint_every = 100000
progress = false
"""


def recstack(*args: str, timeout: float = 240) -> str:
    """Run ``python -m recstack ARGS`` -> stdout; raises with its stderr when it fails."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "recstack", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"recstack {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def raw_criteo_rows(n: int, seed: int) -> list[list[str]]:
    """Criteo Kaggle TSV fields [label, I1..I13, C1..C26] with a few values per category (some empty)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dense = ["" if rng.random() < 0.1 else str(int(rng.integers(0, 50))) for _ in range(13)]
        cats = ["" if rng.random() < 0.05 else f"{int(rng.integers(0, 6 + 2 * j)):08x}" for j in range(26)]
        out.append([str(int(rng.random() < 0.3)), *dense, *cats])
    return out


def request_rows(fields: list[list[str]]) -> list[dict]:
    """TSV fields -> request rows named as in the data (I1..I13 integers, C1..C26 hex strings; empty -> null)."""
    rows = []
    for f in fields:
        row: dict = {f"I{j + 1}": int(v) if v else None for j, v in enumerate(f[1:14])}
        row.update({f"C{j + 1}": v or None for j, v in enumerate(f[14:40])})
        rows.append(row)
    return rows


def build_artifacts(tmp: Path) -> dict[str, Path]:
    """raw TSV -> prepared data -> trained run -> exported versions directory (version 1).
    -> {"raw", "run", "models"} paths."""
    raw = tmp / "train.tsv"
    raw.write_text("".join("\t".join(f) + "\n" for f in raw_criteo_rows(512, seed=0)))
    recstack("data", "prepare", str(raw), "--out", str(tmp / "data"), "--vocab-min-freq", "2")
    (tmp / "tiny.toml").write_text(CONFIG.format(data=tmp / "data"))
    recstack("train", "--config", str(tmp / "tiny.toml"), "--output-dir", str(tmp / "run"))
    models = tmp / "models"
    models.mkdir()
    recstack("export", "--checkpoint", str(tmp / "run"), "--out", str(models))
    return {"raw": raw, "run": tmp / "run", "models": models}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running ``recstack serve``: ``url``, ``proc``, ``client`` (httpx), ``stop()`` -> exit code."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self._log = open(log, "wb")  # noqa: SIM115 (closed by stop)
        if "--compile" not in args:  # the graph: compiling has its own tests (test_compile.py)
            args = [*args, "--compile", "none"]
        self.proc = subprocess.Popen([sys.executable, "-m", "recstack", "serve", *args, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def score(self, body: dict) -> httpx.Response:
        return self.client.post("/v1/score", json=body)

    def metric(self, name: str) -> float:
        """The summed value of every series of ``name`` in /metrics (0 when absent)."""
        total = 0.0
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, timeout: float = 60) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def send_head(port: int, body: bytes) -> socket.socket:
    """A connection on which a scoring request's headers and the first half of its body have been sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:len(body) // 2])
    return sock


def answer_of(sock: socket.socket) -> tuple[int, dict]:
    """Read one HTTP response (the server closes the connection after it, or it has a Content-Length)."""
    data = b""
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = [int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")]
            if length and len(rest) >= length[0]:
                return int(head.split(b" ")[1]), json.loads(rest[:length[0]])
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed after {data!r:.300}")
        data += chunk


@contextmanager
def running(args: list[str], log: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(args, log)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One build_artifacts for every test module that imports this fixture and only reads the artifacts."""
    return build_artifacts(tmp_path_factory.mktemp("shared_artifacts"))
