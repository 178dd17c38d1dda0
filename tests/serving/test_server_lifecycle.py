"""The life of a ``recstack serve`` process: hot swap under load (no failed request while versions switch, a
corrupted version refused), graceful shutdown on SIGTERM with requests in flight, and ``--workers 2``."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from server_helpers import build_artifacts, raw_criteo_rows, recstack, request_rows, running

from recstack.serving.model import ServingModel

ROWS = request_rows(raw_criteo_rows(8, seed=2))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_artifacts(tmp_path_factory.mktemp("lifecycle"))


def offline_scores(model_dir: Path, rows: list[dict]) -> np.ndarray:
    model = ServingModel.load(model_dir)
    with torch.inference_mode():
        return torch.sigmoid(model.score(model.encode(rows)).float()).numpy()


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_hot_swap_under_load(artifacts, tmp_path: Path) -> None:
    models = tmp_path / "models"
    shutil.copytree(artifacts["models"], models)
    answers: list[tuple[int, int | None]] = []  # (status, model version) of every request, in order
    stop = threading.Event()
    with running([str(models), "--watch", str(models), "--watch-interval", "0.2"], tmp_path / "log") as s:
        def load() -> None:  # one client sending back to back, bounded in count
            with httpx.Client(base_url=s.url, timeout=30) as c:
                while not stop.is_set() and len(answers) < 5000:
                    r = c.post("/v1/score", json={"rows": ROWS})
                    answers.append((r.status_code, r.json().get("model_version")))

        client = threading.Thread(target=load)
        client.start()
        try:
            wait_for(lambda: len(answers) >= 5, 30, "the first answers")
            recstack("export", "--checkpoint", str(artifacts["run"]), "--out", str(models), "--tables", "int8")
            wait_for(lambda: answers[-1][1] == 2, 60, "version 2 to be served")
            # Version 3: a copy of 2 with one table byte changed, published atomically as an export would.
            tmp = models / ".3.tmp-test"
            shutil.copytree(models / "2", tmp)
            table = sorted((tmp / "tables").glob("*.npy"))[0]
            data = bytearray(table.read_bytes())
            data[-1] ^= 0xFF
            table.write_bytes(bytes(data))
            tmp.rename(models / "3")
            wait_for(lambda: s.metric("recstack_model_refused_total") >= 1, 30, "version 3 to be refused")
            seen = len(answers)
            wait_for(lambda: len(answers) >= seen + 5, 30, "answers after the refusal")
        finally:
            stop.set()
            client.join(60)
        assert s.client.get("/readyz").json()["model_version"] == 2
        assert s.metric("recstack_model_swaps_total") == 1
        final = s.score({"rows": ROWS}).json()
    statuses = {st for st, _ in answers}
    assert statuses == {200}, f"failed requests during the swap: {statuses}"
    versions = [v for _, v in answers]
    switch = versions.index(2)
    assert set(versions[:switch]) == {1} and set(versions[switch:]) == {2}  # one switch, never back, never 3
    np.testing.assert_allclose(final["scores"], offline_scores(models / "2", ROWS), rtol=0, atol=1e-6)


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


def test_sigterm_finishes_requests_in_flight_and_exits_0(artifacts, tmp_path: Path) -> None:
    with running([str(artifacts["models"])], tmp_path / "log") as s:
        bodies = [json.dumps({"rows": ROWS[i:i + 1]}).encode() for i in range(6)]
        socks = [send_head(s.port, b) for b in bodies]  # six requests received, their bodies half read
        wait_for(lambda: s.metric("recstack_requests_in_flight") == 6, 30, "6 requests in flight")
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        for sock, body in zip(socks, bodies, strict=True):
            sock.sendall(body[len(body) // 2:])
        answers = [answer_of(sock) for sock in socks]
        for sock in socks:
            sock.close()
        assert [status for status, _ in answers] == [200] * 6
        expect = offline_scores(artifacts["models"] / "1", ROWS[:6])
        np.testing.assert_allclose([a["scores"][0] for _, a in answers], expect, rtol=0, atol=1e-6)
        assert s.proc.wait(60) == 0, s.output()


def test_two_workers(artifacts, tmp_path: Path) -> None:
    with running([str(artifacts["models"]), "--workers", "2"], tmp_path / "log") as s:
        wait_for(lambda: s.client.get("/metrics").text.count("recstack_model_version{") == 2, 60,
                 "both workers to load the model")
        with ThreadPoolExecutor(8) as pool:  # fresh connections, so both workers take some
            def one(i: int) -> httpx.Response:
                with httpx.Client(base_url=s.url, timeout=30) as c:
                    return c.post("/v1/score", json={"rows": ROWS[i % 8:i % 8 + 1]})

            answers = list(pool.map(one, range(40)))
        expect = offline_scores(artifacts["models"] / "1", ROWS)
        for i, r in enumerate(answers):
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["scores"], expect[i % 8:i % 8 + 1], rtol=0, atol=1e-6)
        assert s.metric('recstack_requests_total{status="200"}') == 40  # summed over both workers
        code = s.stop()
    assert code == 0, s.output()
