"""``recstack serve``: an HTTP scoring service on uvicorn + starlette.

Routes:

- ``POST /v1/score``: ``{"rows": [{feature: raw value, ...}, ...], "return_logit": false}``, or the one-user,
  many-candidates form ``{"shared": {...}, "candidates": [{...}, ...]}`` -> ``{"scores": [p, ...],
  "model_version": v}`` (plus ``"logits"`` when asked), one probability per row or candidate, in order. A bad
  request gets 400 (413 for a body over ``max_body_bytes``) and ``{"error": message, "field": where}``.
- ``GET /healthz``: 200 while the process is up; ``GET /readyz``: 200 once a model is loaded, else 503;
  ``GET /metrics``: Prometheus text (see ``metrics``).

Each request is parsed, checked and encoded on its own in the event loop (so a bad one fails alone), then
scored in a shared batch (``batching``); ``--watch`` swaps in newer versions (``watch``). Shutdown (SIGTERM or
SIGINT) is uvicorn's: stop accepting, answer the requests in flight, then this app stops its tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.supervisors import Multiprocess

from recstack.serving.batching import Batcher
from recstack.serving.metrics import ServerMetrics
from recstack.serving.model import RequestError, ServingModel
from recstack.serving.watch import ModelHolder, log

OPTIONS_ENV = "RECSTACK_SERVE_OPTIONS"  # the options of a worker process under ``--workers N`` (JSON)
_TOP_KEYS = {"rows", "shared", "candidates", "return_logit", "encoded"}


@dataclass
class ServeOptions:
    """What one server process does (the command line's flags; see ``recstack serve --help``)."""

    model_dir: str
    device: str = "cpu"
    max_batch: int = 2048
    max_wait_us: int = 0
    max_rows: int = 2048
    max_body_bytes: int = 4 << 20
    watch: str | None = None
    watch_interval_s: float = 1.0
    threads: int = 1  # torch threads of each worker process


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` with ``{"error": message, "field": field}``."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.field = status, field


@dataclass
class Parsed:
    """A request's parts: form ("rows" or "candidates"), the shared features (candidates form), the rows (or
    candidates), whether to return logits, whether the rows carry encoded ids instead of raw values."""

    form: str
    shared: dict | None
    rows: list[dict]
    return_logit: bool
    encoded: bool


def parse_request(body: bytes, max_rows: int) -> Parsed:
    """A request body -> its parts, checked as far as they do not depend on the model (the features are the
    model encoder's to check). Raises BadRequest naming the field."""
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(400, "body", f"malformed JSON: {e}") from None
    if not isinstance(req, dict):
        raise BadRequest(400, "body", f"expected a JSON object, got {type(req).__name__}")
    unknown = sorted(set(req) - _TOP_KEYS)
    if unknown:
        raise BadRequest(400, unknown[0], f"unknown field {unknown[0]!r:.60} (expected rows, or shared and "
                                          "candidates, and optionally return_logit, encoded)")
    return_logit, encoded = req.get("return_logit", False), req.get("encoded", False)
    for name, flag in (("return_logit", return_logit), ("encoded", encoded)):
        if not isinstance(flag, bool):
            raise BadRequest(400, name, f"{name}: expected true or false, got {flag!r:.40}")
    if "rows" in req:
        if "shared" in req or "candidates" in req:
            raise BadRequest(400, "rows", "give either rows, or shared and candidates, not both")
        form, shared = "rows", None
    elif "candidates" in req:
        form, shared = "candidates", req.get("shared", {})
        if not isinstance(shared, dict):
            raise BadRequest(400, "shared", f"shared: expected an object of features, got {type(shared).__name__}")
    else:
        raise BadRequest(400, "rows", "missing field 'rows' (or 'candidates' with 'shared')")
    rows = req[form]
    if not isinstance(rows, list) or not rows:
        raise BadRequest(400, form, f"{form}: expected a non-empty list of objects")
    if len(rows) > max_rows:
        raise BadRequest(400, form, f"{form}: {len(rows)} rows, more than the limit of {max_rows} (--max-rows)")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BadRequest(400, f"{form}[{i}]", f"{form}[{i}]: expected an object of features, got "
                                                  f"{type(row).__name__}")
    return Parsed(form, shared, rows, return_logit, encoded)


def _field(e: RequestError, req: Parsed) -> str:
    """Where a RequestError of the model's encoder points in the request: ``rows[3].C7``, ``shared.I1``..."""
    if req.shared is not None and e.field is not None and e.field in req.shared:
        return f"shared.{e.field}"
    if e.row is None:
        return e.field or req.form
    return f"{req.form}[{e.row}]" + (f".{e.field}" if e.field is not None else "")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) one over ``limit`` bytes before reading it when its length is declared, else as
    soon as it grows past the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, "body", f"body of {declared} bytes is over the limit of {limit} (--max-body-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, "body", f"body over the limit of {limit} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


class ScoringService:
    """The app's state and handlers: the model holder, the batcher and the metrics of one worker process."""

    def __init__(self, opts: ServeOptions, model: ServingModel | None = None) -> None:
        self.opts = opts
        self.metrics = ServerMetrics()
        self.holder = ModelHolder(self.metrics, opts.device)
        if model is not None:
            self.holder.set(model)
        self.batcher = Batcher(opts.max_batch, opts.max_wait_us, self.metrics)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        if self.holder.current is None and self.opts.model_dir:
            # Before uvicorn accepts: under --workers N no worker takes a connection before it has a model.
            if not await self.holder.load(Path(self.opts.model_dir)):  # stays up, not ready; --watch may bring one
                log.error("recstack serve: no model to serve from %s", self.opts.model_dir)
        tasks = []
        if self.opts.watch:
            tasks.append(asyncio.create_task(self.holder.watch(Path(self.opts.watch), self.opts.watch_interval_s)))
        try:
            yield
        finally:  # uvicorn has answered every request in flight by now
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.batcher.stop()
            self.metrics.close()

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        if self.holder.current is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ready", "model_version": self.holder.version})

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def score(self, request: Request) -> Response:
        start = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            status, body = 200, await self._score(request)
        except BadRequest as e:
            status, body = e.status, {"error": str(e), "field": e.field}
        except ClientDisconnect:
            status, body = 499, {"error": "client disconnected", "field": "body"}
        except Exception as e:  # a bug or a failed model call: this request fails, the worker keeps serving
            log.exception("recstack serve: request failed")
            status, body = 500, {"error": f"{type(e).__name__}: {e}", "field": None}
        self.metrics.in_flight.dec()
        self.metrics.observe_request(status, time.perf_counter() - start)
        return JSONResponse(body, status_code=status)

    async def _score(self, request: Request) -> dict:
        model = self.holder.current  # read once: this request is encoded and scored by this version
        if model is None:
            raise BadRequest(503, "model", "no model loaded yet")
        with self.batcher.arriving():  # meanwhile no other request is alone
            req = parse_request(await _read_body(request, self.opts.max_body_bytes), self.opts.max_rows)
            try:
                if req.shared is None:
                    batch = model.encode(req.rows, ids=req.encoded)
                else:
                    batch = model.encode_candidates(req.shared, req.rows, ids=req.encoded)
            except RequestError as e:
                raise BadRequest(400, _field(e, req), str(e)) from None
        self.metrics.observe_oov(batch.oov_counts)
        logits, prob = await self.batcher.score(model, batch, batch.size)
        out: dict[str, Any] = {"scores": prob.tolist(), "model_version": model.version}
        if req.return_logit:
            out["logits"] = logits.tolist()
        return out


def create_app(opts: ServeOptions, model: ServingModel | None = None) -> Starlette:
    """The ASGI app of one server process; ``model``: an already loaded model (else it loads
    ``opts.model_dir`` after startup)."""
    svc = ScoringService(opts, model)
    routes = [
        Route("/v1/score", svc.score, methods=["POST"]),
        Route("/healthz", svc.healthz, methods=["GET"]),
        Route("/readyz", svc.readyz, methods=["GET"]),
        Route("/metrics", svc.metrics_text, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=svc.lifespan)
    app.state.service = svc
    return app


def app_from_env() -> Starlette:
    """uvicorn's app factory in each worker process of ``--workers N``: the options come in ``OPTIONS_ENV``."""
    opts = ServeOptions(**json.loads(os.environ[OPTIONS_ENV]))
    torch.set_num_threads(opts.threads)
    return create_app(opts)


def serve(opts: ServeOptions, model: ServingModel | None, host: str, port: int, workers: int = 1) -> None:
    """Run the server until SIGTERM or SIGINT, then return (after a graceful shutdown). ``workers > 1``: that
    many processes share the listening socket (uvicorn's supervisor), each loading the memory-mapped artifact
    (one copy of the tables in the page cache) and batching its own requests; ``model`` is then unused."""
    # uvicorn re-raises the signal that stopped it once it is done: a handler that ignores it makes the
    # process end with 0 after the graceful shutdown instead of dying of the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    common: dict[str, Any] = {"host": host, "port": port, "access_log": False, "timeout_graceful_shutdown": 30,
              "log_level": "info"}
    if workers == 1:
        torch.set_num_threads(opts.threads)
        uvicorn.Server(uvicorn.Config(create_app(opts, model), **common)).run()
        return
    metrics_dir = tempfile.mkdtemp(prefix="recstack-serve-metrics-")
    os.environ[OPTIONS_ENV] = json.dumps(asdict(opts))  # inherited by the spawned workers
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        config = uvicorn.Config("recstack.serving.server:app_from_env", factory=True, workers=workers, **common)
        Multiprocess(config, sockets=[config.bind_socket()]).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
