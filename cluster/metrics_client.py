"""Metrics of a mount or native client: its reads and writes, served when asked.

A client's reads and writes are counted where every one of them passes:
`FileSystem.read_into` and `FileSystem.write` for a mount (FUSE reads go
through `read_into`), the native client's `read_extents` (its blocking fast
path and the async fallback alike). The counting wrapper shadows the method
on that one instance, so a client without metrics pays nothing and the
client code needs no hooks of its own.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import trio
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from shufflefs.cluster.metrics import start_metrics
from shufflefs.cluster.metrics_catalog import (
    CLIENT_BYTES,
    CLIENT_ERRORS,
    CLIENT_LATENCY,
    CLIENT_OPS,
)
from shufflefs.rpc.addresses import address_toward, join_address, mgmtd_addresses, parse_address
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.metrics")

T = TypeVar("T")


def counts_family(name: str, documentation: str, label: str, counts: object) -> Metric:
    """A counter family of plain integer fields (*counts*, a dataclass the
    loop's thread increments), one sample per field, made when scraped:
    nothing on the counted path."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, value in vars(counts).items():
        family.add_metric([key], value)
    return family


class _Op:
    def __init__(self, op: str) -> None:
        self.ops = CLIENT_OPS.labels(op)
        self.bytes = CLIENT_BYTES.labels(op)
        self.errors = CLIENT_ERRORS.labels(op)
        self.latency = CLIENT_LATENCY.labels(op)

    def done(self, started: float, nbytes: int) -> None:
        self.ops.inc()
        self.bytes.inc(nbytes)
        self.latency.observe(time.perf_counter() - started)


def read_counter(fs: Any) -> Callable[[float, int], None] | None:
    """What counts a read (its start, its bytes) that bypasses *fs*'s
    `read_into` (a mount's fast READs), if *fs* is counted at all."""
    return _Op("read").done if "read_into" in vars(fs) else None


def _extent_bytes(extents: Sequence[Any]) -> int:
    return sum(e[3] for e in extents)


def counted_reads(read: Callable[..., T]) -> Callable[..., T]:
    """``read(extents, out)`` (sync) counted as one read of the extents' bytes."""
    op = _Op("read")

    @functools.wraps(read)
    def wrapper(extents: Sequence[Any], out: memoryview) -> T:
        started = time.perf_counter()
        try:
            result = read(extents, out)
        except BaseException:
            op.errors.inc()
            raise
        op.done(started, _extent_bytes(extents))
        return result

    return wrapper


def _counted_async(
    name: str, fn: Callable[..., Awaitable[T]], size: Callable[[tuple[Any, ...], T], int]
) -> Callable[..., Awaitable[T]]:
    op = _Op(name)

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        started = time.perf_counter()
        try:
            result = await fn(*args, **kwargs)
        except BaseException:
            op.errors.inc()
            raise
        op.done(started, size(args, result))
        return result

    return wrapper


def _counted_now(name: str, fn: Callable[..., int | None]) -> Callable[..., int | None]:
    """*fn* (sync: bytes written, or None when it did nothing) counted when it did."""
    op = _Op(name)

    @functools.wraps(fn)
    def wrapper(*args: Any) -> int | None:
        started = time.perf_counter()
        n = fn(*args)
        if n is not None:
            op.done(started, n)
        return n

    return wrapper


def instrument(fs: Any, *, reads: bool = True) -> None:
    """Count *fs*'s writes (also those a mount answers in libfuse's
    callback: `write_now`) and (with *reads*) its `read_into` calls."""
    attrs = vars(fs)  # an instance attribute shadows the class's method
    attrs["write"] = _counted_async("write", fs.write, lambda args, n: int(n))
    if hasattr(fs, "write_now"):
        attrs["write_now"] = _counted_now("write", fs.write_now)
    if reads:
        attrs["read_into"] = _counted_async(
            "read", fs.read_into, lambda args, _: _extent_bytes(args[0])
        )


async def start_client_metrics(
    nursery: trio.Nursery,
    fs: Any,
    address: str | None,
    *,
    rpc: RpcClient,
    mgmtd: str,
    kind: str = "mount",
    reads: bool = True,
    collectors: Sequence[Callable[[], Iterable[Metric]]] = (),
) -> str | None:
    """A client's one call: count its I/O and serve it at *address*,
    announced to mgmtd under the client's name (nothing without *address*)."""
    if not address:
        return None
    instrument(fs, reads=reads)
    serve = functools.partial(
        start_metrics, nursery, kind=kind, rpc=rpc, mgmtd=mgmtd, name=fs.name, collectors=collectors
    )
    try:
        return await serve(address)
    except FsError as exc:
        first = exc
    # one client config serves every host (every training node), so its
    # address is often another host's: serve on this host's own address
    # toward mgmtd instead, at the same port. mgmtd learns the URL from the
    # announcement, and so does a scrape through it.
    here = None
    if first.code == errno.EADDRNOTAVAIL:  # (a name may need DNS: off the loop)
        here = await trio.to_thread.run_sync(address_toward, mgmtd_addresses(mgmtd)[0])
    if here is not None:
        port = parse_address(address, listen=True)[1]
        try:
            url = await serve(join_address(here, port))
        except FsError as exc:
            first = exc
        else:
            log.info("%s metrics: %s is not this host's, serving at %s", kind, address, url)
            return url
    # a client without metrics beats one that does not run
    log.warning("%s runs without metrics: %s", kind, first.message)
    return None
