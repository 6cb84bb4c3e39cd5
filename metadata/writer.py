"""Store mutations off the event loop, grouped: one commit for many."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from shufflefs.cluster.metrics_catalog import COMMIT_BATCH
from shufflefs.metadata.txn import Transactions

T = TypeVar("T")

MAX_GROUP = 256  # mutations per group commit at most


@dataclass(eq=False)
class _Pending:
    call: Callable[[], Any]
    taken: bool = False
    done: bool = False
    ok: bool = False
    result: Any = field(default=None)


class Writer:
    """Runs store mutations in a worker thread, many per commit.

    A durable LMDB commit waits for an fsync; in a thread that wait does not
    stall every other request. Mutations that arrive while a commit is
    running queue up; the next group takes them all (up to `MAX_GROUP`) and
    runs them in one write transaction with one commit (`Transactions.group`),
    each nested so that one failing is rolled back alone and gets its own
    error. Each caller returns only after the commit that holds its
    mutation. Whoever holds the lock when its mutation is still queued
    leads the next group (trio's lock is fair, so waiters lead in turn).
    A cancelled caller does not abandon a running group: the transaction
    finishes (or aborts) before the store can be closed; one cancelled while
    still queued is withdrawn.
    """

    def __init__(self, txns: Transactions) -> None:
        self.txns = txns
        self._queue: list[_Pending] = []
        self._lock = trio.Lock()

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        item = _Pending(functools.partial(fn, *args, **kwargs))
        self._queue.append(item)
        try:
            while not item.done:
                async with self._lock:
                    if not item.done:
                        await self._run_group()
        except BaseException:
            if not item.taken:
                self._queue.remove(item)
            raise
        if not item.ok:
            raise item.result
        result: T = item.result
        return result

    async def _run_group(self) -> None:
        batch = self._queue[:MAX_GROUP]
        del self._queue[:MAX_GROUP]
        for item in batch:
            item.taken = True
        COMMIT_BATCH.observe(len(batch))
        try:
            outcomes = await trio.to_thread.run_sync(self.txns.group, [i.call for i in batch])
        except Exception as exc:  # the group could not even begin: all of it failed
            outcomes = [(False, exc)] * len(batch)
        for item, (ok, result) in zip(batch, outcomes, strict=True):
            item.ok, item.result, item.done = ok, result, True
