"""``recstack serve``: an HTTP scoring service on uvicorn + starlette.

Routes:

- ``POST /v1/score``: ``{"rows": [{feature: raw value, ...}, ...], "return_logit": false}``, or the one-user,
  many-candidates form ``{"shared": {...}, "candidates": [{...}, ...]}`` -> ``{"scores": [p, ...],
  "model_version": v}`` (plus ``"logits"`` when asked), one probability per row or candidate, in order. A bad
  request gets a 4xx and ``{"error": message, "field": where}`` (``requests``); no body gets a 5xx.
- ``GET /healthz``: 200 while the process is up; ``GET /readyz``: 200 once a model is loaded, 503 before that
  and while draining; ``GET /metrics``: Prometheus text (see ``metrics``).
- the Open Inference Protocol (KServe V2) under ``/v2`` (``v2``): health, metadata, columnar ``infer``.

Each request is read, decoded and encoded on its own in the event loop (so a bad one fails alone), then scored
at once or in a shared batch (``batching``); ``--watch`` swaps in newer versions (``watch``). SIGTERM or SIGINT
drains first (``process``): not ready, answers marked ``Connection: close``, serving until nothing is in
flight or ``--drain-timeout``; then the listening socket closes and the app stops its tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from prometheus_client import values as prometheus_values
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from recstack.serving.batching import Batcher
from recstack.serving.compile import CompileSpec, DenseCompiler
from recstack.serving.metrics import ServerMetrics
from recstack.serving.model import RequestError, ServingModel
from recstack.serving.process import DrainingServer, run_server, run_workers
from recstack.serving.requests import (
    BadRequest,
    check_finite,
    encode_json,
    error_field,
    parse_request,
    read_body,
)
from recstack.serving.v2 import OpenInferenceProtocol
from recstack.serving.watch import ModelHolder, log


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
    body_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    model_name: str = "recstack"  # the model's name in the Open Inference Protocol's routes (``v2``)
    compile: CompileSpec = field(default_factory=CompileSpec)  # the dense program as native code (``compile``)


class ScoringService:
    """The app's state and handlers: the model holder, the batcher and the metrics of one worker process."""

    def __init__(self, opts: ServeOptions, model: ServingModel | None = None) -> None:
        self.opts = opts
        self.metrics = ServerMetrics()
        self.holder = ModelHolder(self.metrics, opts.device)
        self._loaded = model  # served from the startup on (when uvicorn's logging is set up: it logs the version)
        self.batcher = Batcher(opts.max_batch, opts.max_wait_us, self.metrics)
        self.draining = False
        self._active = 0  # scoring requests in flight (the drain waits for none)
        self._last_active = time.monotonic()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        if self._loaded is not None:
            self.holder.set(self._loaded)
            self._loaded = None
        elif self.opts.model_dir:
            # Before uvicorn accepts: under --workers N no worker takes a connection before it has a model.
            if not await self.holder.load(Path(self.opts.model_dir)):  # stays up, not ready; --watch may bring one
                log.error("recstack serve: no model to serve from %s", self.opts.model_dir)
        tasks = []
        if self.opts.watch:
            tasks.append(asyncio.create_task(self.holder.watch(Path(self.opts.watch), self.opts.watch_interval_s)))
        if self.opts.compile.mode == "aoti":
            compiler = DenseCompiler(self.opts.compile, self.holder.compiled)
            tasks.append(asyncio.create_task(self.holder.follow(compiler)))
        try:
            yield
        finally:  # uvicorn has answered every request in flight by now
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.batcher.stop()
            self.metrics.close()

    def start_drain(self) -> None:
        """SIGTERM / SIGINT: not ready from now on; each answer closes its connection (``process``)."""
        self.draining = True
        log.info("recstack serve [pid %d]: draining (%d requests in flight)", os.getpid(), self.active)

    @property
    def active(self) -> int:
        return self._active

    @property
    def last_active(self) -> float:
        return self._last_active

    def respond(self, body: bytes, status: int = 200, media_type: str = "application/json") -> Response:
        closing = self.draining or status == 408  # a 408's body was not read: the connection cannot be reused
        return Response(body, status, {"connection": "close"} if closing else None, media_type)

    async def healthz(self, request: Request) -> Response:
        return self.respond(encode_json({"status": "ok"}))

    async def readyz(self, request: Request) -> Response:
        if self.draining:
            return self.respond(encode_json({"status": "draining"}), 503)
        if self.holder.current is None:
            return self.respond(encode_json({"status": "loading"}), 503)
        return self.respond(encode_json({"status": "ready", "model_version": self.holder.version}))

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return self.respond(body, media_type=content_type)

    async def answer(self, request: Request, handle: Callable[[Request], Awaitable[dict]],
                     error: Callable[[int, str | None, str], dict]) -> Response:
        """One scoring request: ``handle(request)`` -> 200 and its document, or ``error(status, field,
        message)``'s document; counted in the metrics with the status actually sent."""
        start = time.perf_counter()
        self.metrics.in_flight.inc()
        self._active += 1
        self._last_active = time.monotonic()
        try:
            status, body = 200, encode_json(await handle(request))
        except BadRequest as e:
            status, body = e.status, encode_json(error(e.status, e.field, str(e)))
        except ClientDisconnect:
            status, body = 499, encode_json(error(499, "body", "client disconnected"))
        except Exception as e:  # a bug or a failed model call: this request fails, the worker keeps serving
            log.exception("recstack serve: request failed")
            status, body = 500, encode_json(error(500, None, f"{type(e).__name__}: {e}"))
        finally:
            self._active -= 1
            self._last_active = time.monotonic()
            self.metrics.in_flight.dec()
        self.metrics.observe_request(status, time.perf_counter() - start)  # the body is encoded: this is sent
        return self.respond(body, status)

    async def score(self, request: Request) -> Response:
        return await self.answer(request, self._score, lambda status, field, message: {"error": message,
                                                                                       "field": field})

    async def _score(self, request: Request) -> dict:
        model = self.holder.current  # read once: this request is encoded and scored by this version
        if model is None:
            raise BadRequest(503, "model", "no model loaded yet")
        with self.batcher.arriving():  # meanwhile no other request is alone
            body = await read_body(request, self.opts.max_body_bytes, self.opts.body_timeout_s)
            req = parse_request(body, self.opts.max_rows)
            try:
                if req.shared is None:
                    batch = model.encode(req.rows, ids=req.encoded)
                else:
                    batch = model.encode_candidates(req.shared, req.rows, ids=req.encoded)
            except RequestError as e:
                raise BadRequest(400, error_field(e, req.form, req.shared), str(e)) from None
        self.metrics.observe_oov(batch.oov_counts)
        logits, prob = await self.batcher.score(model, batch, batch.size)
        check_finite(logits, req.form)
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
        *OpenInferenceProtocol(svc, opts.model_name).routes(),
    ]
    app = Starlette(routes=routes, lifespan=svc.lifespan)
    app.state.service = svc
    return app


def serve(opts: ServeOptions, model: ServingModel | None, host: str, port: int, workers: int = 1) -> int:
    """Run the server until SIGTERM or SIGINT, drain, then return its exit code (0 after a graceful shutdown).
    ``workers > 1``: the model (loaded here, before the fork) and the listening socket are shared by that many
    forked processes (``process.run_workers``), each batching its own requests and watching on its own."""
    # uvicorn's "auto" takes httptools' parser and uvloop's event loop (dependencies of recstack)
    # over h11 and asyncio's loop where they import: parsing and writing a request in C costs a lone
    # request less (measured in docs/serving.md); an environment without them still serves.
    common: dict[str, Any] = {"host": host, "port": port, "access_log": False, "log_level": "info",
                              "http": "auto", "loop": "auto"}
    torch.set_num_threads(opts.threads)
    if workers == 1:
        app = create_app(opts, model)
        run_server(DrainingServer(uvicorn.Config(app, **common), app.state.service, opts.drain_timeout_s))
        return 0
    metrics_dir = tempfile.mkdtemp(prefix="recstack-serve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    # prometheus-client picks its value class when it is imported: pick again, now with the directory set
    # (the workers' metrics are created after the fork, in each worker).
    prometheus_values.ValueClass = prometheus_values.get_value_class()
    config = uvicorn.Config(None, **common)  # type: ignore[arg-type]
    sock = config.bind_socket()

    def start() -> None:
        app = create_app(opts, model)
        config.app = app
        run_server(DrainingServer(config, app.state.service, opts.drain_timeout_s), [sock])

    try:
        return run_workers(workers, sock, start)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
