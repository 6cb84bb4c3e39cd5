"""The storage side of one client: its parts, built once and shared.

* `Replicas` (client/replicas.py): which replica serves a read, failure
  bookkeeping, reports of dead nodes to mgmtd;
* `LocalReads` (client/local_reads.py): the short-circuit table, chunk files
  of this host's targets read directly;
* `ReadEngine` (client/read_engine.py): pieces to the daemons, with failover;
* `ChainWriter` (client/chain_writes.py): pieces to the head of their chain.

Every range is split into chunk pieces by the one planner, `layout.plan`.
"""

from __future__ import annotations

import trio

from shufflefs.client.chain_writes import ChainWriter
from shufflefs.client.local_reads import LocalReads
from shufflefs.client.read_engine import ReadEngine
from shufflefs.client.replicas import Replicas
from shufflefs.cluster.routing import RoutingCache
from shufflefs.rpc.client import RpcClient


class StorageClient:
    def __init__(
        self,
        rpc: RpcClient,
        routing: RoutingCache,
        *,
        read_timeout: float = 5.0,
        write_timeout: float = 30.0,
        retry_budget: float = 30.0,
        local_reads: bool = True,
        inline_disk_waits: bool = True,
    ) -> None:
        self.rpc = rpc
        self.routing = routing
        self.read_timeout = read_timeout
        self.replicas = Replicas(routing)
        self.local = LocalReads(self.replicas, local_reads)
        self.reads = ReadEngine(
            rpc,
            routing,
            self.replicas,
            self.local,
            timeout=read_timeout,
            retry_budget=retry_budget,
            inline_disk_waits=inline_disk_waits,
        )
        self.writes = ChainWriter(
            rpc,
            routing,
            self.replicas,
            self.local,
            timeout=write_timeout,
            retry_budget=retry_budget,
        )
        self.background: trio.Nursery | None = None  # see `start`

    def start(self, nursery: trio.Nursery) -> None:
        """Background duties (reports of dead nodes, write-behind) run in *nursery*;
        writes to a chain that changes stop waiting for its old head."""
        self.background = nursery
        self.replicas.background = nursery
        self.routing.listeners.append(self.writes.routing_changed)
