"""The Open Inference Protocol (KServe V2, REST) beside ``/v1/score``, so that KServe, Triton and
Seldon clients call ``recstack serve`` unchanged.

Routes (``NAME``: ``--model-name``, default ``recstack``; ``/versions/V/`` may follow it where V is
the version served):

- ``GET /v2``: server metadata; ``GET /v2/health/live``, ``GET /v2/health/ready`` (503 before a
  model is loaded and while draining);
- ``GET /v2/models/NAME``: model metadata: one input per feature, ``{"name", "datatype", "shape"}``:
  by default the encoded form (prepared dense values FP32 ``[-1]``, sparse ids INT64 ``[-1]``; a
  multi-hot feature ``[-1, -1]``, a fixed number of ids per row); outputs ``scores`` and ``logits``
  (FP32 ``[-1]``); ``GET /v2/models/NAME/ready``;
- ``POST /v2/models/NAME/infer``: columnar tensors, one input per feature, all of the same batch
  size B (shape ``[B]`` or ``[B, 1]``; ``[B, L]`` for multi-hot ids), as JSON ``data`` (flat or
  nested, row-major) or as the binary tensor extension (``Inference-Header-Content-Length``; BYTES
  elements 4-byte length-prefixed). ``"parameters": {"raw": true}`` takes the raw fields instead
  (``raw_inputs`` in the metadata's parameters; tensors carry no nulls, so a missing raw value needs
  ``/v1/score``). Answer: ``scores`` and ``logits`` (those named in ``outputs`` when given) as FP32
  ``[B]`` JSON tensors. Errors: 4xx and ``{"error": message}`` naming the input; the checks are
  ``/v1/score``'s (``ServingModel.encode``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from recstack import __version__
from recstack.serving.artifact import RequestError
from recstack.serving.requests import BadRequest, check_finite, decode, encode_json, read_body

if TYPE_CHECKING:
    from recstack.serving.server import ScoringService

DTYPES = {
    "BOOL": "?",
    "UINT8": "<u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "<i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}
_INTEGER = {k for k in DTYPES if "INT" in k}
_NUMBER = _INTEGER | {"FP16", "FP32", "FP64"}
OUTPUTS = ("scores", "logits")


class Tensor(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    data: Any = None
    parameters: dict[str, Any] = {}


class Output(msgspec.Struct):
    name: str
    parameters: dict[str, Any] = {}


class InferRequest(msgspec.Struct):
    inputs: list[Tensor]
    id: str | None = None
    outputs: list[Output] | None = None
    parameters: dict[str, Any] = {}


_INFER = msgspec.json.Decoder(InferRequest)


def _flat(data: Any) -> list:
    """Nested row-major JSON data -> a flat list."""
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(x, list) for x in data):
        return data
    return [v for x in data for v in _flat(x)]


def _binary(t: Tensor, blob: memoryview) -> list:
    """A tensor's bytes of the binary extension -> its elements as Python values."""
    if t.datatype == "BYTES":
        out, at = [], 0
        while at < len(blob):
            if at + 4 > len(blob):
                raise BadRequest(400, t.name, f"input {t.name!r}: truncated BYTES element")
            n = int.from_bytes(blob[at : at + 4], "little")
            out.append(bytes(blob[at + 4 : at + 4 + n]).decode("utf-8", "replace"))
            at += 4 + n
        return out
    dtype = np.dtype(DTYPES[t.datatype])
    if len(blob) % dtype.itemsize:
        raise BadRequest(
            400, t.name, f"input {t.name!r}: {len(blob)} bytes is no whole number of {t.datatype}"
        )
    return np.frombuffer(blob, dtype).tolist()


class OpenInferenceProtocol:
    """The V2 handlers of one ``ScoringService`` (see the module docstring)."""

    def __init__(self, service: ScoringService, model_name: str) -> None:
        self.svc, self.name = service, model_name

    def routes(self) -> list[Route]:
        return [
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2/models/{name}", self.metadata, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}", self.metadata, methods=["GET"]),
            Route("/v2/models/{name}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/models/{name}/infer", self.infer, methods=["POST"]),
            Route("/v2/models/{name}/versions/{version}/infer", self.infer, methods=["POST"]),
        ]

    def _error(self, status: int, message: str) -> Response:
        return self.svc.respond(encode_json({"error": message}), status)

    def _is_ready(self) -> bool:
        return self.svc.holder.current is not None and not self.svc.draining

    def _model_or_error(self, request: Request) -> Response | None:
        """None when the path names the model served (and, when given, its version); else the
        404."""
        name, version = request.path_params["name"], request.path_params.get("version")
        if name != self.name:
            return self._error(
                404, f"unknown model {name!r:.60} (this server serves {self.name!r})"
            )
        if version is not None and version != str(self.svc.holder.version):
            return self._error(
                404,
                f"model {name!r} has no version {version!r:.20} here (serving "
                f"{self.svc.holder.version})",
            )
        return None

    async def server_metadata(self, request: Request) -> Response:
        return self.svc.respond(
            encode_json(
                {"name": "recstack", "version": __version__, "extensions": ["binary_tensor_data"]}
            )
        )

    async def live(self, request: Request) -> Response:
        return self.svc.respond(encode_json({"live": True}))

    async def ready(self, request: Request) -> Response:
        ok = self._is_ready()
        return self.svc.respond(encode_json({"ready": ok}), 200 if ok else 503)

    async def model_ready(self, request: Request) -> Response:
        if (err := self._model_or_error(request)) is not None:
            return err
        ok = self._is_ready()
        return self.svc.respond(encode_json({"name": self.name, "ready": ok}), 200 if ok else 503)

    async def metadata(self, request: Request) -> Response:
        if (err := self._model_or_error(request)) is not None:
            return err
        model = self.svc.holder.current
        if model is None:
            return self._error(503, "no model loaded yet")
        t = model.transforms
        inputs = [{"name": n, "datatype": "FP32", "shape": [-1]} for n in t.dense_names]
        inputs += [
            {"name": f["name"], "datatype": "INT64", "shape": [-1, -1] if f["multi_hot"] else [-1]}
            for f in t.features
        ]
        outputs = [{"name": n, "datatype": "FP32", "shape": [-1]} for n in OUTPUTS]
        return self.svc.respond(
            encode_json(
                {
                    "name": self.name,
                    "versions": [str(model.version)],
                    "platform": "recstack",
                    "inputs": inputs,
                    "outputs": outputs,
                    "parameters": {"raw_inputs": model.raw_fields},
                }
            )
        )

    async def infer(self, request: Request) -> Response:
        if (err := self._model_or_error(request)) is not None:
            return err
        return await self.svc.answer(
            request, self._infer, lambda status, field, message: {"error": message}
        )

    async def _infer(self, request: Request) -> dict:
        model = self.svc.holder.current
        if model is None:
            raise BadRequest(503, "model", "no model loaded yet")
        opts = self.svc.opts
        with self.svc.batcher.arriving():
            body = await read_body(request, opts.max_body_bytes, opts.body_timeout_s)
            req, columns, size = self._columns(request, body)
            raw = req.parameters.get("raw") is True
            fields = model.raw_fields if raw else model.id_fields
            if not fields:
                raise BadRequest(
                    400, "parameters", "this model has no raw form: send encoded inputs"
                )
            names = set(columns)
            for want in fields:
                if want not in names:
                    raise BadRequest(
                        400, want, f"missing input {want!r} (the model takes {', '.join(fields)})"
                    )
            extra = sorted(names - set(fields))
            if extra:
                raise BadRequest(
                    400,
                    extra[0],
                    f"unknown input {extra[0]!r:.60} (the model takes {', '.join(fields)})",
                )
            if size > opts.max_rows:
                raise BadRequest(
                    400, "inputs", f"batch of {size} rows, more than the limit of {opts.max_rows}"
                )
            rows = [{n: columns[n][i] for n in fields} for i in range(size)]
            try:
                batch = model.encode(rows, ids=not raw)
            except RequestError as e:
                where = f"input {e.field!r}" + (f", row {e.row}" if e.row is not None else "")
                raise BadRequest(400, e.field, f"{where}: {e}") from None
        self.svc.metrics.observe_oov(batch.oov_counts)
        logits, prob = await self.svc.batcher.score(model, batch, batch.size)
        check_finite(logits, "rows")
        wanted = [o.name for o in req.outputs] if req.outputs else list(OUTPUTS)
        values = {"scores": prob, "logits": logits}
        for n in wanted:
            if n not in values:
                raise BadRequest(400, n, f"unknown output {n!r:.60} (outputs: scores, logits)")
        out: dict[str, Any] = {
            "model_name": self.name,
            "model_version": str(model.version),
            "outputs": [
                {"name": n, "datatype": "FP32", "shape": [size], "data": values[n].tolist()}
                for n in wanted
            ],
        }
        if req.id is not None:
            out["id"] = req.id
        return out

    def _columns(self, request: Request, body: bytes) -> tuple[InferRequest, dict[str, list], int]:
        """An infer body -> (the request, {input: one value per row (a list per row for [B, L])},
        B)."""
        header = request.headers.get("inference-header-content-length")
        if request.headers.get("content-encoding", "identity") != "identity":
            raise BadRequest(400, "body", "compressed request bodies are not supported")
        if header is not None:
            if not header.isdigit() or int(header) > len(body):
                raise BadRequest(
                    400,
                    "body",
                    f"Inference-Header-Content-Length {header!r:.20} does not fit "
                    f"a body of {len(body)} bytes",
                )
            json_part, blob = body[: int(header)], memoryview(body)[int(header) :]
        else:
            json_part, blob = body, memoryview(b"")
        req: InferRequest = decode(json_part, _INFER)
        if not req.inputs:
            raise BadRequest(400, "inputs", "no inputs")
        columns: dict[str, list] = {}
        size: int | None = None
        at = 0
        for t in req.inputs:
            if t.datatype != "BYTES" and t.datatype not in DTYPES:
                raise BadRequest(
                    400, t.name, f"input {t.name!r}: unknown datatype {t.datatype!r:.20}"
                )
            if t.name in columns:
                raise BadRequest(400, t.name, f"input {t.name!r:.60} given twice")
            if (
                not 1 <= len(t.shape) <= 2
                or any(d < 0 for d in t.shape)
                or (size is not None and t.shape[0] != size)
            ):
                raise BadRequest(
                    400,
                    t.name,
                    f"input {t.name!r}: shape {t.shape} (expected [B], [B, 1] or "
                    f"[B, L], B the same for every input)",
                )
            size = t.shape[0]
            n = math.prod(t.shape)
            nbytes = t.parameters.get("binary_data_size")
            if nbytes is not None:
                if not isinstance(nbytes, int) or nbytes < 0 or at + nbytes > len(blob):
                    raise BadRequest(
                        400,
                        t.name,
                        f"input {t.name!r}: binary_data_size {nbytes!r:.20} does not fit the body",
                    )
                values = _binary(t, blob[at : at + nbytes])
                at += nbytes
            elif t.data is None:
                raise BadRequest(400, t.name, f"input {t.name!r}: no data")
            else:
                values = _flat(t.data)
            if len(values) != n:
                raise BadRequest(
                    400, t.name, f"input {t.name!r}: {len(values)} values for shape {t.shape}"
                )
            if len(t.shape) == 2 and t.shape[1] != 1:
                width = t.shape[1]
                values = [values[i * width : (i + 1) * width] for i in range(t.shape[0])]
            columns[t.name] = values
        return req, columns, int(size or 0)
