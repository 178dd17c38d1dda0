"""Prometheus metrics of ``recstack serve`` (``prometheus-client``), served as text at ``/metrics``.

One :class:`ServerMetrics` per app. With one worker process it lives in its own ``CollectorRegistry``. With
``--workers N`` the command line points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory before the workers
start: prometheus-client then keeps every value in a per-process file there and ``/metrics`` (whichever
worker answers) sums the counters and histograms of all workers; the model-version gauge keeps one series
per live worker (label ``pid``), so a scrape during a hot swap shows which workers switched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

# Request latency, seconds: fine below the 10 ms budget, coarse above it.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def multiprocess_dir() -> str | None:
    """The directory of multi-process metrics, or None when this process keeps its own."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class ServerMetrics:
    """The server's counters, histograms and gauges. ``render()`` -> (body, content type) of ``/metrics``."""

    def __init__(self) -> None:
        self.shared = multiprocess_dir() is not None
        # Multi-process values live in files, not in a registry: the metrics register nowhere and a scrape
        # collects the files. A private registry otherwise, so that several apps in one process do not clash.
        self.registry = None if self.shared else CollectorRegistry()
        r = self.registry
        self.requests = Counter("recstack_requests", "Scoring requests answered, by HTTP status", ["status"],
                                registry=r)
        self.latency = Histogram("recstack_request_latency_seconds", "Time from a scoring request's arrival "
                                 "to its answer", buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("recstack_batch_rows", "Rows per model call (several requests batched)",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_requests = Histogram("recstack_batch_requests", "Requests per model call",
                                        buckets=BATCH_BUCKETS, registry=r)
        self.rows = Counter("recstack_rows", "Rows scored", registry=r)
        self.oov = Counter("recstack_oov", "Values of a feature that mapped to its out-of-vocabulary row; "
                           "divided by recstack_rows_total: the out-of-vocabulary rate", ["feature"], registry=r)
        # Gauge's multiprocess_mode defaults to "all"; it matters only in multi-process mode
        self.in_flight = Gauge("recstack_requests_in_flight", "Scoring requests received and not yet answered",
                               registry=r, multiprocess_mode="livesum" if self.shared else "all")
        self.version = Gauge("recstack_model_version", "Version of the model being served", registry=r,
                             multiprocess_mode="liveall" if self.shared else "all")
        # Published versions (``publish.Publisher``) record when their newest training data arrived.
        self.data_arrival = Gauge("recstack_model_data_arrival_timestamp_seconds", "Arrival time (Unix) of the "
                                  "newest partition the served version was trained on", registry=r,
                                  multiprocess_mode="liveall" if self.shared else "all")
        self.freshness = Gauge("recstack_model_freshness_seconds", "Seconds from the arrival of the newest "
                               "partition the served version was trained on to its swap-in", registry=r,
                               multiprocess_mode="liveall" if self.shared else "all")
        self.compiled = Gauge("recstack_model_compiled", "1 when the served version runs its compiled dense "
                              "program (recstack serve --compile), 0 while it runs its graph", registry=r,
                              multiprocess_mode="liveall" if self.shared else "all")
        self.swaps = Counter("recstack_model_swaps", "Newer model versions switched to", registry=r)
        self.refused = Counter("recstack_model_refused", "Model versions refused (failed to load or to verify)",
                               registry=r)

    def observe_request(self, status: int, seconds: float) -> None:
        self.requests.labels(str(status)).inc()
        self.latency.observe(seconds)

    def observe_batch(self, rows: int, requests: int) -> None:
        self.batch_rows.observe(rows)
        self.batch_requests.observe(requests)
        self.rows.inc(rows)

    def observe_oov(self, counts: Mapping[str, int]) -> None:
        """counts: feature name -> values of one request that were out of vocabulary."""
        for name, n in counts.items():
            if n:
                self.oov.labels(name).inc(n)

    def render(self) -> tuple[bytes, str]:
        if self.registry is not None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST


    def close(self) -> None:
        """At a worker's shutdown: drop its live-only series (the version gauge) from the shared files."""
        if self.shared:
            multiprocess.mark_process_dead(os.getpid())
