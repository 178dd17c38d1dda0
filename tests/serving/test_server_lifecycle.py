"""The life of a ``recstack serve`` process: hot swap under load (no failed request while versions switch, a
corrupted version refused), graceful shutdown on SIGTERM with requests in flight, and ``--workers 2``."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from server_helpers import (  # noqa: F401 (shared_artifacts: a fixture)
    answer_of,
    raw_criteo_rows,
    recstack,
    request_rows,
    running,
    send_head,
    shared_artifacts,
)

from recstack.serving.model import ServingModel

ROWS = request_rows(raw_criteo_rows(8, seed=2))


@pytest.fixture(scope="module")
def artifacts(shared_artifacts) -> dict[str, Path]:  # noqa: F811
    return shared_artifacts


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


def test_sigterm_drains_answering_requests_in_flight_and_exits_0(artifacts, tmp_path: Path) -> None:
    with running([str(artifacts["models"])], tmp_path / "log") as s:
        bodies = [json.dumps({"rows": ROWS[i:i + 1]}).encode() for i in range(6)]
        socks = [send_head(s.port, b) for b in bodies]  # six requests received, their bodies half read
        wait_for(lambda: s.metric("recstack_requests_in_flight") == 6, 30, "6 requests in flight")
        s.proc.send_signal(signal.SIGTERM)
        # Draining: still accepting and answering, but no longer ready.
        wait_for(lambda: httpx.get(s.url + "/readyz").status_code == 503, 30, "/readyz to turn 503")
        assert httpx.get(s.url + "/readyz").json() == {"status": "draining"}
        for sock, body in zip(socks, bodies, strict=True):
            sock.sendall(body[len(body) // 2:])
        answers = [answer_of(sock) for sock in socks]
        for sock in socks:
            sock.close()
        assert [status for status, _ in answers] == [200] * 6
        expect = offline_scores(artifacts["models"] / "1", ROWS[:6])
        np.testing.assert_allclose([a["scores"][0] for _, a in answers], expect, rtol=0, atol=1e-6)
        assert s.proc.wait(60) == 0, s.output()
    assert "draining (6 requests in flight)" in s.output()


def test_sigterm_under_keep_alive_load_answers_every_request_sent(artifacts, tmp_path: Path) -> None:
    """16 clients sending back to back on keep-alive connections: after SIGTERM each gets its answers (the
    last one says Connection: close, and the client stops) and no request it sent goes unanswered."""
    sent: list[int] = []
    failures: list[str] = []
    with running([str(artifacts["models"]), "--drain-timeout", "20"], tmp_path / "log") as s:
        def client() -> None:
            with httpx.Client(base_url=s.url, timeout=30) as c:
                for _ in range(2000):
                    try:
                        r = c.post("/v1/score", json={"rows": ROWS[:2]})
                    except httpx.HTTPError as e:
                        failures.append(f"{type(e).__name__}: {e}")
                        return
                    sent.append(r.status_code)
                    if r.headers.get("connection") == "close":
                        return

        threads = [threading.Thread(target=client) for _ in range(16)]
        for t in threads:
            t.start()
        wait_for(lambda: len(sent) >= 64, 60, "requests under way")
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(90)
        assert s.proc.wait(60) == 0, s.output()
    assert not failures, failures[:3]
    assert set(sent) == {200} and len(sent) >= 64 + 16


def test_a_stalled_body_gets_408_and_does_not_delay_shutdown(artifacts, tmp_path: Path) -> None:
    with running([str(artifacts["models"]), "--body-timeout", "2"], tmp_path / "log") as s:
        body = json.dumps({"rows": ROWS[:1]}).encode()
        stalled = send_head(s.port, body)  # and nothing more
        status, out = answer_of(stalled)
        assert status == 408 and out["field"] == "body", out
        assert s.metric('recstack_requests_total{status="408"}') == 1
        stalled.close()
        again = send_head(s.port, body)
        wait_for(lambda: s.metric("recstack_requests_in_flight") == 1, 30, "the stalled request in flight")
        s.proc.send_signal(signal.SIGTERM)
        assert answer_of(again)[0] == 408
        again.close()
        assert s.proc.wait(20) == 0, s.output()  # within the body timeout, not uvicorn's 30 s


def _copy_version(models: Path, src: int, dst: int, manifest_version: int) -> None:
    """Publish models/<dst> as a copy of models/<src> whose manifest says ``manifest_version``."""
    tmp = models / f".{dst}.tmp-test"
    shutil.copytree(models / str(src), tmp)
    m = json.loads((tmp / "manifest.json").read_text())
    m["version"] = manifest_version
    (tmp / "manifest.json").write_text(json.dumps(m))
    tmp.rename(models / str(dst))


def test_watcher_refuses_a_misnumbered_directory_once_and_no_refusal_blocks_newer(artifacts,
                                                                                  tmp_path: Path) -> None:
    models = tmp_path / "models"
    shutil.copytree(artifacts["models"], models)
    with running([str(models), "--watch", str(models), "--watch-interval", "0.1"], tmp_path / "log") as s:
        shutil.copytree(models / "1", models / "2")  # cp -r models/1 models/2: its manifest says 1
        wait_for(lambda: s.metric("recstack_model_refused_total") >= 1, 30, "models/2 to be refused")
        time.sleep(1.0)  # ten more polls
        assert s.metric("recstack_model_refused_total") == 1
        assert s.metric("recstack_model_swaps_total") == 0
        assert s.output().count("but the directory says 2") == 1
        _copy_version(models, 1, 9, 9)  # version 9, one table byte changed: refused
        table = sorted((models / "9" / "tables").glob("*.npy"))[0]
        data = bytearray(table.read_bytes())
        data[-1] ^= 0xFF
        table.write_bytes(bytes(data))
        wait_for(lambda: s.metric("recstack_model_refused_total") >= 2, 30, "models/9 to be refused")
        _copy_version(models, 1, 5, 5)  # older than the refused 9, newer than the one served: served
        wait_for(lambda: s.client.get("/readyz").json().get("model_version") == 5, 30, "version 5 to be served")
        time.sleep(0.5)
        assert s.metric("recstack_model_refused_total") == 2
        assert s.score({"rows": ROWS}).json()["model_version"] == 5
    log = s.output()
    assert f"switched from model version 1 to version 5 ({(models / '5').resolve()})" in log
    assert f"serving model version 1 ({(models / '1').resolve()})" in log


def test_table_files_changed_under_a_running_server_change_nothing(artifacts, tmp_path: Path) -> None:
    """The served arrays were read (and checked) into memory: truncating or rewriting the files in place
    neither crashes the server (no SIGBUS from a mapped page) nor changes a score."""
    models = tmp_path / "models"
    shutil.copytree(artifacts["models"], models)
    with running([str(models / "1")], tmp_path / "log") as s:
        before = s.score({"rows": ROWS}).json()["scores"]
        arrays = sorted((models / "1").rglob("*.npy"))
        assert len(arrays) >= 2  # the table file and the vocabulary's keys
        for f in arrays:
            with open(f, "r+b") as fh:
                fh.truncate(0)
        r = s.score({"rows": ROWS})
        assert r.status_code == 200, r.text
        assert r.json()["scores"] == before
        assert s.proc.poll() is None
        code = s.stop()
    assert code == 0, s.output()


def test_two_workers(artifacts, tmp_path: Path) -> None:
    with running([str(artifacts["models"]), "--workers", "2"], tmp_path / "log") as s:
        wait_for(lambda: s.output().count("serving model version 1") == 2, 60, "both workers to log their model")
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
