"""Reading metrics endpoints back: totals per endpoint and rates between two reads.

The status page (mgmtd) and `shufflefs top` both show IOPS, throughput
and latency per node and per mount; both get them here, from the same
counters Prometheus scrapes: a server's RPC requests and payload bytes
(`rpc.metrics`), a client's reads and writes (`metrics_catalog`).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT = 2.0
MAX_BODY = 16 << 20


@dataclass
class Totals:
    """Cumulative counters of one endpoint at one moment."""

    at: float  # time.monotonic() of the read
    ops: float = 0.0
    errors: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    latency_sum: float = 0.0
    latency_count: float = 0.0


@dataclass
class Rates:
    iops: float = 0.0
    errors: float = 0.0  # per second
    read_bps: float = 0.0
    write_bps: float = 0.0
    latency_ms: float | None = None  # mean over the interval; None without calls

    def as_json(self) -> dict[str, float | None]:
        return {
            "iops": round(self.iops, 1),
            "errors_per_s": round(self.errors, 2),
            "read_bytes_per_s": round(self.read_bps),
            "write_bytes_per_s": round(self.write_bps),
            "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 3),
        }


# which counters add to which total (by sample name, as both the text format
# with and without TYPE lines name them)
_COUNTERS = {
    "shufflefs_rpc_requests_total": "ops",
    "shufflefs_rpc_errors_total": "errors",
    "shufflefs_rpc_sent_bytes_total": "read_bytes",
    "shufflefs_rpc_received_bytes_total": "write_bytes",
    "shufflefs_client_ops_total": "ops",
    "shufflefs_client_errors_total": "errors",
}
_LATENCY = ("shufflefs_rpc_latency_seconds", "shufflefs_client_latency_seconds")
# mgmtd's and the metadata server's own housekeeping calls are not I/O
_NOT_IO = frozenset({"heartbeat", "metrics_announce", "metrics_endpoints", "ping", "get_routing"})


def parse_totals(text: str, at: float) -> Totals:
    totals = Totals(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if labels.get("method") in _NOT_IO:
                continue
            key = _COUNTERS.get(name)
            if key is not None:
                setattr(totals, key, getattr(totals, key) + sample.value)
            elif name == "shufflefs_client_bytes_total":
                if labels.get("op") == "read":
                    totals.read_bytes += sample.value
                else:
                    totals.write_bytes += sample.value
            elif name.startswith(_LATENCY):
                if name.endswith("_sum"):
                    totals.latency_sum += sample.value
                elif name.endswith("_count"):
                    totals.latency_count += sample.value
    return totals


# our endpoints are on our own hosts: never through a proxy from the environment
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(url: str, timeout: float = SCRAPE_TIMEOUT) -> str:
    with _OPENER.open(url, timeout=timeout) as response:
        body: bytes = response.read(MAX_BODY)
    return body.decode("utf-8", "replace")


def counter_samples(url: str, name: str, label: str) -> dict[str, float]:
    """The samples of counter *name* at *url*, by the value of their *label*
    (e.g. a mount's ``shufflefs_client_writeback_total`` by ``outcome``)."""
    return {
        sample.labels[label]: sample.value
        for family in text_string_to_metric_families(fetch(url))
        for sample in family.samples
        if sample.name == name and label in sample.labels
    }


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT) -> Totals | None:
    """The totals at *url*, None when it does not answer."""
    try:
        return parse_totals(fetch(url, timeout), time.monotonic())
    except (OSError, ValueError):
        return None


def rates(before: Totals, after: Totals) -> Rates:
    dt = after.at - before.at
    if dt <= 0:
        return Rates()

    def per_s(a: float, b: float) -> float:
        return max(0.0, b - a) / dt  # a restarted endpoint starts again from zero

    calls = after.latency_count - before.latency_count
    return Rates(
        iops=per_s(before.ops, after.ops),
        errors=per_s(before.errors, after.errors),
        read_bps=per_s(before.read_bytes, after.read_bytes),
        write_bps=per_s(before.write_bytes, after.write_bytes),
        latency_ms=(after.latency_sum - before.latency_sum) / calls * 1000 if calls > 0 else None,
    )


@dataclass
class RateTracker:
    """The last totals of each URL, so each read of many endpoints gives rates
    since the previous one (thread-safe: the status page serves threads)."""

    last: dict[str, Totals] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self, urls: list[str], timeout: float = SCRAPE_TIMEOUT) -> dict[str, Rates | None]:
        """Rates per URL since its last sample (zeros on the first), None if it did not answer."""
        if not urls:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
            got = dict(zip(urls, pool.map(lambda u: scrape(u, timeout), urls), strict=True))
        out: dict[str, Rates | None] = {}
        with self.lock:
            for url, totals in got.items():
                if totals is None:
                    out[url] = None
                    continue
                before = self.last.get(url)
                self.last[url] = totals
                out[url] = rates(before, totals) if before is not None else Rates()
        return out
