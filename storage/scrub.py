"""`ScrubWorker`: verify every block of a target and compare it with the
chain's head, repairing what is damaged or divergent (docs/storage.md
"Repair and scrub"). Runs a page at a time for the `scrub` rpc (``shufflefs
scrub``), and over every target each ``scrub_interval`` seconds if set.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field

import trio

from shufflefs.cluster.metrics_catalog import SCRUB_CHUNKS, SCRUB_FOUND
from shufflefs.cluster.protocol import TargetInfo
from shufflefs.rpc import FsError
from shufflefs.storage.chain import chain_of, same_info
from shufflefs.storage.context import NodeContext, read_copy
from shufflefs.storage.layout import same_record
from shufflefs.storage.protocol import ChunkInfo, ScrubResult
from shufflefs.storage.repair import RepairWorker
from shufflefs.storage.resync import ResyncWorker

log = logging.getLogger("shufflefs.storage.scrub")

SCRUB_MAX = 1024  # chunks per scrub call
SCRUB_PAGE = 64  # chunks per page of the periodic scrub
HEAD_PAGE = 512  # chunks per list_chunks page when reading the head's listing
RECONCILE_TRIES = 3  # looks at a chunk that keeps changing while we compare it


@dataclass
class _ScrubCounts:
    checked: int = 0
    corrupt: int = 0
    divergent: int = 0
    repaired: int = 0
    unrecoverable: int = 0
    handled: set[bytes] = field(default_factory=set)  # chunks already repaired this page

    def add(self, page: ScrubResult) -> None:
        self.checked += page["checked"]
        self.corrupt += page["corrupt"]
        self.divergent += page["divergent"]
        self.repaired += page["repaired"]
        self.unrecoverable += page["unrecoverable"]

    def summary(self) -> str:
        return (
            f"checked={self.checked} corrupt={self.corrupt} divergent={self.divergent} "
            f"repaired={self.repaired} unrecoverable={self.unrecoverable}"
        )


class ScrubWorker:
    """Scrub pages on request, and the periodic scrub of every target."""

    def __init__(
        self, node: NodeContext, repair: RepairWorker, resync: ResyncWorker, interval: float = 0.0
    ) -> None:
        self.node = node
        self.repair = repair
        self.resync = resync
        self.interval = interval  # seconds between periodic scrubs; 0: none

    async def run(self) -> None:
        """Scrub every target each `interval` seconds, until cancelled."""
        while True:
            await trio.sleep(self.interval)
            await self.run_once()

    async def run_once(self) -> None:
        """Scrub every registered target once, whole, and log the totals; a
        failure of one target is logged and the others go on."""
        for store in list(self.node.stores):
            if store.target_id is None:
                continue
            totals = _ScrubCounts()
            after: bytes | None = None
            try:
                while True:
                    result = await self.scrub_page(store.target_id, after, SCRUB_PAGE)
                    totals.add(result)
                    after = result["next"]
                    if after is None:
                        break
            except FsError as exc:
                log.warning("periodic scrub target=%d failed: %s", store.target_id, exc.message)
                continue
            except Exception:  # a bug: logged, the daemon keeps serving
                log.exception("periodic scrub target=%d failed unexpectedly", store.target_id)
                continue
            log.info(
                "periodic scrub target=%d %s",
                store.target_id,
                totals.summary(),
            )

    async def scrub_page(self, target: int, after: bytes | None, limit: int) -> ScrubResult:
        """Verify every block of up to *limit* chunks after *after* (chunk-id
        order), repair damaged ones from a healthy replica, and compare the
        page with the chain's head (versions and checksums), repairing our
        copy where it diverges. ``next`` is the cursor of the following page."""
        node = self.node
        store = node.store(target)
        if not 1 <= limit <= SCRUB_MAX:
            raise FsError(errno.EINVAL, f"limit {limit} must be in [1, {SCRUB_MAX}]")
        page = await node.io(store.list_chunks, after, limit)
        chunks = page["chunks"]
        counts = _ScrubCounts()
        for info in chunks:
            cid = info["chunk"]
            problem = await node.io(store.verify, cid)
            counts.checked += 1
            if problem is None:
                continue
            counts.corrupt += 1
            counts.handled.add(cid)
            log.error("scrub target=%d chunk=%s: %s", target, cid.hex(), problem)
            if await self.repair.repair(target, cid):
                counts.repaired += 1
            else:
                counts.unrecoverable += 1
        bound = chunks[-1]["chunk"] if page["more"] and chunks else None
        head = self._head(target)
        if head is not None:
            await self._compare(target, head, after, bound, counts)
        SCRUB_CHUNKS.inc(counts.checked)
        for kind in ("corrupt", "divergent", "repaired", "unrecoverable"):
            SCRUB_FOUND.labels(kind).inc(getattr(counts, kind))
        if counts.corrupt or counts.divergent:
            log.warning(
                "scrub target=%d checked=%d corrupt=%d divergent=%d repaired=%d unrecoverable=%d",
                target,
                counts.checked,
                counts.corrupt,
                counts.divergent,
                counts.repaired,
                counts.unrecoverable,
            )
        return {
            "checked": counts.checked,
            "corrupt": counts.corrupt,
            "divergent": counts.divergent,
            "repaired": counts.repaired,
            "unrecoverable": counts.unrecoverable,
            "next": bound,
        }

    def _head(self, target: int) -> TargetInfo | None:
        """The head to compare with: only a serving replica other than the
        head compares (a syncing one is being made equal by resync)."""
        routing = self.node.routing_now()
        chain = chain_of(routing, target) if routing is not None else None
        if routing is None or chain is None:
            return None
        serving = routing.serving_targets(chain["id"])
        if not serving or serving[0]["id"] == target:
            return None
        if target not in [t["id"] for t in serving]:
            return None
        return serving[0]

    async def _compare(
        self,
        target: int,
        head: TargetInfo,
        after: bytes | None,
        bound: bytes | None,
        counts: _ScrubCounts,
    ) -> None:
        node = self.node
        routing = node.routing_now()
        if routing is None or node.rpc is None:
            return
        store = node.store(target)
        stub = node.stub_for(head["id"], routing)
        theirs: dict[bytes, ChunkInfo] = {}
        cursor = after
        while True:
            page = await stub.list_chunks(head["id"], cursor, HEAD_PAGE)
            done = not page["more"] or not page["chunks"]
            for info in page["chunks"]:
                if bound is not None and info["chunk"] > bound:
                    done = True
                    break
                theirs[info["chunk"]] = info
            if done:
                break
            cursor = page["chunks"][-1]["chunk"]
        ours = await node.io(store.list_range, after, bound)
        for cid in sorted(set(theirs) | set(ours)):
            if cid in counts.handled:
                continue
            mine, head_info = ours.get(cid), theirs.get(cid)
            if mine is not None and head_info is not None and same_info(mine, head_info):
                continue
            try:
                changed = await self._reconcile(target, head, cid)
            except FsError as exc:
                log.warning(
                    "scrub target=%d chunk=%s: comparing with the head failed: %s",
                    target,
                    cid.hex(),
                    exc.message,
                )
                continue
            if changed:
                counts.divergent += 1
                counts.repaired += 1

    async def _reconcile(self, target: int, source: TargetInfo, cid: bytes) -> bool | None:
        """Make our copy of *cid* equal to *source*'s (the chain's head): the
        source's copy is read under its chunk lock, ours replaced under ours
        if it did not change meanwhile. True if ours changed, False if they
        were equal after all, None if the chunk kept changing."""
        node = self.node
        store = node.store(target)
        for _ in range(RECONCILE_TRIES):
            rec0 = await node.io(store.committed, cid)
            meta, data = await read_copy(node.stub_for(source["id"]), source["id"], cid)
            async with node.locks.update(target, cid):
                rec = await node.io(store.committed, cid)
                if not same_record(rec, rec0):
                    continue
                if meta is None:
                    if rec is None:
                        return False
                    await node.io(store.remove_chunk, cid)
                    log.warning(
                        "removed divergent chunk target=%d chunk=%s (the head target=%d has none)",
                        target,
                        cid.hex(),
                        source["id"],
                    )
                    return True
                if rec is not None and rec.version == meta["version"]:
                    try:
                        _, ours = await node.io(store.read_full, cid)
                        if ours == data:
                            return False
                    except FsError as exc:
                        if exc.code != errno.EIO:
                            raise
                await node.install(store, cid, data, meta["chunk_size"], meta["version"])
                self.resync.touch(target, cid)
            log.warning(
                "repaired divergent chunk target=%d chunk=%s from the head target=%d "
                "version=%d (ours: %s)",
                target,
                cid.hex(),
                source["id"],
                meta["version"],
                "none" if rec0 is None else rec0.version,
            )
            return True
        return None
