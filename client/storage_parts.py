"""What the read engine and the chain writer share: the connections, the
routing map, replica bookkeeping, the short-circuit table, a timeout and the
retry budget of one call."""

from __future__ import annotations

from dataclasses import dataclass, field

from shufflefs.client.local_reads import LocalReads
from shufflefs.client.replicas import Replicas
from shufflefs.cluster.routing import RoutingCache
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError


@dataclass(eq=False)
class StoragePart:
    rpc: RpcClient
    routing: RoutingCache
    replicas: Replicas
    local: LocalReads
    timeout: float = field(kw_only=True)  # of one request
    retry_budget: float = field(kw_only=True)  # seconds a call keeps retrying

    async def refresh_routing(self, exc: FsError) -> None:
        """Between retries (`rpc.retry.retrying`'s on_failure): a fresh map."""
        await self.routing.refresh()
