"""Every service's Prometheus endpoint: an HTTP server in a thread, announced to mgmtd.

The server is the standard library's WSGI server (one thread per request,
daemon threads) serving prometheus-client's exposition app at ``/metrics``,
plus whatever extra routes the service adds (mgmtd: its status page). A
scrape never touches the event loop except through a collector that asks it
for a snapshot (`trio.from_thread`), so a slow scraper cannot stall a
service. Each endpoint announces its URL to mgmtd every `ANNOUNCE_INTERVAL`
seconds (`cluster.metrics_registry`); mgmtd forgets one not heard from for
`metrics_registry.EXPIRY`, so ``shufflefs status --json`` and ``shufflefs
top`` find the live ones, mounts included.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import trio
from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from shufflefs.cluster.node import advertised_address, listen_address
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.metrics")

ANNOUNCE_INTERVAL = 2.0
ANNOUNCE_TIMEOUT = 2.0

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s", format % args)


class _ProcessWide(Collector):
    """The process-wide instruments (rpc.metrics, metrics_catalog, the
    process and GC collectors), inside an endpoint's own registry."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


class _Snapshot(Collector):
    """A service's gauges, read from its live state when scraped."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self.fn()
        except Exception:  # a scrape must never take the endpoint down
            log.exception("collecting metrics failed")


def registry_of(collectors: Sequence[Callable[[], Iterable[Metric]]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ProcessWide())
    for fn in collectors:
        registry.register(_Snapshot(fn))
    return registry


class HttpEndpoint:
    """A WSGI server on its own thread, serving *routes* by path."""

    def __init__(self, address: str, routes: dict[str, WsgiApp]) -> None:
        host, port = listen_address(address)
        self.routes = routes
        try:
            self.httpd = make_server(
                host or "0.0.0.0", port, self._app, _Server, handler_class=_QuietHandler
            )
        except OSError as exc:
            raise FsError(exc.errno or 98, f"metrics endpoint {address}: {exc.strerror}") from None
        self.port: int = self.httpd.server_address[1]
        self.host = host
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.2,), name="shufflefs-http", daemon=True
        )
        self.thread.start()

    def url(self, path: str = "/metrics", machine: str | None = None) -> str:
        return f"http://{advertised_address(self.host, self.port, host=machine)}{path}"

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        app = self.routes.get(path)
        if app is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        return app(environ, start_response)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def serve_metrics(
    address: str,
    *,
    kind: str,
    rpc: RpcClient | None = None,
    mgmtd: str | None = None,
    node_id: Callable[[], int | None] = lambda: None,
    name: str = "",
    collectors: Sequence[Callable[[], Iterable[Metric]]] = (),
    routes: dict[str, WsgiApp] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` (and *routes*) at *address* until cancelled,
    reporting the endpoint's URL through *task_status*; with *rpc* and
    *mgmtd*, announce it there every `ANNOUNCE_INTERVAL` seconds (as node
    ``node_id()`` once the service has one, else as a client named *name*)."""
    from shufflefs.cluster.metrics_registry import announce  # mgmtd's side imports us

    endpoint = HttpEndpoint(
        address, {"/metrics": make_wsgi_app(registry_of(collectors)), **(routes or {})}
    )
    url = endpoint.url()
    log.info("%s metrics at %s", kind, url)
    try:
        task_status.started(url)
        while True:
            if rpc is not None and mgmtd is not None:
                with trio.move_on_after(ANNOUNCE_TIMEOUT):
                    try:
                        await announce(rpc, mgmtd, kind=kind, node=node_id(), name=name, url=url)
                    except FsError as exc:
                        log.debug("announcing metrics to mgmtd failed: %s", exc.message)
            await trio.sleep(ANNOUNCE_INTERVAL)
    finally:
        endpoint.close()


async def start_metrics(nursery: trio.Nursery, address: str | None, **kwargs: Any) -> str | None:
    """The one call a service makes at startup: serve its endpoint (see
    `serve_metrics`) in *nursery* if *address* is set; returns the URL."""
    if not address:
        return None
    url: str = await nursery.start(functools.partial(serve_metrics, address, **kwargs))
    return url
