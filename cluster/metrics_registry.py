"""mgmtd's directory of metrics endpoints: who serves Prometheus metrics where.

Every service and mount announces its endpoint's URL every few seconds
(`cluster.metrics.serve_metrics`); mgmtd keeps them in memory only (an
announcement is soft state: after a restart the next round refills it) and
forgets one not heard from for `EXPIRY` seconds, so the list holds the live
endpoints. Storage and metadata servers announce under their node id;
mounts and native clients, which are not nodes, under a name
(``host:pid``). `shufflefs status --json`, the status page and `shufflefs
top` read it through `metrics_endpoints`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TypedDict

from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.schema import rpc_method

EXPIRY = 10.0
MAX_ENDPOINTS = 4096  # bad or runaway announcers cannot grow mgmtd without bound
MAX_TEXT = 512


class MetricsEndpoint(TypedDict):
    kind: str  # mgmtd, meta, storage, mount, client
    node: int | None  # the node id of a server; None for a mount or client
    name: str  # a mount's or client's name (host:pid); "" for a server
    url: str
    age: float  # seconds since it was last announced


@dataclass
class _Entry:
    kind: str
    node: int | None
    name: str
    url: str
    seen: float


class MetricsDirectory:
    """The rpc methods mgmtd serves for it (`metrics_announce`, `metrics_endpoints`)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int | None, str], _Entry] = {}

    def add(self, kind: str, node: int | None, name: str, url: str) -> None:
        now = time.monotonic()
        self._expire(now)
        key = (kind, node, name)
        if key not in self._entries and len(self._entries) >= MAX_ENDPOINTS:
            return
        self._entries[key] = _Entry(kind, node, name, url[:MAX_TEXT], now)

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if now - e.seen > EXPIRY]:
            del self._entries[key]

    def endpoints(self) -> list[MetricsEndpoint]:
        now = time.monotonic()
        self._expire(now)
        return [
            {"kind": e.kind, "node": e.node, "name": e.name, "url": e.url, "age": now - e.seen}
            for e in sorted(
                self._entries.values(), key=lambda e: (e.node is None, e.node or 0, e.name)
            )
        ]

    def url_of(self, node: int) -> str | None:
        """The metrics URL of node *node*, None when it has none (or is silent)."""
        for e in self.endpoints():
            if e["node"] == node:
                return e["url"]
        return None

    @rpc_method(inline=True)
    async def metrics_announce(self, kind: str, node: int | None, name: str, url: str) -> None:
        self.add(kind[:MAX_TEXT], node, name[:MAX_TEXT], url)

    @rpc_method(inline=True)
    async def metrics_endpoints(self) -> list[MetricsEndpoint]:
        return self.endpoints()


async def announce(
    rpc: RpcClient, mgmtd: str, *, kind: str, node: int | None, name: str, url: str
) -> None:
    await rpc.call(
        mgmtd,
        "metrics_announce",
        {"kind": kind, "node": node, "name": name, "url": url},
        timeout=2.0,
    )


async def endpoints(rpc: RpcClient, mgmtd: str, timeout: float = 5.0) -> list[MetricsEndpoint]:
    result: list[MetricsEndpoint] = await rpc.call(mgmtd, "metrics_endpoints", {}, timeout=timeout)
    return result
