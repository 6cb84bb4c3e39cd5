"""Store mutations off the event loop, grouped: one commit for many."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from shufflefs.cluster.metrics_catalog import COMMIT_BATCH
from shufflefs.metadata.txn import Changed, Transactions
from shufflefs.rpc.errors import FsError

T = TypeVar("T")

MAX_GROUP = 256  # mutations per group commit at most


@dataclass(eq=False)
class _Pending:
    call: Callable[[], Any]
    taken: bool = False
    ok: bool = False
    result: Any = field(default=None)
    settled: trio.Event = field(default_factory=trio.Event)


class Writer:
    """Runs store mutations in a worker thread, many per commit.

    A durable LMDB commit waits for an fsync; in a thread that wait does not
    stall every other request. Mutations that arrive while a commit is
    running queue up; the next group takes them all (up to `MAX_GROUP`) and
    runs them in one write transaction with one commit (`Transactions.group`),
    each nested so that one failing is rolled back alone and gets its own
    error. Whoever holds the lock when its mutation is still queued leads
    the next group (trio's lock is fair, so waiters lead in turn).

    With replication, *gate* is asked before each group (it raises when
    this server may not write: not the primary, or its lease is ending)
    and *durable(seq)* after the commit: each caller returns only once a
    majority of the metadata group holds the log entry of its commit. The
    lock is released during that wait, so the next group commits while this
    one is being shipped. Then *notify(files, dirs, by)* is awaited with the
    regular files and the directories the group changed ({ino: change}, and
    each directory's one changing session if one alone changed it):
    the clients that cache them are told before anyone learns of the change
    (cache_watch.py).

    A cancelled caller does not abandon a running group: the transaction
    finishes (or aborts) and its callers are answered; one cancelled while
    still queued is withdrawn.
    """

    def __init__(
        self,
        txns: Transactions,
        *,
        gate: Callable[[], None] | None = None,
        durable: Callable[[int], Awaitable[None]] | None = None,
        notify: Callable[[dict[int, int], dict[int, int], dict[int, int | None]], Awaitable[None]]
        | None = None,
    ) -> None:
        self.txns = txns
        self.gate = gate
        self.durable = durable
        self.notify = notify
        self._queue: list[_Pending] = []
        self._lock = trio.Lock()

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        item = _Pending(functools.partial(fn, *args, **kwargs))
        self._queue.append(item)
        try:
            while not item.taken:
                batch: list[_Pending] | None = None
                changed: Changed = ({}, {}, {})
                async with self._lock:
                    if not item.taken:
                        batch, seq = await self._run_group()
                        changed = self.txns.take_changed()
                if batch is not None:
                    with trio.CancelScope(shield=True):  # the others wait for this
                        await self._settle(batch, seq, changed)
            await item.settled.wait()
        except BaseException:
            if not item.taken:
                self._queue.remove(item)
            raise
        if not item.ok:
            raise item.result
        result: T = item.result
        return result

    async def _run_group(self) -> tuple[list[_Pending], int | None]:
        """Commit the next group; returns it and the log entry it made (None: none)."""
        batch = self._queue[:MAX_GROUP]
        del self._queue[:MAX_GROUP]
        for item in batch:
            item.taken = True
        before = self.txns.last_seq
        COMMIT_BATCH.observe(len(batch))
        try:
            if self.gate is not None:
                self.gate()
            outcomes = await trio.to_thread.run_sync(self.txns.group, [i.call for i in batch])
        except Exception as exc:  # the group could not even begin: all of it failed
            outcomes = [(False, exc)] * len(batch)
        for item, (ok, result) in zip(batch, outcomes, strict=True):
            item.ok, item.result = ok, result
        seq = self.txns.last_seq
        return batch, (seq if seq != before else None)

    async def _settle(self, batch: list[_Pending], seq: int | None, changed: Changed) -> None:
        if seq is not None and self.durable is not None:
            try:
                await self.durable(seq)
            except FsError as exc:
                for item in batch:
                    if item.ok:
                        item.ok, item.result = False, exc
        if (changed[0] or changed[1]) and self.notify is not None:
            await self.notify(*changed)
        for item in batch:
            item.settled.set()
