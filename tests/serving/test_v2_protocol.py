"""The Open Inference Protocol (KServe V2) of ``recstack serve``, called with Triton's own HTTP
client library (``tritonclient[http]``) against a real server process: health, metadata, and
columnar ``infer`` in both of the client's encodings (binary tensors and JSON), scoring exactly as
``/v1/score``."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton
from server_helpers import raw_criteo_rows, request_rows, running, shared_artifacts  # noqa: F401 (a fixture)
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from recstack.serving.model import ServingModel

ROWS = request_rows(raw_criteo_rows(5, seed=21))


@pytest.fixture(scope="module")
def server(shared_artifacts, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    log = tmp_path_factory.mktemp("log") / "server.log"
    with running([str(shared_artifacts["models"]), "--model-name", "ctr"], log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = triton.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    yield c
    c.close()


@pytest.fixture(scope="module")
def columns(shared_artifacts) -> dict[str, np.ndarray]:  # noqa: F811
    """ROWS as encoded columns: {prepared dense name: float32 [5], sparse feature: int64 [5]}."""
    model = ServingModel.load(shared_artifacts["models"] / "1")
    b = model.encode(ROWS)
    ids = b.sparse.ids.view(len(model.feature_names), len(ROWS))
    out = {
        n: b.dense[:, j].numpy() for j, n in enumerate(model.manifest["model"]["dense_features"])
    }
    out.update({n: ids[f].numpy().astype(np.int64) for f, n in enumerate(model.feature_names)})
    return out


def test_health_and_metadata(client, columns) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("ctr") and not client.is_model_ready("other")
    assert client.get_server_metadata()["name"] == "recstack"
    meta = client.get_model_metadata("ctr")
    assert meta["name"] == "ctr" and meta["versions"] == ["1"]
    inputs = {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]}
    assert inputs == {
        n: ("FP32" if a.dtype == np.float32 else "INT64", [-1]) for n, a in columns.items()
    }
    assert [o["name"] for o in meta["outputs"]] == ["scores", "logits"]
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("other")


@pytest.mark.parametrize("binary", [True, False])
def test_infer_scores_as_v1(server, client, columns, binary: bool) -> None:
    inputs = []
    for name, a in columns.items():
        t = triton.InferInput(name, [len(a)], "FP32" if a.dtype == np.float32 else "INT64")
        t.set_data_from_numpy(a, binary_data=binary)
        inputs.append(t)
    result = client.infer(
        "ctr",
        inputs,
        request_id="r1",
        outputs=[triton.InferRequestedOutput("scores", binary_data=False)],
    )
    v1 = server.score({"rows": ROWS}).json()["scores"]
    np.testing.assert_allclose(result.as_numpy("scores"), v1, rtol=0, atol=1e-6)
    assert result.get_response()["model_version"] == "1" and result.get_response()["id"] == "r1"
    assert result.as_numpy("logits") is None  # only the output asked for


def test_bad_infer_requests_are_4xx_naming_the_input(server, client, columns) -> None:
    def infer(cols: dict[str, np.ndarray]) -> None:
        inputs = []
        for name, a in cols.items():
            t = triton.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
            t.set_data_from_numpy(a)
            inputs.append(t)
        client.infer("ctr", inputs)

    with pytest.raises(InferenceServerException, match="missing input 'C3'"):
        infer({k: v for k, v in columns.items() if k != "C3"})
    with pytest.raises(InferenceServerException, match="'C2'.*outside the table"):
        infer({**columns, "C2": np.full(5, 10**9, np.int64)})
    with pytest.raises(InferenceServerException, match="'I1'.*float32"):
        infer({**columns, "I1": np.full(5, 1e300)})
    with pytest.raises(InferenceServerException, match="shape"):
        infer({**columns, "I2": np.zeros(4, np.float32)})
    r = server.client.post(
        "/v2/models/ctr/infer",
        content=b'{"inputs": [{"name": "I1", "shape": [1], '
        b'"datatype": "FP32", "data": [' + b"9" * 5000 + b"]}]}",
    )
    assert r.status_code == 400 and "error" in r.json()
    assert server.metric('recstack_requests_total{status="500"}') == 0
