"""Log shipping: the primary sends each committed group to the followers, in
order, and a mutation is acknowledged once a majority holds it durably.

The primary (`Replicator`) keeps one link per follower. A link learns the
follower's position (applied seq and that entry's epoch), and if the
primary's log has the same entry there (same seq, same epoch: one epoch has
one primary, whose log is gapless, so equal entries mean equal logs up to
there) it sends what follows, in batches, as a raw payload; the follower
applies them in one durable commit and answers its new position. A follower
whose position the log cannot match (it missed more than the log still
holds, or it holds entries a deposed primary never got acknowledged) is
told to copy a snapshot (`replication_snapshot.py`).

`Writer` calls `wait_durable(seq)` after each commit: it returns once the
primary itself and enough followers for a majority of the group have
applied *seq*. The follower side (`ReplicationService`) refuses any epoch
older than the newest it has seen, so a deposed primary cannot collect
acknowledgements, and answers a primary of a newer epoch, stepping down
itself if it was one.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from shufflefs.metadata.records import pack, unpack
from shufflefs.metadata.replication_snapshot import SnapshotReceiver
from shufflefs.metadata.replog import Position
from shufflefs.metadata.txn import Transactions
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import Backoff
from shufflefs.rpc.schema import rpc_method

log = logging.getLogger("shufflefs.metadata.replication")

BATCH_BYTES = 4 << 20  # log entries per append call, about
APPEND_TIMEOUT = 2.0
IDLE_PROBE = 0.5  # a link with nothing to send still probes its follower this often
STALE_EPOCH = "stale epoch"  # in the message of the ESTALE a follower refuses an old epoch with
NOT_ACKNOWLEDGED = errno.ESTALE  # a mutation whose majority never came: retry it elsewhere


def position_of(reply: dict[str, Any]) -> Position:
    return Position(reply["applied_seq"], reply["applied_epoch"], reply["epoch"])


class _Signal:
    """Wake every waiter (a fresh event per round)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            await self._event.wait()


class Replicator:
    """The primary's side: one link per follower, and the majority wait.

    *peers* gives the other members of the metadata group (node id ->
    address), *group_size* how many members there are in all (this one
    included); *epoch* is the primary's; *deposed* is called when a
    follower has seen a newer epoch (this primary must step down);
    *resync* asks a follower to copy a snapshot from us.
    """

    def __init__(
        self,
        txns: Transactions,
        rpc: RpcClient,
        *,
        peers: Callable[[], dict[int, str]],
        group_size: Callable[[], int],
        epoch: int,
        deposed: Callable[[int], None],
        resync: Callable[[str, int], Awaitable[None]] | None = None,
    ) -> None:
        self.txns = txns
        self.rpc = rpc
        self.peers = peers
        self.group_size = group_size
        self.epoch = epoch
        self.deposed = deposed
        self.resync = resync
        self.acked: dict[int, int] = {}  # follower -> the seq up to which it matches our log
        self.active = True  # False once this primary stepped down
        self._probed: set[int] = set()  # followers whose position was just learned
        self._committed = _Signal()
        self._acked = _Signal()

    def quorum(self) -> int:
        return self.group_size() // 2 + 1

    def holders(self, seq: int) -> int:
        """How many members hold entry *seq* (this one included)."""
        return 1 + sum(1 for node, acked in self.acked.items() if acked >= seq)

    def trim_point(self, keep: int) -> int:
        """Up to where the log may go: what every follower has; a follower
        that is not in touch, or a member not registered yet (the group
        is smaller than its configured size), holds back no more than the
        last *keep* entries (it copies a snapshot when it is back)."""
        last = self.txns.last_seq
        peers = self.peers()
        complete = len(peers) + 1 >= self.group_size()
        if peers and complete and all(p in self.acked for p in peers):
            return min(self.acked[p] for p in peers)
        return min([last - keep, *self.acked.values()])

    def stop(self) -> None:
        """Stepped down: whoever waits for a majority is answered NOT_ACKNOWLEDGED."""
        self.active = False
        self._acked.fire()

    def committed(self) -> None:
        """A new entry is in the log: links send it."""
        self._committed.fire()

    async def wait_durable(self, seq: int, timeout: float) -> None:
        """Return once a majority holds *seq*; NOT_ACKNOWLEDGED after *timeout*."""
        with trio.move_on_after(timeout):
            while self.active and self.holders(seq) < self.quorum():
                await self._acked.wait(IDLE_PROBE)
            if self.active:
                return
        raise FsError(
            NOT_ACKNOWLEDGED,
            f"log entry {seq} reached {self.holders(seq)} of {self.group_size()} "
            "metadata servers: not acknowledged",
        )

    async def run(self) -> None:
        """Keep a link to every follower, until cancelled."""
        async with trio.open_nursery() as nursery:
            links: dict[int, tuple[str, trio.CancelScope]] = {}
            while True:
                peers = self.peers()
                for node, (address, scope) in list(links.items()):
                    if peers.get(node) != address:
                        scope.cancel()
                        del links[node]
                        self.acked.pop(node, None)
                for node, address in peers.items():
                    if node not in links:
                        scope = trio.CancelScope()
                        links[node] = (address, scope)
                        nursery.start_soon(self._link, node, address, scope)
                await trio.sleep(IDLE_PROBE)

    async def _link(self, node: int, address: str, scope: trio.CancelScope) -> None:
        with scope:
            backoff = Backoff(first=0.05, cap=1.0)
            known: Position | None = None
            while True:
                try:
                    known = await self._step(node, address, known)
                    backoff.reset()
                except FsError as exc:
                    if exc.code == errno.ESTALE and STALE_EPOCH in exc.message:
                        log.warning("follower %s: %s: stepping down", address, exc.message)
                        self.deposed(self.epoch)
                        return
                    log.debug("follower %s: %s", address, exc.message)
                    known = None
                    self.acked.pop(node, None)
                    await backoff.sleep()

    async def _step(self, node: int, address: str, known: Position | None) -> Position:
        """One exchange with a follower: a probe, or the next batch."""
        if known is None:
            self._probed.add(node)
            return position_of(await self._append(address, -1, 0, None))
        probed = node in self._probed
        self._probed.discard(node)
        with self.txns.env.begin(write=False) as txn:
            ours = self.txns.log.epoch_at(txn, known.applied_seq)
            matches = ours == known.applied_epoch and known.applied_seq <= self.txns.last_seq
            if matches:
                self.acked[node] = known.applied_seq
                self._acked.fire()
            entries = (
                self.txns.log.entries(txn, known.applied_seq + 1, BATCH_BYTES) if matches else []
            )
        if not matches:
            log.info(
                "follower %s at %d (epoch %d) does not match our log: it copies a snapshot",
                address,
                known.applied_seq,
                known.applied_epoch,
            )
            self.acked.pop(node, None)
            if self.resync is None:
                raise FsError(errno.EIO, "no snapshot source")
            await self.resync(address, self.epoch)
            return position_of(await self._append(address, -1, 0, None))
        if probed and entries:  # (re)joined behind: which way it catches up, for the record
            log.info(
                "follower %s at %d is %d entries behind: catching up from the log",
                address,
                known.applied_seq,
                self.txns.last_seq - known.applied_seq,
            )
        if not entries:
            await self._committed.wait(IDLE_PROBE)
            if self.txns.last_seq == known.applied_seq:
                return position_of(await self._append(address, -1, 0, None))
            return known
        reply = await self._append(address, known.applied_seq, known.applied_epoch, pack(entries))
        return position_of(reply)

    async def _append(
        self, address: str, prev_seq: int, prev_epoch: int, payload: bytes | None
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self.rpc.call(
            address,
            "repl_append",
            {"epoch": self.epoch, "prev_seq": prev_seq, "prev_epoch": prev_epoch},
            payload=payload,
            timeout=APPEND_TIMEOUT,
        )
        return result


class ReplicationService:
    """The follower's rpc side of log shipping.

    *epoch_seen* is told of every newer epoch (a primary of it exists:
    whoever held an older one steps down); *may_follow* is False while this
    server is a primary of an epoch at least as new.
    """

    def __init__(
        self,
        txns: Transactions,
        *,
        epoch_seen: Callable[[int], None],
        may_follow: Callable[[int], bool],
        snapshots: SnapshotReceiver | None = None,
    ) -> None:
        self.txns = txns
        self.epoch_seen = epoch_seen
        self.may_follow = may_follow
        self.snapshots = snapshots
        self._lock = trio.Lock()
        self.applied = _Signal()  # fired after each apply (read-your-writes waits on it)
        # trio time of the last append or snapshot piece from a primary we follow
        # (follower reads stop when it is too long ago: follower_reads.py)
        self.last_contact = -1e9

    @rpc_method
    async def repl_append(
        self, epoch: int, prev_seq: int, prev_epoch: int, payload: bytearray | None = None
    ) -> dict[str, int]:
        """Apply the entries in *payload* (packed `[seq, epoch, ops]`s) if
        they follow our log at *prev_seq*/*prev_epoch*; answer our position
        either way (a probe sends none). ESTALE for an epoch older than ours."""
        async with self._lock:
            position = await self._accept(epoch)
            self.last_contact = trio.current_time()
            follows = (prev_seq, prev_epoch) == (position.applied_seq, position.applied_epoch)
            if payload and follows:
                entries = unpack(bytes(payload))
                position = await trio.to_thread.run_sync(self.txns.apply_entries, entries, epoch)
                self.applied.fire()
            return position.wire()

    async def _accept(self, epoch: int) -> Position:
        """Refuse an older epoch; remember a newer one. Returns our position."""
        position = self.txns.position()
        if epoch < position.epoch or not self.may_follow(epoch):
            raise FsError(
                errno.ESTALE, f"{STALE_EPOCH} {epoch}: this server has seen {position.epoch}"
            )
        if epoch > position.epoch:
            await trio.to_thread.run_sync(self.txns.raise_epoch, epoch)
            position = self.txns.position()
        self.epoch_seen(epoch)
        return position

    @rpc_method
    async def repl_snapshot(
        self, epoch: int, offset: int, done: bool, payload: bytearray | None = None
    ) -> dict[str, int]:
        """A piece of the primary's namespace (`replication_snapshot.py`);
        after the last one it replaces ours. Answers our position."""
        if self.snapshots is None:
            raise FsError(errno.EOPNOTSUPP, "this server takes no snapshots")
        async with self._lock:
            await self._accept(epoch)
            self.last_contact = trio.current_time()
            if await self.snapshots.piece(offset, bytes(payload or b""), done):
                self.applied.fire()
            position = self.txns.position()
            if done and epoch > position.epoch:
                await trio.to_thread.run_sync(self.txns.raise_epoch, epoch)
                position = self.txns.position()
            return position.wire()
