"""`ResyncWorker`: bring a syncing target up to date from a serving replica
(docs/storage.md "Resync").

While the routing map shows one of our targets syncing, the chain already
forwards every new update to it; resync pages through the source's chunks
(the nearest serving replica upstream), copies every chunk that differs,
deletes ours that the source lacks, and then tells mgmtd `sync_done`, which
makes the target serving again. What the target learns meanwhile (chunks
verified, chunks the chain changed since a copy was read) is its
`SyncState`, one per chain version.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from shufflefs.cluster.metrics_catalog import RESYNC_BYTES, RESYNC_CHUNKS
from shufflefs.cluster.protocol import ChainInfo
from shufflefs.cluster.routing import Routing
from shufflefs.rpc import FsError
from shufflefs.rpc.retry import Backoff
from shufflefs.storage.chain import Place, ResyncStats, SyncState, chain_of, same_info
from shufflefs.storage.context import NodeContext, read_copy
from shufflefs.storage.protocol import StorageStub
from shufflefs.storage.store import ChunkStore

log = logging.getLogger("shufflefs.storage.resync")

RESYNC_PAGE = 512  # chunks per list_chunks page while resyncing
RESYNC_PARALLEL = 16  # chunk copies in flight while resyncing
RESYNC_RETRIES = 8  # copies of one chunk that keep racing with the chain before a resync pass fails
RESYNC_POLL = 0.25  # seconds between looks at the routing map for targets to resync
BUG_PAUSE = 1.0  # seconds before a resync that failed with a bug is started again


class _ChainChanged(Exception):
    """The chain changed under a resync pass: start it over."""


class ResyncWorker:
    """The resyncs of this node's syncing targets, and their sync states."""

    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self.states: dict[int, SyncState] = {}  # target -> its sync state
        self.running: set[int] = set()  # targets with a resync task
        self.finished: list[ResyncStats] = []  # finished resync passes, newest last

    # ---- sync states -----------------------------------------------------

    def state(self, target: int, chain: int, chain_version: int) -> SyncState:
        """*target*'s sync state at this chain version (a new version starts
        afresh: the target may have missed updates in between)."""
        state = self.states.get(target)
        if state is None or (state.chain, state.chain_version) != (chain, chain_version):
            state = SyncState(chain, chain_version)
            self.states[target] = state
        return state

    def state_at(self, target: int, place: Place | None) -> SyncState | None:
        """The sync state an update at *place* must note, if the target is syncing."""
        if place is None or not place.syncing:
            return None
        return self.state(target, place.chain, place.version)

    def touch(self, target: int, cid: bytes) -> None:
        """Note that something other than resync changed *cid* here (a repair)."""
        sync = self.states.get(target)
        if sync is not None:
            sync.touch(cid)

    # ---- the loop --------------------------------------------------------

    async def run(self) -> None:
        """Look at the routing map every `RESYNC_POLL` seconds, until cancelled."""
        async with trio.open_nursery() as nursery:
            while True:
                self.run_once(nursery)
                await trio.sleep(RESYNC_POLL)

    def run_once(self, nursery: trio.Nursery) -> None:
        """Start a resync (in *nursery*) for every one of our targets the
        routing map shows syncing; forget sync state of targets that serve
        again."""
        routing = self.node.routing_now()
        if routing is None:
            return
        for store in list(self.node.stores):
            tid = store.target_id
            info = routing.targets.get(tid) if tid is not None else None
            if tid is None or info is None:
                continue
            if info["state"] == "syncing":
                if tid not in self.running:
                    self.running.add(tid)
                    nursery.start_soon(self._resync_task, tid)
            elif tid not in self.running:
                self.states.pop(tid, None)

    async def _resync_task(self, target: int) -> None:
        """One target's resync; a bug in it is logged and the loop starts it
        again, rather than taking the whole daemon down."""
        try:
            await self.resync(target)
        except Exception:
            log.exception("resync target=%d failed unexpectedly", target)
            await trio.sleep(BUG_PAUSE)
        finally:
            self.running.discard(target)

    async def resync(self, target: int) -> None:
        """Bring *target* up to date while the routing map shows it syncing,
        until mgmtd accepts `sync_done`; a pass that meets a chain change
        (ESTALE) starts over, one that fails otherwise is retried with backoff."""
        routing_source = self.node.routing
        assert routing_source is not None
        backoff = Backoff(first=0.2, cap=5.0)
        while True:
            routing = self.node.routing_now()
            if routing is None:
                return
            chain = chain_of(routing, target)
            me = routing.targets.get(target)
            if chain is None or me is None or me["state"] != "syncing":
                self.states.pop(target, None)
                return
            try:
                await self._resync_pass(target, routing, chain)
                backoff.reset()
            except _ChainChanged:
                log.info("resync target=%d: the chain changed, starting over", target)
            except FsError as exc:
                if exc.code == errno.ESTALE:
                    log.info("resync target=%d: %s; starting over", target, exc.message)
                else:
                    delay = backoff.next()
                    log.warning(
                        "resync target=%d failed: %s; retry in %.1fs", target, exc.message, delay
                    )
                    await trio.sleep(delay)
            with contextlib.suppress(FsError):
                await routing_source.refresh()

    # ---- one pass ----------------------------------------------------------

    def _still_current(self, target: int, sync: SyncState) -> None:
        if self.states.get(target) is not sync:
            raise _ChainChanged()

    async def _resync_pass(self, target: int, routing: Routing, chain: ChainInfo) -> None:
        node = self.node
        if node.rpc is None or node.mgmtd is None:
            raise FsError(errno.EHOSTDOWN, "no rpc client or mgmtd to resync with")
        store = node.store(target)
        start_version = chain["version"]
        sources = [t for t in routing.serving_targets(chain["id"]) if t["id"] != target]
        if not sources:
            raise FsError(errno.EAGAIN, f"chain {chain['id']} has no serving replica to sync from")
        source = sources[-1]  # the nearest serving one upstream: spares the head
        stub = node.stub_for(source["id"], routing)
        sync = self.state(target, chain["id"], start_version)
        # The source's map may still be at the version before we joined, and
        # updates it takes at that version are never forwarded to us: once it
        # is at ours and those are done, every later one reaches us.
        try:
            await stub.sync_barrier(source["id"], chain["id"], start_version)
        except FsError as exc:
            if exc.code != errno.ENOSYS:
                raise
            log.warning(  # an older daemon (a rolling upgrade): sync as it did
                "resync target=%d: source %d has no sync_barrier; comparing without it",
                target,
                source["id"],
            )
        stats = ResyncStats(target, chain["id"], source["id"])
        started = trio.current_time()
        log.info(
            "resync start target=%d chain=%d chain_version=%d source=%d",
            target,
            chain["id"],
            start_version,
            source["id"],
        )
        copy = partial(self.copy_chunk, target, store, sync, stub, source["id"], stats=stats)
        after: bytes | None = None
        while True:
            self._still_current(target, sync)
            seq0 = sync.seq
            page = await stub.list_chunks(source["id"], after, RESYNC_PAGE)
            theirs = page["chunks"]
            more = page["more"] and bool(theirs)
            # ours in the same id range (on the last page: up to its last chunk;
            # ours past it are paged through below)
            bound = theirs[-1]["chunk"] if theirs else after
            ours = await node.io(store.list_range, after, bound) if theirs else {}
            copies: list[bytes] = []
            for info in theirs:
                cid = info["chunk"]
                mine = ours.pop(cid, None)
                stats.chunks_checked += 1
                if cid in sync.trusted:
                    continue
                if mine is not None and not sync.touched_since(cid, seq0) and same_info(mine, info):
                    sync.trusted.add(cid)
                    continue
                copies.append(cid)
            # ours only: removed on the chain while we were away?
            copies.extend(cid for cid in ours if cid not in sync.trusted)
            await self._copy_each(copies, copy)
            after = bound
            if not more:
                break
        while True:  # ours past the source's last chunk
            self._still_current(target, sync)
            tail = await node.io(store.list_chunks, after, RESYNC_PAGE)
            await self._copy_each(
                [i["chunk"] for i in tail["chunks"] if i["chunk"] not in sync.trusted], copy
            )
            if not tail["more"] or not tail["chunks"]:
                break
            after = tail["chunks"][-1]["chunk"]
        self._still_current(target, sync)
        await node.mgmtd.sync_done(target, chain["id"], start_version)
        stats.forwarded = sync.forwarded
        stats.seconds = trio.current_time() - started
        self.finished.append(stats)
        log.info(
            "resync done target=%d chain=%d source=%d chunks_checked=%d chunks_copied=%d "
            "bytes_copied=%d chunks_deleted=%d forwarded_while_syncing=%d seconds=%.3f "
            "throughput_mb_s=%.1f",
            target,
            chain["id"],
            source["id"],
            stats.chunks_checked,
            stats.chunks_copied,
            stats.bytes_copied,
            stats.chunks_deleted,
            stats.forwarded,
            stats.seconds,
            stats.bytes_copied / max(stats.seconds, 1e-6) / 1e6,
        )

    @staticmethod
    async def _copy_each(cids: list[bytes], copy: Callable[[bytes], Awaitable[None]]) -> None:
        """*copy* every chunk of *cids*, `RESYNC_PARALLEL` at a time: one
        copy after the other, a restarted target took 2.8 s for 1,000 chunks
        of 100 KB (a read from the source, then an install with its own
        flushes, each waiting for the last); together the installs share a
        thread call and their flushes (storage/update_queue.py). The first
        failure stops the others and is raised as it is."""
        if not cids:
            return
        room = trio.Semaphore(RESYNC_PARALLEL)
        failed: list[FsError | _ChainChanged] = []
        async with trio.open_nursery() as nursery:

            async def one(cid: bytes) -> None:
                try:
                    await copy(cid)
                except (FsError, _ChainChanged) as exc:
                    failed.append(exc)
                    nursery.cancel_scope.cancel()
                finally:
                    room.release()

            for cid in cids:  # started in id order, as room frees
                await room.acquire()
                nursery.start_soon(one, cid)
        if failed:
            raise failed[0]

    async def copy_chunk(
        self,
        target: int,
        store: ChunkStore,
        sync: SyncState,
        stub: StorageStub,
        source: int,
        cid: bytes,
        stats: ResyncStats,
    ) -> None:
        """Make our copy of *cid* the source's: read it there (under the
        source's chunk lock, so it includes every update that reached us),
        install it here unless the chain changed the chunk here since (then
        read again) or made it trusted (then ours is right)."""
        node = self.node
        for _ in range(RESYNC_RETRIES):
            self._still_current(target, sync)
            seq0 = sync.seq
            meta, data = await read_copy(stub, source, cid)
            async with node.locks.update(target, cid):
                self._still_current(target, sync)
                if cid in sync.trusted:
                    return
                if sync.touched_since(cid, seq0):
                    continue
                if meta is None:
                    if await node.io(store.remove_chunk, cid):
                        stats.chunks_deleted += 1
                else:
                    await node.install(store, cid, data, meta["chunk_size"], meta["version"])
                    sync.touch(cid)
                    stats.chunks_copied += 1
                    stats.bytes_copied += len(data)
                    RESYNC_CHUNKS.inc()
                    RESYNC_BYTES.inc(len(data))
                sync.trusted.add(cid)
                return
        raise FsError(errno.EAGAIN, f"chunk {cid.hex()} kept changing during resync")
