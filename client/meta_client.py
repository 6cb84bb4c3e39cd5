"""Calls to the metadata server, wherever the routing map says it is.

Two calls, named for their retry semantics: `call_idempotent` for what may
be applied any number of times (lookups, getattr, readdir, but also a length
update to a given size) is retried through every transient failure (a
metadata server restarting, a failover to another primary);
`call_at_most_once` for what must not apply twice (create, rename,
unlink...) carries a request id that stays the same through its retries:
the metadata servers store each mutation's result under it, in the same
(replicated) transaction, so it too is retried through every transient
failure and a retry is answered, not applied again
(`metadata/request_ids.py`). Both use the one policy, `rpc.retry`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.protocol import MetaStub
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import retrying

T = TypeVar("T")


class MetaClient:
    def __init__(
        self,
        rpc: RpcClient,
        routing: RoutingCache,
        *,
        timeout: float = 10.0,
        retry_budget: float = 30.0,
    ) -> None:
        self.rpc = rpc
        self.routing = routing
        self.timeout = timeout
        self.retry_budget = retry_budget
        self.nonce = random.getrandbits(63)  # this client's part of its request ids
        self._requests = itertools.count(1)

    def stub(self, request: list[int] | None = None) -> MetaStub:
        return MetaStub(self.rpc, self.routing.current.meta_address(), self.timeout, request)

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
