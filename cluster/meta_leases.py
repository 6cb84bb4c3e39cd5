"""The metadata primary's lease, as mgmtd grants it.

The smallest lease service that makes metadata failover safe, on mgmtd's
own state (the coordination interface of `cluster/coordination*.py` is meant
to take this job over; until then this is it). Every metadata server asks
for the lease every `LEASE_TTL / 3` seconds and reports its log position
(applied seq and that entry's epoch). The holder's request renews it. When
the lease has lapsed, it goes to a requester only if a majority of the
metadata group reported within one TTL and no reporter is ahead of it:
every acknowledged mutation is held by a majority, and any two majorities
meet, so the most up-to-date of a majority has all of them. Each grant to a
new holder raises the epoch, which is persisted (it never goes back, also
across an mgmtd restart) before the grant is answered. A restarted mgmtd
grants nothing for one TTL: the holder it forgot may still hold a lease.

The holder counts its lease from when it *sent* the request, and stops
taking writes at 3/4 of it; mgmtd counts from when it received it: so the
old primary has stopped before anyone else can be granted the lease.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shufflefs.cluster.protocol import LeaseReply
from shufflefs.rpc.files import read_json, write_json_durably

log = logging.getLogger("shufflefs.mgmtd")

LEASE_TTL = 3.0  # seconds
LEASE_FILE = "meta_lease.json"


@dataclass
class Report:
    applied_seq: int
    applied_epoch: int
    at: float


@dataclass
class MetaLeases:
    """Who is metadata primary, in which epoch (*now* is mgmtd's monotonic clock)."""

    path: Path | None = None
    ttl: float = LEASE_TTL
    epoch: int = 0
    holder: int | None = None
    expires: float = 0.0
    reports: dict[int, Report] = field(default_factory=dict)

    @classmethod
    def load(cls, data_dir: Path, now: float) -> MetaLeases:
        path = data_dir / LEASE_FILE
        leases = cls(path)
        if path.exists():
            rec = read_json(path)
            leases.epoch, leases.holder = int(rec["epoch"]), rec.get("holder")
            leases.expires = now + leases.ttl  # it may still hold it: wait one ttl
        return leases

    def _save(self) -> None:
        if self.path is not None:
            write_json_durably(self.path, {"epoch": self.epoch, "holder": self.holder})

    def request(
        self,
        node_id: int,
        applied_seq: int,
        applied_epoch: int,
        members: set[int],
        group_size: int,
        now: float,
    ) -> tuple[LeaseReply, bool]:
        """A metadata server's request; returns the reply and whether the
        holder changed (the caller bumps the routing version). Writes the new
        epoch durably before returning a grant."""
        self.reports[node_id] = Report(applied_seq, applied_epoch, now)
        changed = False
        if self.holder == node_id:  # a renewal (also of a lapsed lease nobody took)
            self.expires = now + self.ttl
        elif (self.holder is None or now >= self.expires) and self._may_take(
            node_id, members | {node_id}, group_size, now
        ):
            self.epoch += 1
            self.holder, self.expires = node_id, now + self.ttl
            self._save()
            changed = True
            log.info("metadata primary is node %d, epoch %d", node_id, self.epoch)
        reply = LeaseReply(
            granted=self.holder == node_id, holder=self.holder, epoch=self.epoch, ttl=self.ttl
        )
        return reply, changed

    def _may_take(self, node_id: int, members: set[int], group_size: int, now: float) -> bool:
        size = max(len(members), group_size)
        fresh = {n: r for n, r in self.reports.items() if n in members and now - r.at <= self.ttl}
        if len(fresh) < size // 2 + 1:
            return False
        mine = fresh[node_id]
        best = max((r.applied_epoch, r.applied_seq) for r in fresh.values())
        return (mine.applied_epoch, mine.applied_seq) >= best

    def forget(self, node_id: int) -> None:
        """A metadata server unregistered: its lease (if any) is given up."""
        self.reports.pop(node_id, None)
        if self.holder == node_id:
            self.expires = 0.0

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
