"""Which failures are worth retrying, how long to wait between tries, and the
retry loop: one policy for every process (clients, forwarding, resync, the
metadata server's storage jobs, registration with mgmtd).

A failure is transient when the cluster may heal it by itself: a peer that
is restarting or was replaced (connection refused/reset, timeout), or a
routing map that is out of date (ESTALE, ENXIO), or a peer that asks to be
asked again (EAGAIN). Everything else (ENOENT, ENOSPC, EIO from a checksum...)
is an answer, returned to the caller at once.
"""

from __future__ import annotations

import errno
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from shufflefs.rpc.errors import CONNECTION_FAILURES, FsError

log = logging.getLogger("shufflefs.retry")

T = TypeVar("T")

TRANSIENT = CONNECTION_FAILURES | {errno.ESTALE, errno.ENXIO, errno.EAGAIN}

# Not sent at all, so safe to retry even for calls that are not idempotent.
NOT_SENT = frozenset({errno.ECONNREFUSED, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETUNREACH})


@dataclass
class Backoff:
    """Exponential backoff: `next()` gives the wait before the next try
    (first, first*factor, ... capped at *cap*), with up to *jitter* of it
    added at random so that many clients retrying at once spread out;
    `reset()` after a success."""

    first: float = 0.05
    cap: float = 1.0
    factor: float = 2.0
    jitter: float = 0.0  # fraction of the delay added at random (0: none)

    def __post_init__(self) -> None:
        self._delay = self.first

    @property
    def delay(self) -> float:
        """The wait `next()` will return (without its jitter)."""
        return self._delay

    def next(self) -> float:
        delay = self._delay
        self._delay = min(self._delay * self.factor, self.cap)
        if self.jitter:
            delay += random.uniform(0, self.jitter * delay)
        return delay

    def reset(self) -> None:
        self._delay = self.first

    async def sleep(self) -> None:
        await trio.sleep(self.next())


async def retrying(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    budget: float,
    on_failure: Callable[[FsError], Awaitable[None]] | None = None,
    idempotent: bool = True,
    backoff: Backoff | None = None,
) -> T:
    """Run *attempt* until it succeeds, fails for good, or *budget* seconds
    have passed. *on_failure* runs between attempts (e.g. refresh routing).
    A call that is not idempotent is retried only when it was never sent."""
    deadline = trio.current_time() + budget
    backoff = backoff or Backoff()
    while True:
        try:
            return await attempt()
        except FsError as exc:
            retry = exc.code in (TRANSIENT if idempotent else NOT_SENT)
            delay = backoff.next()
            if not retry or trio.current_time() + delay > deadline:
                raise
            log.info("%s failed (%s); retrying in %.2fs", what, exc.message, delay)
            if on_failure is not None:
                try:
                    await on_failure(exc)
                except FsError as inner:
                    log.debug("%s: recovery step failed: %s", what, inner.message)
            await trio.sleep(delay)
