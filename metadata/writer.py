"""Store mutations off the event loop, one at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class Writer:
    """Runs each store mutation in one worker-thread call.

    A durable LMDB commit waits for an fsync; in a thread that wait does not
    stall every other request. The whole write transaction begins and commits
    inside that one call (LMDB ties a write transaction to its thread). LMDB
    admits one writer at a time anyway, so more than one thread would only
    queue on its lock; queueing here keeps the order fair and the threads few.
    A cancelled caller does not abandon the thread: the transaction finishes
    (or aborts) before the store can be closed.
    """

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        call = functools.partial(fn, *args, **kwargs)
        return await trio.to_thread.run_sync(call, limiter=self._limiter)
