"""Whether this metadata server is the primary: the lease from mgmtd.

Every `LEASE_TTL / 4` the server asks mgmtd for the primary's lease and
reports its log position (`cluster/meta_leases.py` decides). Granted, it is
the primary until 3/4 of the lease, counted from when it *sent* the
request: it stops taking writes before mgmtd could give the lease to anyone
else. Refused, it is a follower. A primary that learns of a newer epoch
(mgmtd's reply, or a follower refusing its appends) steps down at once.

A group of one (`group_size = 1` and no other metadata server registered)
is its own primary without a lease: there is no one to fail over to, and
mgmtd being down must not stop the namespace.

While primary, the server runs its primary duties (the log shipping of
`replication.Replicator`, the storage jobs, the session reaper) in a cancel
scope that a demotion cancels.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import trio

from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.replication import NOT_ACKNOWLEDGED, Replicator
from shufflefs.metadata.txn import Transactions
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.metadata.role")

PRIMARY = "primary"
FOLLOWER = "follower"
LEASE_SHARE = 0.75  # of the lease a primary uses, from the moment it asked
DURABLE_TIMEOUT = 3.0  # a mutation not held by a majority by then is answered NOT_ACKNOWLEDGED
TRIM_INTERVAL = 2.0
RETRY_AT_ONCE = 0.01  # seconds before re-asking for a lease granted too late to use
# A lease request gives up after this (its grant would count from its first
# try anyway), and a failed one is asked again soon: while mgmtd fails over,
# the holder renews as soon as the new mgmtd primary serves, before the
# backend's lease lapses (which would cost a new epoch, maybe another primary).
LEASE_REQUEST_TIMEOUT = 1.0
RETRY_FAILED = 0.1
NOT_PRIMARY = errno.ESTALE  # transient for clients: refresh the routing map, retry


class MetaRole:
    def __init__(
        self,
        txns: Transactions,
        rpc: RpcClient,
        mgmtd: MgmtdStub,
        *,
        group_size: int,
        routing: Callable[[], Routing],
        node_id: Callable[[], int | None],
        resync: Callable[[str, int], Awaitable[None]] | None = None,
        log_keep: int = 100_000,
    ) -> None:
        self.txns = txns
        self.log_keep = log_keep
        self.rpc = rpc
        self.mgmtd = mgmtd
        self.configured_size = group_size
        self.routing = routing
        self.node_id = node_id
        self.resync = resync
        self.role = FOLLOWER
        self.lease_until = 0.0  # trio clock; inf for a group of one
        self.interval = 0.75
        self.replicator: Replicator | None = None
        self._duties: trio.CancelScope | None = None
        self.changed = trio.Event()  # fired (and replaced) on every role change

    @property
    def epoch(self) -> int:
        return self.txns.epoch

    def peers(self) -> dict[int, str]:
        me = self.node_id()
        return {
            n["id"]: n["address"]
            for n in self.routing().nodes_of_kind("meta", online_only=False)
            if n["id"] != me
        }

    def group_size(self) -> int:
        return max(self.configured_size, len(self.peers()) + 1)

    def alone(self) -> bool:
        return self.group_size() == 1

    def primary_now(self) -> bool:
        return self.role == PRIMARY and trio.current_time() < self.lease_until

    def check_writable(self) -> None:
        """Raise NOT_PRIMARY unless this server may commit a mutation now."""
        if not self.primary_now():
            raise FsError(NOT_PRIMARY, "this metadata server is not the primary")

    async def durable(self, seq: int) -> None:
        """Wait until a majority of the group holds log entry *seq*."""
        replicator = self.replicator
        if replicator is None:
            if self.role == PRIMARY and self.alone():
                return
            raise FsError(NOT_ACKNOWLEDGED, "no longer the primary")
        replicator.committed()
        await replicator.wait_durable(seq, timeout=DURABLE_TIMEOUT)

    def epoch_seen(self, epoch: int) -> None:
        """A primary of *epoch* exists (it sent us entries, or mgmtd says so)."""
        if self.role == PRIMARY and epoch > self.epoch:
            self._demote(f"epoch {epoch} is newer than ours ({self.epoch})")

    def may_follow(self, epoch: int) -> bool:
        return not (self.role == PRIMARY and epoch <= self.epoch)

    async def run(
        self,
        duties: Callable[[], Awaitable[None]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Ask for the lease, promote and demote, until cancelled. *duties*
        run while primary."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                pause = await self._round(nursery, duties)
                if self.role == PRIMARY and trio.current_time() >= self.lease_until:
                    self._demote("lease lapsed")
                await trio.sleep(pause)

    async def _round(self, nursery: trio.Nursery, duties: Callable[[], Awaitable[None]]) -> float:
        """One lease request; returns the seconds until the next."""
        me = self.node_id()
        if me is None:
            return self.interval
        if self.role == PRIMARY and (self.replicator is None) != self.alone():
            self._demote("the metadata group changed size")
        asked = trio.current_time()
        position = self.txns.position()
        try:
            reply = await self.mgmtd.meta_lease(
                me, position.applied_seq, position.applied_epoch, self.configured_size
            )
        except FsError as exc:
            log.debug("lease request failed: %s", exc.message)
            if not self.alone() and self.lease_until == float("inf"):
                self.lease_until = 0.0  # was alone, is no more: a lease is needed now
            if self.alone() and self.role != PRIMARY:
                await self._promote(nursery, duties, position.epoch, float("inf"))
            return self.interval if self.alone() else RETRY_FAILED
        if reply["epoch"] > position.epoch:
            await trio.to_thread.run_sync(self.txns.raise_epoch, reply["epoch"])
        if reply["granted"]:
            until = float("inf") if self.alone() else asked + reply["ttl"] * LEASE_SHARE
            if self.role != PRIMARY and until <= trio.current_time():
                # The request took longer than our share of the lease (mgmtd
                # was failing over while it was retried): promoting on it
                # would only be undone at once; a fresh request renews it.
                log.info("lease epoch %d granted too late to use; asking again", reply["epoch"])
                return RETRY_AT_ONCE
            if self.role != PRIMARY:
                await self._promote(nursery, duties, reply["epoch"], until)
            self.lease_until = until
            self.interval = reply["ttl"] / 4
        elif self.role == PRIMARY:
            self._demote(f"the lease is node {reply['holder']}'s (epoch {reply['epoch']})")
        return self.interval

    async def _promote(
        self,
        nursery: trio.Nursery,
        duties: Callable[[], Awaitable[None]],
        epoch: int,
        until: float,
    ) -> None:
        await trio.to_thread.run_sync(self.txns.raise_epoch, epoch)
        self.txns.epoch = epoch
        self.replicator = (
            None
            if self.alone()
            else Replicator(
                self.txns,
                self.rpc,
                peers=self.peers,
                group_size=self.group_size,
                epoch=epoch,
                deposed=self.epoch_seen_by_follower,
                resync=self.resync,
            )
        )
        self.txns.read_only.promoted()  # before the first commit as the primary
        self.role, self.lease_until = PRIMARY, until
        self._duties = trio.CancelScope()
        log.info("primary now, epoch %d, applied seq %d", epoch, self.txns.last_seq)
        nursery.start_soon(self._run_duties, self._duties, self.replicator, duties)
        self._fire()

    async def _run_duties(
        self,
        scope: trio.CancelScope,
        replicator: Replicator | None,
        duties: Callable[[], Awaitable[None]],
    ) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                if replicator is not None:
                    nursery.start_soon(replicator.run)
                nursery.start_soon(self._trim, replicator)
                nursery.start_soon(duties)

    async def _trim(self, replicator: Replicator | None) -> None:
        """Drop the log entries no follower needs any more."""
        while True:
            await trio.sleep(TRIM_INTERVAL)
            through = (
                self.txns.last_seq if replicator is None else replicator.trim_point(self.log_keep)
            )
            if through > self.txns.position().trimmed_seq:
                dropped = await trio.to_thread.run_sync(self.txns.trim_log, through)
                log.info("log trimmed through %d (%d entries)", through, dropped)

    def epoch_seen_by_follower(self, epoch: int) -> None:
        if self.role == PRIMARY and self.epoch == epoch:
            self._demote("a follower has seen a newer epoch")

    def _demote(self, why: str) -> None:
        log.warning("primary no more (epoch %d): %s", self.epoch, why)
        self.role, self.lease_until = FOLLOWER, 0.0
        if self.replicator is not None:
            self.replicator.stop()
        self.replicator = None
        if self._duties is not None:
            self._duties.cancel()
        self._duties = None
        self._fire()

    def _fire(self) -> None:
        self.changed.set()
        self.changed = trio.Event()
