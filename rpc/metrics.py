"""Per-operation request metrics of every RPC server (Prometheus).

`RpcServer` records each call it answers here, so every service (mgmtd,
metadata, storage) has requests, errors, latency and payload bytes per
method without a line of its own. Instruments are process-wide; the
``service`` label keeps apart services that share a process (tests).
The children of each (service, method) are looked up once and kept, so
a call costs a few counter increments, not label lookups.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram, disable_created_metrics

# 50 us .. 10 s: a page-cache read over loopback up to a resync copy
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)

disable_created_metrics()  # the *_created series only double what a scrape carries

REQUESTS = Counter(
    "shufflefs_rpc_requests", "RPC requests answered, per method", ["service", "method"]
)
ERRORS = Counter(
    "shufflefs_rpc_errors",
    "RPC requests answered with an error, per method and errno",
    ["service", "method", "errno"],
)
LATENCY = Histogram(
    "shufflefs_rpc_latency_seconds",
    "Time from a request's arrival to its reply being sent, per method",
    ["service", "method"],
    buckets=LATENCY_BUCKETS,
)
RECEIVED = Counter(
    "shufflefs_rpc_received_bytes",
    "Bulk payload bytes received with requests (data written), per method",
    ["service", "method"],
)
SENT = Counter(
    "shufflefs_rpc_sent_bytes",
    "Bulk payload bytes sent with replies (data read), per method",
    ["service", "method"],
)


@dataclass
class MethodMetrics:
    requests: Counter
    latency: Histogram
    received: Counter
    sent: Counter
    service: str
    method: str

    def error(self, code: int) -> None:
        ERRORS.labels(self.service, self.method, str(code)).inc()


class ServerMetrics:
    """The instruments of one server's methods, created on first use."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._methods: dict[str, MethodMetrics] = {}

    def method(self, name: str) -> MethodMetrics:
        found = self._methods.get(name)
        if found is None:
            labels = (self.service, name)
            found = self._methods[name] = MethodMetrics(
                REQUESTS.labels(*labels),
                LATENCY.labels(*labels),
                RECEIVED.labels(*labels),
                SENT.labels(*labels),
                self.service,
                name,
            )
        return found


def record_call(
    metrics: MethodMetrics,
    payload: bytearray | None,
    started: float,
    sent: Any,
) -> None:
    """One answered call: its count, latency and bulk bytes each way
    (*sent*: the reply's payload, its parts, or its size in bytes)."""
    metrics.requests.inc()
    metrics.latency.observe(time.perf_counter() - started)
    if payload:
        metrics.received.inc(len(payload))
    if sent is not None:
        size = (
            sent  # already counted by the caller
            if isinstance(sent, int)
            else len(sent)
            if isinstance(sent, (bytes, bytearray))
            else memoryview(sent).nbytes
            if isinstance(sent, memoryview)
            else sum(memoryview(p).nbytes for p in sent)
        )
        if size:
            metrics.sent.inc(size)
