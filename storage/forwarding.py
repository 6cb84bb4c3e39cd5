"""`Forwarding`: where a target stands in its chain, and sending an update on
to its successor (the CRAQ-style write path, docs/storage.md "Chain
replication").

A replica forwards an update while it stages and flushes it itself, and
commits only once both are done (its own copy durable, its successor's
acknowledgement in): so the tail commits first and the head last. A
successor that cannot be reached is reported to mgmtd (which checks for
itself and takes it out of the chain) and the caller gets ESTALE: it
retries once the chain changed. A forward to a chain that changes meanwhile
is cancelled at once (`routing_changed`) rather than waiting for its timeout.

Every update holds its admission (`admitted`: its place, counted per chain
and version) until it is done here, so a resync can wait out the updates a
replica took at an older chain version (`barrier`): those never reach the
target that syncs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from shufflefs.cluster.protocol import TargetInfo
from shufflefs.cluster.routing import ChainWatch, Routing
from shufflefs.rpc import FsError
from shufflefs.rpc.errors import CONNECTION_FAILURES
from shufflefs.rpc.transport import Buffer
from shufflefs.storage.chain import Place
from shufflefs.storage.context import NodeContext
from shufflefs.storage.protocol import (
    FORWARD_TIMEOUT,
    NEED_FULL,
    StorageStub,
    WriteResult,
    chain_call_timeout,
)

log = logging.getLogger("shufflefs.storage.forwarding")

REPORT_TIMEOUT = 8.0  # telling mgmtd a successor is unreachable, and refreshing routing after
BARRIER_POLL = 0.005  # seconds between looks at the updates a barrier waits out


@dataclass(frozen=True)
class ForwardedUpdate:
    """What a replica is told of an update: the chunk, where its bytes go,
    the version it makes of which base version (*full*: the bytes are the
    whole chunk, whatever the replica holds)."""

    cid: bytes
    offset: int
    chunk_size: int
    version: int
    base_version: int
    full: bool


class Forwarding:
    """Chain membership checks and calls to this node's successors."""

    def __init__(self, node: NodeContext, forward_timeout: float = FORWARD_TIMEOUT) -> None:
        self.node = node
        self.forward_timeout = forward_timeout
        # forwards in flight, cancelled if their chain changes (`routing_changed`)
        self.forwards = ChainWatch()
        self.full_resends = 0  # deltas a successor refused (NEED_FULL) and got whole
        self._admitted: dict[tuple[int, int], int] = {}  # (chain, version) -> updates here
        self.barriers_waiting = 0  # barriers waiting out older updates (tests, debugging)

    @contextlib.asynccontextmanager
    async def admitted(
        self, target: int, chain: int, chain_version: int, *, head: bool
    ) -> AsyncIterator[Place | None]:
        """`place`, and the update counted at its chain version until the
        body is done (what `barrier` waits for)."""
        place = await self.place(target, chain, chain_version, head=head)
        key = (chain, chain_version)  # counted with no checkpoint after the check
        self._admitted[key] = self._admitted.get(key, 0) + 1
        try:
            yield place
        finally:
            left = self._admitted[key] - 1
            if left:
                self._admitted[key] = left
            else:
                del self._admitted[key]

    def _older(self, chain: int, version: int) -> int:
        """Updates of *chain* admitted here at a version before *version*, going on."""
        return sum(n for (c, v), n in self._admitted.items() if c == chain and v < version)

    async def barrier(self, target: int, chain: int, chain_version: int, timeout: float) -> None:
        """Return once *target* takes updates of *chain* at *chain_version*
        (our map refreshed to it if older) and no update admitted here at an
        older version is still going on. A syncing tail asks this of its
        source before comparing chunks: an update the source took at the
        version before the tail joined is not forwarded to it, and the tail
        must see it in the source's copy, never miss it. ESTALE if the chain
        is at another version here (after a refresh), EAGAIN if the older
        updates are not done within *timeout*."""
        if self.node.routing is None:
            return
        await self._members_at(target, chain, chain_version)
        older = self._older(chain, chain_version)
        if not older:
            return
        log.info(
            "sync barrier chain=%d version=%d: waiting for %d updates at older versions",
            chain,
            chain_version,
            older,
        )
        self.barriers_waiting += 1
        try:
            with trio.move_on_after(timeout):
                while self._older(chain, chain_version):
                    await trio.sleep(BARRIER_POLL)
                return
        finally:
            self.barriers_waiting -= 1
        raise FsError(
            errno.EAGAIN,
            f"updates of chain {chain} at a version before {chain_version} still going on "
            f"after {timeout:g}s",
        )

    # ---- where a call stands ---------------------------------------------

    async def place(
        self, target: int, chain: int, chain_version: int, *, head: bool
    ) -> Place | None:
        """Where *target* stands in *chain* at *chain_version*: ESTALE if the
        chain is at another version, or the target is not the head (for a
        client's call, *head*) or not a later replica (for a forwarded one).
        A caller with a newer version than ours makes us refresh first.
        None when this node has no routing map at all (a lone target)."""
        if self.node.routing is None:
            return None
        routing, members = await self._members_at(target, chain, chain_version)
        ids = [t["id"] for t in members]
        index = ids.index(target)
        if head and index != 0:
            raise FsError(
                errno.ESTALE, f"target {target} is not the head of chain {chain} (members: {ids})"
            )
        if not head and index == 0:
            raise FsError(
                errno.ESTALE, f"target {target} is the head of chain {chain}, not a replica"
            )
        return Place(routing, chain, chain_version, members, index)

    async def _members_at(
        self, target: int, chain: int, chain_version: int
    ) -> tuple[Routing, list[TargetInfo]]:
        """Our map and *chain*'s write targets, if the chain is at exactly
        *chain_version* here (refreshed first if the caller's is newer) and
        *target* is one of them; ESTALE otherwise."""
        routing_source = self.node.routing
        assert routing_source is not None
        try:
            info = routing_source.current.chains.get(chain)
            stale = info is None or chain_version > info["version"]
        except FsError:
            stale = True
        if stale:
            try:
                await routing_source.refresh()
            except FsError as exc:  # judge by ours: ESTALE below, the caller retries
                log.info("routing refresh for chain=%d failed: %s", chain, exc.message)
        try:
            routing = routing_source.current
        except FsError as exc:
            raise FsError(errno.ESTALE, f"no routing map yet: {exc.message}") from None
        info = routing.chains.get(chain)
        if info is None:
            raise FsError(errno.ESTALE, f"chain {chain} is unknown to this storage node")
        if info["version"] != chain_version:
            raise FsError(
                errno.ESTALE,
                f"chain {chain} is at version {info['version']}, the call used {chain_version}",
            )
        members = routing.write_targets(chain)
        if target not in [t["id"] for t in members]:
            raise FsError(
                errno.ESTALE,
                f"target {target} takes no writes in chain {chain} "
                f"(members: {[t['id'] for t in members]})",
            )
        return routing, members

    async def check_min_replicas(self, place: Place, target: int, head: bool) -> Place:
        """EROFS when fewer than min_replicas of the chain serve. Our map may
        be older than mgmtd's (a replica just came back and our poll has not
        seen it yet), so before refusing we fetch the current map once: a
        chain that moved on answers ESTALE (the client retries on the new
        map), and a refusal always reflects what mgmtd knows."""
        if self._enough_replicas(place):
            return place
        routing_source = self.node.routing
        if routing_source is None:
            return place
        try:
            await routing_source.refresh()
        except FsError as exc:
            log.info("routing refresh for chain=%d failed: %s", place.chain, exc.message)
        again = await self.place(target, place.chain, place.version, head=head)
        if again is None or self._enough_replicas(again):
            return again or place

        serving = again.routing.serving_targets(again.chain)
        minimum = again.routing.config.get("min_replicas", 1)
        raise FsError(
            errno.EROFS,
            f"chain {again.chain} has {len(serving)} serving replica(s), fewer than "
            f"min_replicas={minimum}: writes are refused until a replica is back",
        )

    @staticmethod
    def _enough_replicas(place: Place) -> bool:
        serving = place.routing.serving_targets(place.chain)
        return len(serving) >= place.routing.config.get("min_replicas", 1)

    # ---- forwarding ------------------------------------------------------

    async def forward_update(
        self,
        update: ForwardedUpdate,
        place: Place,
        data: bytes | bytearray,
        whole_chunk: Callable[[], Awaitable[bytes]],
    ) -> None:
        """Send an update to our successor (`replicate`): the delta, or the
        whole new chunk if *update* is full or if the successor answers
        `NEED_FULL` (it does not hold the update's base version), which
        *whole_chunk* gives (the update as staged here)."""
        succ = place.successor
        assert succ is not None

        async def send(stub: StorageStub) -> None:
            try:
                await stub.replicate(
                    succ["id"],
                    place.chain,
                    place.version,
                    update.cid,
                    0 if update.full else update.offset,
                    update.chunk_size,
                    update.version,
                    update.base_version,
                    update.full,
                    data,
                )
            except FsError as exc:
                if exc.code != NEED_FULL or update.full:
                    raise
                await self._resend_whole(stub, place, update, await whole_chunk(), exc)

        await self.call_successor(place, send)

    async def _resend_whole(
        self,
        stub: StorageStub,
        place: Place,
        update: ForwardedUpdate,
        content: bytes,
        refusal: FsError,
    ) -> WriteResult:
        """Send *update* again as the whole new chunk (*content*): our
        successor refused its delta with `NEED_FULL` (*refusal*)."""
        succ = place.successor
        assert succ is not None
        self.full_resends += 1
        log.info(
            "replica needs the whole chunk target=%d chunk=%s version=%d bytes=%d: %s",
            succ["id"],
            update.cid.hex(),
            update.version,
            len(content),
            refusal.message,
        )
        return await stub.replicate(
            succ["id"],
            place.chain,
            place.version,
            update.cid,
            0,
            update.chunk_size,
            update.version,
            update.base_version,
            True,
            content,
        )

    async def forward_updates(
        self,
        place: Place,
        updates: Sequence[tuple[ForwardedUpdate, Buffer]],
        whole_chunk: Callable[[int], Awaitable[bytes]],
    ) -> list[WriteResult | FsError]:
        """`forward_update` of many updates of one chain in one
        `replicate_many` (one `replicate` each to a successor that answers
        ENOSYS): per update the successor's result or its error.
        One the successor answers `NEED_FULL` is sent again whole, alone
        (*whole_chunk(i)*: update i as staged here). A failure of the call
        as a whole (the successor unreachable, the chain changed) raises, as
        `forward_update` does."""
        succ = place.successor
        assert succ is not None
        out: list[WriteResult | FsError] = []

        async def send(stub: StorageStub) -> None:
            items = [
                (
                    succ["id"],
                    place.chain,
                    place.version,
                    u.cid,
                    0 if u.full else u.offset,
                    u.chunk_size,
                    u.version,
                    u.base_version,
                    u.full,
                    len(data),
                )
                for u, data in updates
            ]
            try:
                results = await stub.replicate_many(items, [data for _, data in updates])
            except FsError as exc:
                if exc.code != errno.ENOSYS:
                    raise
                # a successor from before `replicate_many` (a rolling upgrade): one by one
                results = []
                for item, (_, data) in zip(items, updates, strict=True):
                    try:
                        results.append(await stub.replicate(*item[:9], data))
                    except FsError as one:
                        if one.code in CONNECTION_FAILURES:
                            raise
                        results.append(one)
            for i, result in enumerate(results):
                u = updates[i][0]
                if isinstance(result, FsError) and result.code == NEED_FULL and not u.full:
                    try:
                        content = await whole_chunk(i)
                    except FsError as exc:  # not staged here: that update fails alone
                        out.append(exc)
                        continue
                    try:
                        result = await self._resend_whole(stub, place, u, content, result)
                    except FsError as exc:
                        if exc.code in CONNECTION_FAILURES:
                            raise
                        result = exc
                out.append(result)

        await self.call_successor(place, send)
        return out

    async def forward_file_op(
        self, place: Place, ino: int, size: int | None, chunk_size: int
    ) -> None:
        """Send a truncation (*size* given) or a removal of file *ino* on to
        our successor."""
        succ = place.successor
        assert succ is not None

        async def send(stub: StorageStub) -> None:
            if size is None:
                await stub.replicate_remove(succ["id"], place.chain, place.version, ino)
            else:
                await stub.replicate_truncate(
                    succ["id"], place.chain, place.version, ino, size, chunk_size
                )

        await self.call_successor(place, send)

    async def forward_files_removal(self, place: Place, inos: list[int]) -> None:
        """Send a removal of files *inos* on to our successor."""
        succ = place.successor
        assert succ is not None

        async def send(stub: StorageStub) -> None:
            await stub.replicate_remove_files(succ["id"], place.chain, place.version, inos)

        await self.call_successor(place, send)

    async def call_successor(
        self, place: Place, call: Callable[[StorageStub], Awaitable[None]]
    ) -> None:
        """Run *call* against our successor. If it cannot be reached, report it
        to mgmtd, refresh our routing and answer ESTALE: the client retries
        once the chain changed. Its answers (ENOSPC, EIO, ESTALE...) pass
        through: a replica never relays a connection failure upstream."""
        succ = place.successor
        assert succ is not None
        rpc = self.node.rpc
        if rpc is None:
            raise FsError(errno.EIO, "this storage service has no rpc client to forward with")
        try:
            address = place.routing.target_address(succ["id"])
        except FsError as exc:
            raise FsError(errno.ESTALE, exc.message) from None
        # our successor is the head of the rest of the chain
        stub = StorageStub(
            rpc, address, timeout=chain_call_timeout(place.remaining, self.forward_timeout)
        )
        # If mgmtd changes the chain meanwhile (it took a silent successor out
        # after the heartbeat timeout), stop waiting for the timeout: the
        # client retries on the new chain at once.
        try:
            with self.forwards.watching(place.chain, place.version) as watch:
                await call(stub)
        except FsError as exc:
            if exc.code not in CONNECTION_FAILURES:
                raise
            await self._successor_unreachable(place, succ, address, exc)
            raise FsError(
                errno.ESTALE,
                f"replica target {succ['id']} on node {succ['node']} of chain {place.chain} is "
                f"unreachable ({exc.message}); reported to mgmtd: retry once the chain changed",
            ) from None
        if watch.cancelled_caught:
            raise FsError(
                errno.ESTALE,
                f"chain {place.chain} changed while forwarding to target {succ['id']}: retry",
            )

    def routing_changed(self, routing: Routing) -> None:
        """Cancel forwards to chains that changed (a `RoutingCache` listener)."""
        self.forwards.routing_changed(routing)

    async def _successor_unreachable(
        self, place: Place, succ: TargetInfo, address: str, exc: FsError
    ) -> None:
        log.warning(
            "successor unreachable chain=%d target=%d node=%d address=%s: %s",
            place.chain,
            succ["id"],
            succ["node"],
            address,
            exc.message,
        )
        node = self.node
        if node.rpc is not None:
            node.rpc.drop(address)
        # bounded by our own forward timeout too: our predecessor waits for us
        # only a forward timeout longer than we waited for our successor
        with trio.move_on_after(min(REPORT_TIMEOUT, self.forward_timeout)):
            if node.mgmtd is not None and node.node_id is not None:
                try:
                    marked = await node.mgmtd.report_unreachable(node.node_id, succ["node"])
                    log.info(
                        "reported node=%d unreachable; marked offline=%s", succ["node"], marked
                    )
                except FsError as report_exc:
                    log.warning(
                        "reporting node=%d unreachable failed: %s", succ["node"], report_exc.message
                    )
            if node.routing is not None:
                with contextlib.suppress(FsError):
                    await node.routing.refresh()
