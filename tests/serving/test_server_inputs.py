"""No request body makes ``recstack serve`` answer 5xx: hostile JSON (thousands of digits, 100,000
levels of nesting, numbers past float32), values that drive the model out of float32's range (422,
never a NaN score), and a derandomized hypothesis fuzz of bodies sent to a real server process over
HTTP. ``/metrics`` counts the status actually sent."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import raw_criteo_rows, request_rows, running, shared_artifacts  # noqa: F401 (a fixture)

from recstack.serving.model import ServingModel

ROWS = request_rows(raw_criteo_rows(4, seed=11))


@pytest.fixture(scope="module")
def server(shared_artifacts, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    with running(
        [str(shared_artifacts["models"])], tmp_path_factory.mktemp("log") / "server.log"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def encoded_row(shared_artifacts) -> dict:  # noqa: F811
    """ROWS[0] as encoded ids (prepared dense values and sparse ids)."""
    model = ServingModel.load(shared_artifacts["models"] / "1")
    b = model.encode(ROWS[:1])
    dense = model.manifest["model"]["dense_features"]
    return {
        **{n: float(b.dense[0, j]) for j, n in enumerate(dense)},
        **{n: int(b.sparse.ids[f]) for f, n in enumerate(model.feature_names)},
    }


def post(server, body: bytes):
    return server.client.post(
        "/v1/score", content=body, headers={"content-type": "application/json"}
    )


def with_value(field: str, text: str) -> bytes:
    """ROWS[0] with ``field`` set to the JSON text ``text`` (written as is: numbers Python would not
    print)."""
    row = dict(ROWS[0], **{field: "@@"})
    return json.dumps({"rows": [row]}).encode().replace(b'"@@"', text.encode())


def test_hostile_json_is_a_400_naming_the_field(server, encoded_row) -> None:
    cases = [
        (with_value("I1", "9" * 5000), "rows[0].I1"),  # a 5,000-digit integer
        (with_value("I2", "-" + "1" * 30), "rows[0].I2"),  # past int64
        (with_value("C3", "[" * 100_000 + "]" * 100_000), "body"),  # nested 100,000 deep
        (b"[" * 100_000 + b"]" * 100_000, "body"),
        (with_value("I4", "1e300"), "rows[0].I4"),
        (
            json.dumps({"rows": [dict(encoded_row, I5=1e300)], "encoded": True}).encode(),
            "rows[0].I5",
        ),
        (
            json.dumps({"rows": [dict(encoded_row, C2=2**70)], "encoded": True}).encode(),
            "rows[0].C2",
        ),
    ]
    for body, field in cases:
        r = post(server, body)
        assert r.status_code == 400, (body[:80], r.text[:300])
        assert r.json()["field"] == field, r.json()


def test_a_non_finite_score_is_a_422_and_counted_as_sent(server, encoded_row) -> None:
    """Finite float32 inputs far outside the trained range overflow the MLPs: the row is named, no
    NaN leaves."""
    before = server.metric('recstack_requests_total{status="422"}')
    ok_before = server.metric('recstack_requests_total{status="200"}')
    huge = dict(encoded_row, **{f"I{j}": 3e38 for j in range(1, 14)})
    r = post(
        server,
        json.dumps({"rows": [encoded_row, huge], "encoded": True, "return_logit": True}).encode(),
    )
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "rows[1]"
    assert server.metric('recstack_requests_total{status="422"}') == before + 1
    assert server.metric('recstack_requests_total{status="200"}') == ok_before


# ------------------------------------------------------------------------------------------ fuzz
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([10**40, -(10**19), 2**63, 1e300, -1e-300, 3.4e38]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = list(ROWS[0])


@st.composite
def bodies(draw) -> bytes:
    """A valid body with one thing changed: a value, a key, a top-level entry; or any JSON at
    all."""
    kind = draw(st.sampled_from(["value", "drop", "top", "any", "encoded"]))
    if kind == "any":
        return json.dumps(draw(JSON)).encode()
    row = dict(ROWS[draw(st.integers(0, len(ROWS) - 1))])
    body: dict = {"rows": [row]}
    if kind in ("value", "encoded"):
        row[draw(st.sampled_from(FIELDS))] = draw(JSON)
        if kind == "encoded":
            body["encoded"] = True
    elif kind == "drop":
        del row[draw(st.sampled_from(FIELDS))]
    else:
        body[
            draw(st.sampled_from(["rows", "shared", "candidates", "return_logit", "encoded", "x"]))
        ] = draw(JSON)
    return json.dumps(body).encode()


@settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=bodies())
def test_fuzzed_bodies_never_get_a_5xx(server, body: bytes) -> None:
    r = post(server, body)
    assert r.status_code in (200, 400, 413, 422), (body[:200], r.status_code, r.text[:300])
    out = r.json()
    if r.status_code == 200:
        assert all(math.isfinite(p) and 0 <= p <= 1 for p in out["scores"])
    else:
        assert isinstance(out["error"], str) and out["error"], out


def test_fuzzing_left_the_server_serving(server) -> None:
    assert server.metric('recstack_requests_total{status="500"}') == 0
    assert post(server, json.dumps({"rows": ROWS}).encode()).status_code == 200
    assert Path(server.log).exists()
