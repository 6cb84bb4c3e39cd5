"""The coordination service under mgmtd: one interface, two backends.

Where the cluster state lives, which mgmtd instance is the primary, and the
leases mgmtd grants (the metadata primary's lease) are all behind
`Coordination`, so mgmtd's logic (cluster/state.py) is the same either way:

* `EmbeddedCoordination` (the default): one mgmtd, the state in its own
  LMDB (`MgmtdStore`), always primary; leases timed by its own clock and
  persisted, so after a restart a lease granted before counts as held for a
  whole ttl more (nobody else gets it while its holder may still act on it).
* `EtcdCoordination` (cluster/coordination_etcd.py, mgmtd's ``etcd`` setting):
  several mgmtd instances, the state in etcd, the primary elected with an
  etcd lease, every save fenced on still holding the election key; leases are
  etcd leases.

Leases (`grant_lease`, `renew_lease`, `release_lease`, `get_lease`): a named
lease has one holder at a time and an *epoch* that rises with every grant
to a new holder (never reused, also across mgmtd restarts and failovers), so
the holder's epoch fences its work: anyone who saw a higher epoch refuses
the older one. Errors: ``EBUSY`` (held by another holder, not yet lapsed),
``ESTALE`` (renewing a lease that lapsed or was granted again since),
`NOT_PRIMARY` (asked a standby). A holder must stop acting before its lease
ends by its own clock: renew well before ``ttl`` (every ttl/3).
"""

from __future__ import annotations

import errno
import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, TypedDict

import trio

from shufflefs.cluster.protocol import NOT_PRIMARY
from shufflefs.cluster.store import MgmtdStore
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.coordination")

MAX_LEASE_TTL = 300.0


class Lease(TypedDict):
    name: str
    holder: str
    epoch: int  # rises with every grant to a new holder
    ttl: float  # seconds a grant or renewal lasts


def check_lease_args(name: str, holder: str, ttl: float) -> None:
    if not name or not holder or len(name) > 200 or len(holder) > 200:
        raise FsError(errno.EINVAL, "a lease needs a name and a holder (at most 200 chars)")
    if not 0 < ttl <= MAX_LEASE_TTL:
        raise FsError(errno.EINVAL, f"lease ttl must be in (0, {MAX_LEASE_TTL:g}] seconds")


class Coordination(ABC):
    """What mgmtd needs from the store under it (see the module docstring)."""

    def __init__(self) -> None:
        self.elected = trio.Event()  # set while this instance is the primary
        self.deposed = trio.Event()  # set when it stops being the primary
        self.primary: str | None = None  # the primary's rpc address, if known
        # how long this backend may be without a primary when one dies (the
        # election); a lease outlives it there (cluster/meta_leases.py)
        self.failover_seconds = 0.0

    @property
    def role(self) -> str:
        return "primary" if self.elected.is_set() and not self.deposed.is_set() else "standby"

    def not_primary(self) -> FsError:
        where = f"the primary is at {self.primary}" if self.primary else "no primary is elected yet"
        return FsError(NOT_PRIMARY, f"this mgmtd is a standby; {where}")

    @abstractmethod
    async def campaign(
        self, address: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run for primary as *address* forever; `elected` is set on winning
        and `deposed` on losing it, and then both are replaced by fresh events
        for the next term (a caller keeps the pair it waits on)."""

    @abstractmethod
    async def load(self) -> dict[str, Any] | None:
        """The persisted cluster state record (None: a new cluster)."""

    @abstractmethod
    async def save(self, record: dict[str, Any]) -> None:
        """Persist the whole record durably; `NOT_PRIMARY` if this instance is
        no longer the primary (nothing is written then)."""

    @abstractmethod
    async def grant_lease(self, name: str, holder: str, ttl: float) -> Lease: ...

    @abstractmethod
    async def renew_lease(self, name: str, holder: str, epoch: int) -> Lease: ...

    @abstractmethod
    async def release_lease(self, name: str, holder: str, epoch: int) -> None: ...

    @abstractmethod
    async def get_lease(self, name: str) -> Lease | None: ...

    def close(self) -> None:  # noqa: B027 (a backend may hold nothing)
        """Release what the backend holds open."""


class EmbeddedCoordination(Coordination):
    """One mgmtd: state in its LMDB, always the primary, leases by its clock."""

    def __init__(self, data_dir: str | Path) -> None:
        super().__init__()
        self.store = MgmtdStore(data_dir)
        # name -> (lease, deadline on the monotonic clock)
        self._leases: dict[str, tuple[Lease, float]] = {}
        self._epochs: dict[str, int] = {}
        saved = self.store.load_leases()
        now = time.monotonic()
        for name, entry in saved.get("epochs", {}).items():
            self._epochs[name] = int(entry)
        for lease in saved.get("leases", []):
            # held for a whole ttl from now: its holder may still act on it
            held = Lease(
                name=lease["name"],
                holder=lease["holder"],
                epoch=int(lease["epoch"]),
                ttl=float(lease["ttl"]),
            )
            self._leases[held["name"]] = (held, now + held["ttl"])

    async def campaign(
        self, address: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.primary = address
        self.elected.set()
        task_status.started()
        await trio.sleep_forever()

    async def load(self) -> dict[str, Any] | None:
        return await trio.to_thread.run_sync(self.store.load)

    async def save(self, record: dict[str, Any]) -> None:
        await trio.to_thread.run_sync(self.store.save, record)

    def _live(self, name: str) -> Lease | None:
        entry = self._leases.get(name)
        if entry is None or entry[1] <= time.monotonic():
            return None
        return entry[0]

    async def _persist_leases(self) -> None:
        now = time.monotonic()
        record = {
            "epochs": dict(self._epochs),
            "leases": [dict(lease) for lease, deadline in self._leases.values() if deadline > now],
        }
        await trio.to_thread.run_sync(self.store.save_leases, record)

    async def grant_lease(self, name: str, holder: str, ttl: float) -> Lease:
        check_lease_args(name, holder, ttl)
        live = self._live(name)
        if live is not None and live["holder"] != holder:
            raise FsError(errno.EBUSY, f"lease {name} is held by {live['holder']}")
        if live is None:
            self._epochs[name] = self._epochs.get(name, 0) + 1
            lease = Lease(name=name, holder=holder, epoch=self._epochs[name], ttl=ttl)
        else:
            lease = Lease(name=name, holder=holder, epoch=live["epoch"], ttl=ttl)
        self._leases[name] = (lease, time.monotonic() + ttl)
        await self._persist_leases()  # the epoch is durable before anyone uses it
        return lease

    async def renew_lease(self, name: str, holder: str, epoch: int) -> Lease:
        live = self._live(name)
        if live is None or live["holder"] != holder or live["epoch"] != epoch:
            raise FsError(errno.ESTALE, f"lease {name} epoch {epoch} of {holder} is gone")
        self._leases[name] = (live, time.monotonic() + live["ttl"])
        return live

    async def release_lease(self, name: str, holder: str, epoch: int) -> None:
        live = self._live(name)
        if live is not None and live["holder"] == holder and live["epoch"] == epoch:
            del self._leases[name]
            await self._persist_leases()

    async def get_lease(self, name: str) -> Lease | None:
        return self._live(name)

    def close(self) -> None:
        self.store.close()


def open_coordination(data_dir: str, etcd: list[str], prefix: str, ttl: int) -> Coordination:
    """The backend mgmtd's config asks for: etcd when endpoints are given."""
    if etcd:
        from shufflefs.cluster.coordination_etcd import EtcdCoordination

        return EtcdCoordination(etcd, prefix, ttl)
    return EmbeddedCoordination(data_dir)
