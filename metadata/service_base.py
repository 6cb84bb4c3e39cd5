"""`ServiceBase`: what every rpc method of the metadata server stands on:
the namespace store, the writer its mutations go through (at most once
with a request id), the storage jobs and the session reaper, and the
duties of a primary. The methods are in `handles_service` (sessions and
file handles) and `server` (the namespace)."""

from __future__ import annotations

import functools
import itertools
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from shufflefs.cluster.routing import Routing
from shufflefs.metadata import request_ids
from shufflefs.metadata.cache_watch import CacheWatches
from shufflefs.metadata.gc import SessionReaper, StorageJobs
from shufflefs.metadata.replication_role import MetaRole
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.writer import Writer
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import FORWARD_TIMEOUT

log = logging.getLogger("shufflefs.metadata.server")

T = TypeVar("T")


def _kv(details: dict[str, Any]) -> str:
    parts = []
    for key, value in details.items():
        if callable(value):
            continue
        text = repr(value)
        parts.append(f"{key}={text[:80]}")
    return " ".join(parts)


class ServiceBase:
    """The state of a `MetaService` over one NamespaceStore, and its mutation
    path (`_mutate`).

    *routing* returns the current routing map; it is consulted for the chains
    of new files and for the storage targets that jobs are carried out on.
    """

    def __init__(
        self,
        store: NamespaceStore,
        routing: Callable[[], Routing],
        rpc: RpcClient,
        *,
        storage_timeout: float = FORWARD_TIMEOUT,  # per replica, as the daemons forward
        reap_interval: float | None = None,
        refresh_routing: Callable[[], Awaitable[object]] | None = None,
        role: MetaRole | None = None,
    ) -> None:
        self.store = store
        self.routing = routing
        self.refresh_routing = refresh_routing
        self.role = role
        handles = store.txns.read_only
        self.cache_watches = CacheWatches(
            handles.readers,
            handles.in_grace,
            lambda session: session in handles.started_with,
            lambda: bool(handles.started_with),
        )
        notify = self.cache_watches.changed
        self.write = (
            Writer(store.txns, notify=notify)
            if role is None
            else Writer(store.txns, gate=role.check_writable, durable=role.durable, notify=notify)
        )
        self.jobs = StorageJobs(
            store,
            self.write,
            routing,
            rpc,
            refresh_routing=refresh_routing,
            forward_timeout=storage_timeout,
        )
        if reap_interval is None:
            reap_interval = max(0.05, min(5.0, store.session_timeout / 4))
        self.reaper = SessionReaper(store, self.write, self.jobs, reap_interval)
        # New files start on successive chains, so single-chunk files spread
        # over all of them; a random start keeps restarts from favouring chain 0.
        self._rotor = itertools.count(random.randrange(1 << 16))

    async def run_background(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The storage-job worker and the session reaper, until cancelled;
        with a role, only while this server is the primary."""
        if self.role is not None:
            await self.role.run(self._primary_duties, task_status=task_status)
            return
        self.cache_watches.begin()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.jobs.run)
            nursery.start_soon(self.reaper.run)
            task_status.started()

    async def _primary_duties(self) -> None:
        """A new primary (also a restarted one) gives every session a fresh
        lease and starts the restart grace (the read-only handles were in
        another process's memory), then carries out jobs and reaps."""
        self.cache_watches.begin()
        sessions = await self.write(self.store.restart_leases)
        log.info("serving as primary: %d sessions get a fresh lease", sessions)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.jobs.run)
            nursery.start_soon(self.reaper.run)
            while True:
                await trio.sleep(request_ids.TRIM_INTERVAL)
                await self.write(request_ids.trim, self.store.txns)

    async def _mutate(
        self, op: str, fn: Callable[..., T], request: list[int] | None = None, **args: Any
    ) -> T:
        """Run a mutation through the writer; with a *request* id, at most
        once however often it is retried (`request_ids.py`)."""
        call = fn if request is None else functools.partial(self._once, request, fn)
        try:
            return await self.write(call, **args)
        except FsError as exc:
            log.debug("%s failed %s: %s", op, _kv(args), exc.message)
            raise

    def _once(self, request: list[int], fn: Callable[..., T], **args: Any) -> T:
        return request_ids.run_once(self.store.txns, request, functools.partial(fn, **args))
