"""The metadata primary's lease, as mgmtd grants it.

The lease itself (holder, epoch, expiry) lives in mgmtd's coordination
backend (`cluster/coordination.py`: the embedded store, or etcd), under the
name `LEASE_NAME`, so it survives an mgmtd restart or an mgmtd failover on
etcd like the rest of the cluster state. What this module adds is the
policy of who may take it. Every
metadata server asks for the lease every `LEASE_TTL / 4` seconds and
reports its log position (applied seq and that entry's epoch). The
holder's request renews it. When the lease has lapsed,
it goes to a requester only if a majority of the metadata group reported
within one TTL and no reporter is ahead of it: every acknowledged mutation
is held by a majority, and any two majorities meet, so the most up-to-date
of a majority has all of them. Each grant to a new holder raises the epoch,
durably, before the grant is answered (the backend's contract). A restarted
mgmtd counts a lease it finds as held for one more TTL (the embedded
backend; etcd keeps its own clock): the holder may still act on it.

The holder counts its lease from when it *sent* the request, and stops
taking writes at 3/4 of it; mgmtd counts from after it received it: so the
old primary has stopped before anyone else can be granted it.

Lapsed means: not renewed for a TTL by this mgmtd's clock (`heard`; a new
mgmtd primary counts from when it first saw the lease), or gone from the
backend. The backend keeps it longer, TTL plus its own failover time
(`Coordination.failover_seconds`: etcd's election TTL and a standby's poll),
so it outlasts an mgmtd failover: the holder, which asks again every 0.1 s
while no mgmtd answers, renews it with the new mgmtd primary in the same
epoch, instead of the group electing a primary anew (a new epoch, maybe
another server, the clients re-routed). A dead holder's lease still goes
on after one TTL of silence, as before.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field
from typing import Any

from shufflefs.cluster.coordination import Coordination, Lease
from shufflefs.cluster.protocol import LeaseReply
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.mgmtd")

LEASE_TTL = 3.0  # seconds
LEASE_NAME = "metadata-primary"


@dataclass
class Report:
    applied_seq: int
    applied_epoch: int
    at: float


def _key(lease: Lease) -> tuple[int, int]:
    return int(lease["holder"]), lease["epoch"]


@dataclass
class MetaLeases:
    """Who may become metadata primary (*now* is mgmtd's monotonic clock);
    `holder`/`epoch` are the last lease seen in the backend."""

    ttl: float = LEASE_TTL
    epoch: int = 0
    holder: int | None = None
    reports: dict[int, Report] = field(default_factory=dict)
    # the live lease's (holder, epoch), and when this mgmtd last granted or
    # renewed it, or first saw it (a new mgmtd primary)
    heard: tuple[tuple[int, int], float] | None = None

    async def request(
        self,
        coordination: Coordination,
        node_id: int,
        applied_seq: int,
        applied_epoch: int,
        members: set[int],
        group_size: int,
        now: float,
    ) -> tuple[LeaseReply, bool]:
        """A metadata server's request; returns the reply and whether the
        holder changed (the caller bumps the routing version)."""
        self.reports[node_id] = Report(applied_seq, applied_epoch, now)
        live = await coordination.get_lease(LEASE_NAME)
        before = self._seen(live)
        if live is not None and live["holder"] == str(node_id):
            try:
                live = await coordination.renew_lease(LEASE_NAME, str(node_id), live["epoch"])
                self.heard = (_key(live), now)
            except FsError as exc:
                if exc.code != errno.ESTALE:
                    raise
                live = None  # lapsed just now: taken again below, if it may be
        elif live is not None and self._silent_for(live, now) > self.ttl:
            # silent for a TTL: it stopped writing at 3/4 of it; the backend
            # keeps it longer only to outlast an mgmtd failover
            await coordination.release_lease(LEASE_NAME, live["holder"], live["epoch"])
            live = None
        if live is None and self._may_take(node_id, members | {node_id}, group_size, now):
            held = self.ttl + coordination.failover_seconds
            try:
                live = await coordination.grant_lease(LEASE_NAME, str(node_id), held)
                self.heard = (_key(live), now)
            except FsError as exc:
                if exc.code != errno.EBUSY:
                    raise
                live = await coordination.get_lease(LEASE_NAME)  # someone else was quicker
        self._seen(live)
        changed = (self.holder, self.epoch) != before
        if changed and self.holder == node_id:
            log.info("metadata primary is node %d, epoch %d", node_id, self.epoch)
        reply = LeaseReply(
            granted=self.holder == node_id, holder=self.holder, epoch=self.epoch, ttl=self.ttl
        )
        return reply, changed

    def _silent_for(self, lease: Lease, now: float) -> float:
        """Seconds since this mgmtd last heard of *lease* (0 the first time)."""
        if self.heard is None or self.heard[0] != _key(lease):
            self.heard = (_key(lease), now)
        return now - self.heard[1]

    def _seen(self, lease: Lease | None) -> tuple[int | None, int]:
        """Note *lease* as the current one; the (holder, epoch) before."""
        before = (self.holder, self.epoch)
        if lease is None:
            self.holder = None
        else:
            self.holder, self.epoch = int(lease["holder"]), max(self.epoch, lease["epoch"])
        return before

    def _may_take(self, node_id: int, members: set[int], group_size: int, now: float) -> bool:
        size = max(len(members), group_size)
        fresh = {n: r for n, r in self.reports.items() if n in members and now - r.at <= self.ttl}
        if len(fresh) < size // 2 + 1:
            return False
        mine = fresh[node_id]
        best = max((r.applied_epoch, r.applied_seq) for r in fresh.values())
        return (mine.applied_epoch, mine.applied_seq) >= best

    async def forget(self, coordination: Coordination, node_id: int) -> None:
        """A metadata server unregistered: its lease (if any) is given up."""
        self.reports.pop(node_id, None)
        live = await coordination.get_lease(LEASE_NAME)
        if live is not None and live["holder"] == str(node_id):
            await coordination.release_lease(LEASE_NAME, live["holder"], live["epoch"])
            self._seen(None)

    def annotate(self, nodes: list[Any], now: float) -> None:
        """Add `role`, `epoch` and `applied_seq` to the metadata nodes of a
        routing map's node list."""
        for n in nodes:
            if n["kind"] != "meta":
                continue
            report = self.reports.get(n["id"])
            primary = n["id"] == self.holder
            n["role"] = "primary" if primary else "follower"
            n["epoch"] = self.epoch if primary else (report.applied_epoch if report else 0)
            n["applied_seq"] = report.applied_seq if report else 0
