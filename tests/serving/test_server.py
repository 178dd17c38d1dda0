"""``recstack serve`` as users run it: real exported models, real server processes on 127.0.0.1, a real HTTP
client. Scores equal the offline ``ServingModel``'s; bad requests get 400/413 naming the field and change
nothing for others; concurrent requests are batched yet each gets its own answer."""

from __future__ import annotations

import json
import socket
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
    request_rows,
    running,
    send_head,
    shared_artifacts,
)

from recstack.serving.model import ServingModel


@pytest.fixture(scope="module")
def artifacts(shared_artifacts) -> dict[str, Path]:  # noqa: F811
    return shared_artifacts


@pytest.fixture(scope="module")
def server(artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    # A long batching window, so that concurrent requests surely share model calls.
    log = tmp_path_factory.mktemp("log") / "server.log"
    with running([str(artifacts["models"]), "--max-wait-us", "20000", "--max-rows", "64",
                  "--max-body-bytes", "65536"], log) as s:
        yield s


def offline(artifacts: dict[str, Path], rows: list[dict], shared: dict | None = None) -> tuple[np.ndarray, ...]:
    """(probabilities, logits) of the offline ServingModel of version 1."""
    model = ServingModel.load(artifacts["models"] / "1")
    batch = model.encode(rows) if shared is None else model.encode_candidates(shared, rows)
    with torch.inference_mode():
        logits = model.score(batch).float()
    return torch.sigmoid(logits).numpy(), logits.numpy()


ROWS = request_rows(raw_criteo_rows(40, seed=1))
for _row in ROWS[::4]:
    _row["C3"] = "abcdef12"  # a category the training data never had: out of vocabulary


def test_served_scores_equal_offline_scores(server, artifacts) -> None:
    assert server.client.get("/healthz").status_code == 200
    assert server.client.get("/readyz").json() == {"status": "ready", "model_version": 1}
    r = server.score({"rows": ROWS, "return_logit": True})
    assert r.status_code == 200, r.text
    out = r.json()
    prob, logits = offline(artifacts, ROWS)
    assert out["model_version"] == 1
    np.testing.assert_allclose(out["scores"], prob, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["logits"], logits, rtol=0, atol=1e-5)
    assert "logits" not in server.score({"rows": ROWS[:2]}).json()


def test_one_user_many_candidates(server, artifacts) -> None:
    user = {k: v for k, v in ROWS[0].items() if k in ("I1", "I2", "C1", "C2")}
    candidates = [{k: v for k, v in row.items() if k not in user} for row in ROWS[:20]]
    r = server.score({"shared": user, "candidates": candidates})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["scores"], offline(artifacts, candidates, user)[0], rtol=0, atol=1e-6)
    merged = [{**user, **c} for c in candidates]  # the same rows sent whole
    np.testing.assert_allclose(r.json()["scores"], server.score({"rows": merged}).json()["scores"], atol=1e-6)


def test_one_users_dense_features_scored_once_as_the_whole_rows(server, artifacts) -> None:
    # bench/serving_http.py's request: every dense feature shared, read once and through the bottom MLP once
    model = ServingModel.load(artifacts["models"] / "1")
    user = {k: v for k, v in ROWS[0].items() if k.startswith("I") or int(k[1:]) <= 13}
    candidates = [{k: v for k, v in row.items() if k not in user} for row in ROWS[:40]]
    assert model.encode_candidates(user, candidates).dense.shape == (1, 13)
    merged = [{**user, **c} for c in candidates]
    for encoded in (False, True):
        batch = model.encode(merged)
        if encoded:  # the same rows as prepared values and ids
            ids = batch.sparse.ids.view(26, len(merged))
            merged = [{**{f"I{j + 1}": float(batch.dense[i, j]) for j in range(13)},
                       **{f"C{f + 1}": int(ids[f, i]) for f in range(26)}} for i in range(len(merged))]
            user = {k: merged[0][k] for k in user}
            candidates = [{k: v for k, v in row.items() if k not in user} for row in merged]
        r = server.score({"shared": user, "candidates": candidates, "encoded": encoded, "return_logit": True})
        assert r.status_code == 200, r.text
        with torch.inference_mode():  # the offline scores of the whole rows
            want = model.score(model.encode(merged, ids=encoded)).numpy()
        np.testing.assert_allclose(r.json()["logits"], want, rtol=0, atol=1e-5)


def test_concurrent_requests_each_get_their_own_scores(server, artifacts) -> None:
    batches_before = server.metric("recstack_batch_rows_count")
    requests = [ROWS[i:i + 1 + i % 5] for i in range(12)]
    bodies = [json.dumps({"rows": rows}).encode() for rows in requests]
    socks = [send_head(server.port, b) for b in bodies]  # twelve requests received, their bodies half read
    try:
        for _ in range(300):
            if server.metric("recstack_requests_in_flight") == len(socks):
                break
            time.sleep(0.1)
        for sock, body in zip(socks, bodies, strict=True):
            sock.sendall(body[len(body) // 2:])
        answers = [answer_of(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    for rows, (status, out) in zip(requests, answers, strict=True):
        assert status == 200, out
        np.testing.assert_allclose(out["scores"], offline(artifacts, rows)[0], rtol=0, atol=1e-6)
    calls = server.metric("recstack_batch_rows_count") - batches_before
    assert 1 <= calls < len(requests)  # batched: fewer model calls than requests


def _body(change: str, field: str = "", value=None, row: int = 0) -> bytes:
    """Two good rows with one change: "set" rows[row][field] = value, "drop" field of rows[row]."""
    rows = [dict(r) for r in ROWS[:2]]
    if change == "set":
        rows[row][field] = value
    else:
        del rows[row][field]
    return json.dumps({"rows": rows}).encode()


def _candidates(shared: object, candidates: list) -> bytes:
    return json.dumps({"shared": shared, "candidates": candidates}).encode()


_USER = {k: ROWS[0][k] for k in ("I1", "C1")}
_CANDS = [{k: v for k, v in r.items() if k not in _USER} for r in ROWS[:3]]
BAD = [  # (body, status, field named)
    (b"{not json", 400, "body"),
    (b"[1, 2]", 400, "body"),
    (b"[" * 30_000 + b"]" * 30_000, 400, "body"),  # nested too deeply: a RecursionError
    (b'{"rows": [{"I1": 1}], "extra": 1}', 400, "extra"),
    (b'{"rowz": []}', 400, "rowz"),
    (b'{"return_logit": true}', 400, "rows"),
    (b'{"rows": []}', 400, "rows"),
    (b'{"rows": {"I1": 1}}', 400, "rows"),
    (b'{"rows": [5]}', 400, "rows[0]"),
    (b'{"rows": [{"I1": 1}], "return_logit": "yes"}', 400, "return_logit"),
    (b'{"rows": [{"I1": 1}], "encoded": 1}', 400, "encoded"),
    (_body("set", "I1", float("nan")), 400, "rows[0].I1"),
    (_body("set", "I2", float("inf"), row=1), 400, "rows[1].I2"),
    (_body("set", "I4", 123456).replace(b"123456", b"1e999"), 400, "rows[0].I4"),
    (_body("set", "I3", "seven"), 400, "rows[0].I3"),
    (_body("set", "I5", 1.5), 400, "rows[0].I5"),
    (_body("set", "C1", 5), 400, "rows[0].C1"),
    (_body("set", "C2", "not hex"), 400, "rows[0].C2"),
    (_body("set", "Z9", "a", row=1), 400, "rows[1].Z9"),
    (_body("drop", "C5"), 400, "rows[0].C5"),
    (_candidates(3, _CANDS), 400, "shared"),
    (_candidates(_USER, [*_CANDS[:1], {**_CANDS[1], "C3": 7}]), 400, "candidates[1].C3"),
    (_candidates(_USER, [{**_CANDS[0], "I1": 3}]), 400, "I1"),
    (json.dumps({"rows": ROWS[:1] * 65}).encode(), 400, "rows"),
    (json.dumps({"rows": [{"C1": "a" * 70000}]}).encode(), 413, "body"),
]


@pytest.mark.parametrize(("body", "status", "field"), BAD, ids=[f"{s}-{f}" for _, s, f in BAD])
def test_bad_requests_are_refused_naming_the_field(server, body: bytes, status: int, field: str) -> None:
    r = server.client.post("/v1/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()
    assert field in (err["field"] or ""), err
    assert isinstance(err["error"], str) and err["error"]


def test_bad_requests_change_nothing_for_good_ones(server, artifacts) -> None:
    """Bad and good requests at once, sharing batching windows: the good ones get exactly their scores."""
    prob = offline(artifacts, ROWS[:3])[0]
    good = json.dumps({"rows": ROWS[:3]}).encode()
    bodies = [_body("set", "I1", float("nan")), _body("set", "C1", 5), b"{oops", good] * 6
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: server.client.post("/v1/score", content=b), bodies))
    for body, r in zip(bodies, answers, strict=True):
        if body is good:
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["scores"], prob, rtol=0, atol=1e-6)
        else:
            assert r.status_code == 400, r.text
    assert server.client.get("/healthz").status_code == 200


def test_encoded_ids(server, artifacts) -> None:
    """Rows of already-encoded ids (the prepared dense values and sparse ids) score as their raw rows."""
    model = ServingModel.load(artifacts["models"] / "1")
    b = model.encode(ROWS[:3])
    dense_names = model.manifest["model"]["dense_features"]
    ids = b.sparse.ids.view(len(model.feature_names), 3)  # feature-major, one id per row and feature
    rows = [{**{n: float(b.dense[i, j]) for j, n in enumerate(dense_names)},
             **{n: int(ids[f, i]) for f, n in enumerate(model.feature_names)}} for i in range(3)]
    r = server.score({"rows": rows, "encoded": True})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["scores"], offline(artifacts, ROWS[:3])[0], rtol=0, atol=1e-6)


def test_a_declared_length_over_the_limit_is_refused_before_reading(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # no body follows
        sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 999999999\r\n\r\n{")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, body = answer.decode().split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 413"), head
    assert json.loads(body)["field"] == "body"


def test_metrics(server) -> None:
    server.score({"rows": ROWS})
    text = server.client.get("/metrics").text
    assert 'recstack_requests_total{status="200"}' in text
    assert 'recstack_requests_total{status="400"}' in text
    assert "recstack_request_latency_seconds_bucket" in text
    assert "recstack_batch_rows_bucket" in text
    assert "recstack_model_version 1.0" in text
    assert server.metric("recstack_oov_total") > 0  # the unseen categories of ROWS
    assert server.metric("recstack_rows_total") >= len(ROWS)


def test_non_score_routes(server) -> None:
    assert server.client.get("/v1/score").status_code == 405
    assert server.client.get("/nothing").status_code == 404
    with pytest.raises(httpx.HTTPStatusError):
        server.client.get("/nothing").raise_for_status()
