"""Which failures are worth retrying, and the retry loop.

A failure is transient when the cluster may heal it by itself: a peer that
is restarting or was replaced (connection refused/reset, timeout), or a
routing map that is out of date (ESTALE, ENXIO). Everything else (ENOENT,
ENOSPC, EIO from a checksum...) is an answer, returned to the caller at once.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from shufflefs.rpc.errors import CONNECTION_FAILURES, FsError

log = logging.getLogger("shufflefs.client")

T = TypeVar("T")

TRANSIENT = CONNECTION_FAILURES | {errno.ESTALE, errno.ENXIO, errno.EAGAIN}

# Not sent at all, so safe to retry even for calls that are not idempotent.
NOT_SENT = frozenset({errno.ECONNREFUSED, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETUNREACH})


def is_transient(exc: FsError) -> bool:
    return exc.code in TRANSIENT


async def retrying(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    budget: float,
    on_failure: Callable[[FsError], Awaitable[None]] | None = None,
    idempotent: bool = True,
) -> T:
    """Run *attempt* until it succeeds, fails for good, or *budget* seconds
    have passed. *on_failure* runs between attempts (e.g. refresh routing)."""
    deadline = trio.current_time() + budget
    delay = 0.05
    while True:
        try:
            return await attempt()
        except FsError as exc:
            retry = exc.code in (TRANSIENT if idempotent else NOT_SENT)
            if not retry or trio.current_time() + delay > deadline:
                raise
            log.info("%s failed (%s); retrying in %.2fs", what, exc.message, delay)
            if on_failure is not None:
                try:
                    await on_failure(exc)
                except FsError as inner:
                    log.debug("%s: recovery step failed: %s", what, inner.message)
            await trio.sleep(delay)
            delay = min(delay * 2, 1.0)
