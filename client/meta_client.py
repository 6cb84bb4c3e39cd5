"""Calls to the metadata servers, wherever the routing map says they are.

Three calls, named for their retry semantics and where they may go:
`call_idempotent` for what may be applied any number of times (a length
update to a given size, a setattr of absolute values) is retried through
every transient failure (a metadata server restarting, a failover to another
primary); `call_at_most_once` for what must not apply twice (create, rename,
unlink...) carries a request id that stays the same through its retries:
the metadata servers store each mutation's result under it, in the same
(replicated) transaction, so it too is retried through every transient
failure and a retry is answered, not applied again
(`metadata/request_ids.py`). Both go to the primary. `call_read` for what
changes nothing (lookup, getattr, readdir, ...) goes to any metadata server
of the group, spread over all of them, with the highest log position this
client has seen, so a follower answers only once it has applied this
client's own changes (read-your-writes: `metadata/follower_reads.py`); one
that cannot is avoided for a while and the read asked elsewhere. All use the
one policy, `rpc.retry`.
"""

from __future__ import annotations

import errno
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import retrying

T = TypeVar("T")

AVOID_SECONDS = 3.0  # a metadata server that failed a read is not asked again for this long


class MetaClient:
    def __init__(
        self,
        rpc: RpcClient,
        routing: RoutingCache,
        *,
        timeout: float = 10.0,
        retry_budget: float = 30.0,
        follower_reads: bool = True,
    ) -> None:
        self.rpc = rpc
        self.routing = routing
        self.timeout = timeout
        self.retry_budget = retry_budget
        self.follower_reads = follower_reads
        self.nonce = random.getrandbits(63)  # this client's part of its request ids
        self._requests = itertools.count(1)
        self.seen = 0  # the highest namespace log position any reply carried
        self._avoid: dict[str, float] = {}  # address -> monotonic time until which it is avoided
        # read calls go to a server drawn at random: a counter taken in turn
        # by every kind of call resonates with a loop's pattern (a loop of
        # creates and listings sent 37 of its 60 listings to one of three)
        self._pick = random.Random()

    def _saw(self, position: int) -> None:
        if position > self.seen:
            self.seen = position

    def stub(self, request: list[int] | None = None) -> MetaStub:
        """A stub to the primary."""
        address = self.routing.current.meta_address()
        return MetaStub(self.rpc, address, self.timeout, request, seen=self._saw)

    def read_stub(self) -> MetaStub:
        """A stub to a metadata server of the group drawn at random (skipping
        those that failed a read lately), asking for what this client saw."""
        routing = self.routing.current
        primary = routing.meta_address()
        if not self.follower_reads:
            return MetaStub(self.rpc, primary, self.timeout, seen=self._saw)
        now = time.monotonic()
        servers = [
            n["address"]
            for n in routing.nodes_of_kind("meta")
            if self._avoid.get(n["address"], 0.0) <= now
        ]
        if not servers:
            servers = [primary]
        address = self._pick.choice(servers)
        after = self.seen if address != primary else None
        return MetaStub(self.rpc, address, self.timeout, after=after, seen=self._saw)

    async def _refresh(self, exc: FsError) -> None:
        await self.routing.refresh()

    async def call_idempotent(self, what: str, fn: Callable[[MetaStub], Awaitable[T]]) -> T:
        """A call that may be repeated: retried through any transient failure."""
        return await retrying(
            what, lambda: fn(self.stub()), budget=self.retry_budget, on_failure=self._refresh
        )

    async def call_at_most_once(self, what: str, fn: Callable[[MetaStub], Awaitable[T]]) -> T:
        """A call that must not be applied twice: one request id for all its
        tries, so the servers apply it once however often it is sent."""
        request = [self.nonce, next(self._requests)]
        return await retrying(
            what,
            lambda: fn(self.stub(request)),
            budget=self.retry_budget,
            on_failure=self._refresh,
        )

    async def call_read(self, what: str, fn: Callable[[MetaStub], Awaitable[T]]) -> T:
        """A call that changes nothing, on any server of the group that has
        applied what this client saw; retried through any transient failure."""
        asked: list[str] = []

        async def attempt() -> T:
            stub = self.read_stub()
            asked.append(stub.address)
            return await fn(stub)

        async def failed(exc: FsError) -> None:
            if asked:
                self._avoid[asked[-1]] = time.monotonic() + AVOID_SECONDS
            if exc.code != errno.EAGAIN:  # a follower behind needs no new map
                await self.routing.refresh()

        return await retrying(what, attempt, budget=self.retry_budget, on_failure=failed)
