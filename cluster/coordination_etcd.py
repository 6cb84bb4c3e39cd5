"""`EtcdCoordination`: the HA backend of `Coordination` (cluster/coordination.py).

Several mgmtd instances share one etcd cluster (Debian's ``etcd-server``),
spoken to through etcd's v3 JSON gateway with `etcd3gw` (blocking HTTP, so
every request runs in a worker thread; endpoints are tried in turn, so one
etcd member down changes nothing). Keys, under the configured prefix:

* ``primary``: the primary's rpc address, attached to its election lease
  (ttl seconds, kept alive every ttl/3). Created only if absent (a
  transaction on create_revision 0): whoever creates it is the primary until
  the lease lapses. A primary that could not renew for 2/3 of the ttl steps
  down by itself, before etcd can elect another.
* ``state``: the cluster state record (msgpack), written only by a
  transaction that also checks ``primary`` still has the create revision of
  our own win: a deposed primary cannot overwrite its successor's state.
* ``leases/<name>``: a granted lease {holder, epoch, ttl}, attached to an
  etcd lease of that ttl (etcd expires it); ``epochs/<name>`` the last epoch
  handed out, raised in the same transaction as a grant.
"""

from __future__ import annotations

import base64
import errno
import logging
import math
import threading
import time
from typing import Any

import etcd3gw
import msgpack
import trio
from etcd3gw import exceptions as etcd_errors

from shufflefs.cluster.coordination import Coordination, Lease, check_lease_args
from shufflefs.rpc.addresses import parse_address
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.coordination.etcd")

REQUEST_TIMEOUT = 2.0  # one HTTP request to one etcd member
STANDBY_POLL = 0.25  # how often a standby tries to become the primary


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


class EtcdCoordination(Coordination):
    def __init__(self, endpoints: list[str], prefix: str, ttl: int) -> None:
        super().__init__()
        self.clients = []
        self._order_lock = threading.Lock()  # requests run in several worker threads
        for endpoint in endpoints:
            host, port = parse_address(endpoint)
            self.clients.append(etcd3gw.client(host=host, port=port, timeout=REQUEST_TIMEOUT))
        self.prefix = prefix.rstrip("/")
        self.ttl = max(2, int(ttl))
        self.failover_seconds = self.ttl + STANDBY_POLL  # the lease lapses, a standby sees it
        self._lease_id: int | None = None  # our election lease
        self._won_revision = 0  # create revision of the primary key we made
        self._renewed = 0.0  # monotonic time of the last successful keepalive

    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    # ---- talking to etcd ---------------------------------------------------------

    def _post_sync(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        for client in list(self.clients):
            try:
                result: dict[str, Any] = client.post(client.get_url(path), json=body)
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as exc:
                last = exc
                continue
            with self._order_lock:  # ask this member first next time
                if client in self.clients:
                    self.clients.remove(client)
                    self.clients.insert(0, client)
            return result
        raise FsError(errno.EHOSTDOWN, f"no etcd member answered: {last}")

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await trio.to_thread.run_sync(self._post_sync, path, body)
        except etcd_errors.Etcd3Exception as exc:
            raise FsError(errno.EIO, f"etcd refused {path}: {exc}") from None

    async def _get(self, key: str) -> dict[str, Any] | None:
        """The key's kv (value decoded in ``data``), or None."""
        result = await self._post("/kv/range", {"key": _b64(key)})
        kvs = result.get("kvs") or []
        if not kvs:
            return None
        kv: dict[str, Any] = kvs[0]
        kv["data"] = _unb64(kv.get("value", ""))
        return kv

    async def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> bool:
        result = await self._post("/kv/txn", {"compare": compare, "success": success})
        return bool(result.get("succeeded"))

    async def _grant(self, ttl: int) -> int:
        result = await self._post("/lease/grant", {"TTL": ttl, "ID": 0})
        return int(result["ID"])

    async def _keepalive(self, lease_id: int) -> int:
        result = await self._post("/lease/keepalive", {"ID": lease_id})
        return int(result.get("result", {}).get("TTL", -1))

    def _put(self, key: str, value: bytes, lease: int | None = None) -> dict[str, Any]:
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            put["lease"] = lease
        return {"request_put": put}

    def _still_primary(self) -> dict[str, Any]:
        return {
            "key": _b64(self.key("primary")),
            "result": "EQUAL",
            "target": "CREATE",
            "create_revision": self._won_revision,
        }

    # ---- election ------------------------------------------------------------------

    async def campaign(
        self, address: str, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        while True:
            try:
                if self.role == "primary":
                    await self._renew_election()
                else:
                    await self._try_to_win(address)
            except FsError as exc:
                log.warning("etcd: %s", exc.message)
            if self.role == "primary" and time.monotonic() - self._renewed > self.ttl * 2 / 3:
                self._step_down("the election lease could not be renewed in time")
            if not started:
                task_status.started()
                started = True
            await trio.sleep(self.ttl / 3 if self.role == "primary" else STANDBY_POLL)

    async def _try_to_win(self, address: str) -> None:
        current = await self._get(self.key("primary"))
        if current is not None:
            self.primary = current["data"].decode()
            return
        lease_id = await self._grant(self.ttl)
        granted = time.monotonic()
        result = await self._post(
            "/kv/txn",
            {
                "compare": [
                    {
                        "key": _b64(self.key("primary")),
                        "result": "EQUAL",
                        "target": "CREATE",
                        "create_revision": 0,
                    }
                ],
                "success": [self._put(self.key("primary"), address.encode(), lease_id)],
            },
        )
        if not result.get("succeeded"):
            await self._post("/lease/revoke", {"ID": lease_id})
            return
        self._lease_id = lease_id
        self._won_revision = int(result["header"]["revision"])
        self._renewed = granted
        self.primary = address
        log.info("elected mgmtd primary at %s (etcd revision %d)", address, self._won_revision)
        self.elected.set()

    async def _renew_election(self) -> None:
        assert self._lease_id is not None
        asked = time.monotonic()
        if await self._keepalive(self._lease_id) > 0:
            self._renewed = asked
        else:
            self._step_down("the election lease lapsed")

    def _step_down(self, why: str) -> None:
        log.warning("stepping down as mgmtd primary: %s", why)
        self._lease_id = None
        self._won_revision = 0
        self.primary = None
        self.deposed.set()
        self.elected, self.deposed = trio.Event(), trio.Event()

    # ---- the cluster state ---------------------------------------------------------

    async def load(self) -> dict[str, Any] | None:
        kv = await self._get(self.key("state"))
        if kv is None:
            return None
        record: dict[str, Any] = msgpack.unpackb(kv["data"], raw=False, strict_map_key=False)
        return record

    async def save(self, record: dict[str, Any]) -> None:
        if self.role != "primary":
            raise self.not_primary()
        data = msgpack.packb(record, use_bin_type=True)
        if not await self._txn([self._still_primary()], [self._put(self.key("state"), data)]):
            self._step_down("another mgmtd holds the election key")
            raise self.not_primary()

    # ---- leases ----------------------------------------------------------------------

    def _require_primary(self) -> None:
        if self.role != "primary":
            raise self.not_primary()

    async def get_lease(self, name: str) -> Lease | None:
        kv = await self._get(self.key("leases", name))
        if kv is None:
            return None
        lease: Lease = msgpack.unpackb(kv["data"], raw=False)
        return lease

    async def grant_lease(self, name: str, holder: str, ttl: float) -> Lease:
        check_lease_args(name, holder, ttl)
        self._require_primary()
        kv = await self._get(self.key("leases", name))
        if kv is not None:
            held: Lease = msgpack.unpackb(kv["data"], raw=False)
            if held["holder"] != holder:
                raise FsError(errno.EBUSY, f"lease {name} is held by {held['holder']}")
            return await self.renew_lease(name, holder, held["epoch"])
        epochs = await self._get(self.key("epochs", name))
        epoch = 1 + (int(epochs["data"]) if epochs is not None else 0)
        unchanged: dict[str, Any] = {"key": _b64(self.key("epochs", name)), "result": "EQUAL"}
        if epochs is None:
            unchanged.update(target="CREATE", create_revision=0)
        else:
            unchanged.update(target="MOD", mod_revision=int(epochs["mod_revision"]))
        etcd_lease = await self._grant(max(2, math.ceil(ttl)))
        lease = Lease(name=name, holder=holder, epoch=epoch, ttl=ttl)
        absent = {
            "key": _b64(self.key("leases", name)),
            "result": "EQUAL",
            "target": "CREATE",
            "create_revision": 0,
        }
        ok = await self._txn(
            [self._still_primary(), absent, unchanged],
            [
                self._put(self.key("epochs", name), str(epoch).encode()),
                self._put(self.key("leases", name), msgpack.packb(lease), etcd_lease),
            ],
        )
        if not ok:
            await self._post("/lease/revoke", {"ID": etcd_lease})
            raise FsError(errno.EBUSY, f"lease {name} was granted to another holder meanwhile")
        return lease

    async def renew_lease(self, name: str, holder: str, epoch: int) -> Lease:
        self._require_primary()
        kv = await self._get(self.key("leases", name))
        held: Lease | None = None if kv is None else msgpack.unpackb(kv["data"], raw=False)
        if kv is None or held is None or held["holder"] != holder or held["epoch"] != epoch:
            raise FsError(errno.ESTALE, f"lease {name} epoch {epoch} of {holder} is gone")
        if await self._keepalive(int(kv["lease"])) <= 0:
            raise FsError(errno.ESTALE, f"lease {name} epoch {epoch} of {holder} lapsed")
        return held

    async def release_lease(self, name: str, holder: str, epoch: int) -> None:
        self._require_primary()
        kv = await self._get(self.key("leases", name))
        if kv is None:
            return
        held: Lease = msgpack.unpackb(kv["data"], raw=False)
        if held["holder"] == holder and held["epoch"] == epoch:
            await self._post("/lease/revoke", {"ID": int(kv["lease"])})
