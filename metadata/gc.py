"""What the namespace owes the storage daemons, paid in the background.

Freeing a file and shrinking one are committed in the namespace first, with a
job recorded in the same transaction (see `jobs`); the calls to the storage
daemons come after. Each is one call per chain of the file's layout, to the
chain's head, which carries it out on every replica in chain order (so it is
ordered with the writes on every replica). A job is deleted only once every
chain has confirmed, so a crash, a restart, an unreachable daemon or a chain
without a serving target only delays the work: it is retried with backoff
until it is done. Replicas that were offline meanwhile are made consistent by
resync when they return. Both storage calls are idempotent, so doing one
twice is harmless.

The session reaper lives here too: an expired session's handles are closed,
which may free unlinked files and so create GC jobs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import trio

from shufflefs.cluster.routing import ChainWatch, Routing, RoutingCache
from shufflefs.metadata.protocol import Layout
from shufflefs.metadata.records import ExpiredSession, GcJob, TruncateJob
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.writer import Writer
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import CONNECTION_FAILURES, FsError
from shufflefs.rpc.retry import Backoff, retrying
from shufflefs.storage.protocol import FORWARD_TIMEOUT, StorageStub, chain_call_timeout

log = logging.getLogger("shufflefs.metadata.gc")

# (stub of the head's node, head target, chain, chain version) -> chunks changed
ChainCall = Callable[[StorageStub, int, int, int], Awaitable[int]]
PAGE = 256
# seconds one job attempt keeps retrying a chain that is changing (a replica
# died and is being taken out): a truncate in the reply path rides through it
CHAIN_RETRY_BUDGET = 30.0
# a chain with no serving target: not retried within an attempt (the job
# waits, with backoff, until a replica serves again); the reply path says EIO
NO_SERVING_TARGET = errno.EIO
J = TypeVar("J", GcJob, TruncateJob)
GC_BATCH = 256  # freed files per `remove_files` (at most MAX_FILES_REMOVED)


def _span(inos: list[int]) -> str:
    """The inodes of a batch, for its log line (a debugging job's grep)."""
    return ",".join(map(str, inos)) if len(inos) <= 8 else f"{min(inos)}..{max(inos)}"


def _all_jobs(fetch: Callable[..., list[J]]) -> Iterator[J]:
    """Every job, a page (one short read transaction) at a time."""
    after = 0
    while True:
        page = fetch(after=after, limit=PAGE)
        yield from page
        if len(page) < PAGE:
            return
        after = page[-1]["ino"]


class StorageJobs:
    """Carries out GC jobs (remove a freed file's chunks) and truncate jobs
    (cut a shrunk file's chunks)."""

    def __init__(
        self,
        store: NamespaceStore,
        writer: Writer,
        routing: Callable[[], Routing],
        rpc: RpcClient,
        *,
        refresh_routing: Callable[[], Awaitable[object]] | None = None,
        forward_timeout: float = FORWARD_TIMEOUT,
        retry_budget: float = CHAIN_RETRY_BUDGET,
        base_delay: float = 0.5,
        max_delay: float = 30.0,
        idle_interval: float = 30.0,
        concurrency: int = 16,
    ) -> None:
        self.store = store
        self.writer = writer
        self.routing = routing
        self.refresh_routing = refresh_routing
        self.rpc = rpc
        self.forward_timeout = forward_timeout  # the storage daemons': see chain_call_timeout
        self.retry_budget = retry_budget
        self.chain_watch = ChainWatch()
        self.report_unreachable: Callable[[int], Awaitable[bool]] | None = None
        self._dead_heads: set[int] = set()  # nodes of heads that did not answer
        self._cut_locks: dict[int, list[Any]] = {}  # ino -> [lock, tasks using it]
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.idle_interval = idle_interval
        self.concurrency = concurrency
        # (kind, ino) of a job that failed -> (trio time its next attempt is due, its backoff)
        self._backoff: dict[tuple[str, int], tuple[float, Backoff]] = {}
        self._wake = trio.Event()
        self.passes = 0

    def wake(self) -> None:
        """New jobs were committed: look now rather than at the next timer."""
        self._wake.set()

    async def run(self) -> None:
        """Work through pending jobs forever (pending ones from before a
        restart included: the first pass runs at once)."""
        while True:
            self._wake = trio.Event()  # before the pass: a wake during it is not lost
            try:
                wait = await self.run_once()
            except Exception:
                log.exception("storage job pass failed")
                wait = self.max_delay
            with trio.move_on_after(wait):
                await self._wake.wait()

    async def run_once(self) -> float:
        """One pass over every job that is due. Returns the seconds until the
        next retry is due (or the idle interval)."""
        now = trio.current_time()
        seen: set[tuple[str, int]] = set()
        slots = trio.Semaphore(self.concurrency)

        async def start(kind: str, ino: int, runner: Callable[[], Awaitable[None]]) -> None:
            key = (kind, ino)
            seen.add(key)
            due = self._backoff.get(key)
            if due is not None and due[0] > now:
                return
            await slots.acquire()
            nursery.start_soon(self._guarded, runner, slots)

        async with trio.open_nursery() as nursery:
            batch: list[GcJob] = []
            for job in _all_jobs(self.store.gc_jobs):
                key = ("gc", job["ino"])
                seen.add(key)
                due = self._backoff.get(key)
                if due is None or due[0] <= now:
                    batch.append(job)
                if len(batch) == GC_BATCH:
                    await start("gc-batch", 0, functools.partial(self._gc_batch, batch))
                    batch = []
            if batch:
                await start("gc-batch", 0, functools.partial(self._gc_batch, batch))
            for tjob in _all_jobs(self.store.truncate_jobs):
                await start("truncate", tjob["ino"], functools.partial(self._truncate, tjob))
        for key in set(self._backoff) - seen:  # the job is gone (done, or its file freed)
            del self._backoff[key]
        self.passes += 1
        if not self._backoff:
            return self.idle_interval
        return max(0.0, min(due for due, _ in self._backoff.values()) - trio.current_time())

    @staticmethod
    async def _guarded(runner: Callable[[], Awaitable[None]], slots: trio.Semaphore) -> None:
        try:
            await runner()
        finally:
            slots.release()

    # ---- GC: a freed file's chunks ----------------------------------------------

    async def _gc_batch(self, jobs: list[GcJob]) -> None:
        """Free a batch of files' chunks: one `remove_files` per chain (the
        files of the batch on it), all chains at once, and one commit of the
        jobs done. Per file, a `remove_file` on each chain of its layout cost
        every replica an RPC and a worker-thread call per chain (most of the
        storage daemons' CPU while `rm -r` ran). A storage daemon of before
        the batch call (ENOSYS) gets the files one by one."""
        on_chain: dict[int, list[int]] = {}
        for job in jobs:
            for chain in dict.fromkeys(job["layout"]["chains"]):
                on_chain.setdefault(chain, []).append(job["ino"])
        results, errors = await self._each_chain(
            list(on_chain),
            lambda stub, head, chain, version: stub.remove_files(
                head, chain, version, on_chain[chain]
            ),
        )
        # a file is done once every chain of its layout is; one on a chain
        # that failed waits (backoff), the others of the batch do not
        failed = {ino: exc for chain, exc in errors.items() for ino in on_chain[chain]}
        done = [job["ino"] for job in jobs if job["ino"] not in failed]
        if done:
            await self.writer(self.store.gc_done_all, done)
            for ino in done:
                self._backoff.pop(("gc", ino), None)
            log.info(
                "gc files=%d inos=%s removed chunks=%d chains=%d",
                len(done),
                _span(done),
                sum(results.values()),
                len(results),
            )
        if any(exc.code == errno.ENOSYS for exc in errors.values()):
            for job in jobs:  # a storage daemon of before `remove_files`
                if job["ino"] in failed:
                    await self._gc(job)
            return
        for ino, exc in failed.items():
            self._failed(("gc", ino), f"gc ino={ino} (of a batch of {len(jobs)})", exc)

    async def _gc(self, job: GcJob) -> None:
        ino = job["ino"]
        try:
            removed, chains = await self._on_chains(
                job["layout"],
                lambda stub, head, chain, version: stub.remove_file(head, chain, version, ino),
            )
        except FsError as exc:
            self._failed(("gc", ino), f"gc ino={ino}", exc)
            return
        await self.writer(self.store.gc_done, ino)
        self._backoff.pop(("gc", ino), None)
        log.info("gc ino=%d removed chunks=%d chains=%d", ino, removed, chains)

    # ---- truncation: a shrunk file's chunks ----------------------------------------

    @contextlib.asynccontextmanager
    async def _cutting(self, ino: int) -> AsyncIterator[None]:
        """One cut of *ino* at a time. A cut carried out late (one that kept
        retrying while a replica died) must never land after the file's next
        writes: so every cut re-reads its job under this lock and runs only if
        the job is still pending, and a reply waits for any cut in flight."""
        entry = self._cut_locks.setdefault(ino, [trio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._cut_locks[ino]

    async def truncate_now(self, ino: int) -> None:
        """Carry out *ino*'s pending truncation before a reply goes out; EIO if
        a storage daemon cannot be reached (the job stays and is retried)."""
        async with self._cutting(ino):
            while True:
                try:
                    done = await self._cut_pending(ino)
                except FsError as exc:
                    self.wake()
                    raise FsError(
                        errno.EIO,
                        f"inode {ino} has a new size but cutting its chunks on storage "
                        f"failed ({exc.message}); it is retried in the background",
                    ) from None
                if done is not False:
                    return
                # a newer shrink was recorded meanwhile: carry that one out too

    async def _truncate(self, listed: TruncateJob) -> None:
        async with self._cutting(listed["ino"]):
            try:
                done = await self._cut_pending(listed["ino"])  # the listing may be old
            except FsError:
                return
            if done is False:
                self.wake()  # superseded by a newer job: the next pass runs it

    async def _cut_pending(self, ino: int) -> bool | None:
        """Under `_cutting`: carry out the job pending now. None if there is
        none; else whether it was still the newest (and so is done)."""
        job = self.store.truncate_job(ino)
        if job is None:
            return None
        try:
            await self._cut(job)
        except FsError as exc:
            self._failed(("truncate", ino), f"truncate ino={ino} size={job['size']}", exc)
            raise
        self._backoff.pop(("truncate", ino), None)
        return bool(await self.writer(self.store.truncate_done, ino, job["seq"]))

    async def _cut(self, job: TruncateJob) -> None:
        ino, size, layout = job["ino"], job["size"], job["layout"]
        changed, chains = await self._on_chains(
            layout,
            lambda stub, head, chain, version: stub.truncate_file(
                head, chain, version, ino, size, layout["chunk_size"]
            ),
        )
        log.info("truncate ino=%d size=%d chunks=%d chains=%d", ino, size, changed, chains)

    # ---- shared -----------------------------------------------------------------------

    async def _on_chains(self, layout: Layout, call: ChainCall) -> tuple[int, int]:
        """Run *call* once per chain of *layout* (`_each_chain`). Returns
        (sum of the results, number of chains); raises if any chain failed."""
        chains = list(dict.fromkeys(layout["chains"]))
        results, errors = await self._each_chain(chains, call)
        if errors:
            chain, exc = min(errors.items())
            raise FsError(
                exc.code,
                f"{len(errors)} of {len(chains)} chains failed, chain {chain}: {exc.message}",
            )
        return sum(results.values()), len(chains)

    async def _each_chain(
        self, chains: list[int], call: ChainCall
    ) -> tuple[dict[int, int], dict[int, FsError]]:
        """Run *call* once per chain of *chains*, at the chain's head, all
        chains in parallel: each chain's result, and each failed chain's
        error. A chain without a serving target fails at once (the job
        waits until one serves). A chain that is changing (a replica died:
        the head answers ESTALE, or the head itself is gone) is retried on
        the new chain, like a client's write: the dead head is reported to
        mgmtd, which takes it out, and the routing map refreshed."""
        results: dict[int, int] = {}
        errors: dict[int, FsError] = {}

        async def one(chain: int) -> None:
            try:
                results[chain] = await retrying(
                    f"storage call on chain {chain}",
                    functools.partial(self._at_head, chain, call),
                    budget=self.retry_budget,
                    on_failure=self._reroute,
                )
            except FsError as exc:
                errors[chain] = exc

        async with trio.open_nursery() as nursery:
            for chain in chains:
                nursery.start_soon(one, chain)
        return results, errors

    async def _at_head(self, chain: int, call: ChainCall) -> int:
        routing = self.routing()
        info = routing.chain(chain)
        serving = routing.serving_targets(chain)
        if not serving:
            raise FsError(NO_SERVING_TARGET, f"chain {chain} has no serving target")
        head = serving[0]
        node = routing.node_of_target(head["id"])
        if node["state"] != "online":
            raise FsError(errno.ESTALE, f"the head of chain {chain} is offline")
        # wait as long as the head may wait for the rest of its chain, and no
        # longer than the chain stays as it is
        timeout = chain_call_timeout(len(routing.write_targets(chain)), self.forward_timeout)
        stub = StorageStub(self.rpc, node["address"], timeout=timeout)
        try:
            with self.chain_watch.watching(chain, info["version"]) as watch:
                result = await call(stub, head["id"], chain, info["version"])
        except FsError as exc:
            if exc.code in CONNECTION_FAILURES:
                self._dead_heads.add(node["id"])
            raise
        if watch.cancelled_caught:
            raise FsError(errno.ESTALE, f"chain {chain} changed during a storage call: retry")
        return result

    async def _reroute(self, exc: FsError) -> None:
        """Between tries of a chain call: tell mgmtd about heads that did not
        answer (it checks for itself and takes them out at once, rather than
        after the heartbeat timeout), then fetch the new routing map."""
        dead, self._dead_heads = self._dead_heads, set()
        if self.report_unreachable is not None:
            for node in dead:
                try:
                    if await self.report_unreachable(node):
                        log.warning("storage node %d reported unreachable; mgmtd took it out", node)
                except FsError as report_exc:
                    log.info("reporting node %d unreachable failed: %s", node, report_exc.message)
        if self.refresh_routing is not None:
            await self.refresh_routing()

    def attach(self, cache: RoutingCache) -> None:
        """Follow *cache*: calls to a chain that changes stop waiting, and dead
        heads are reported to its mgmtd."""
        cache.listeners.append(self.chain_watch.routing_changed)
        self.report_unreachable = functools.partial(cache.mgmtd.report_unreachable, 0)

    def _failed(self, key: tuple[str, int], what: str, exc: FsError) -> None:
        """Retry the job later: base_delay after its first failure, doubling
        up to max_delay."""
        _, backoff = self._backoff.get(key, (0.0, Backoff(self.base_delay, self.max_delay)))
        delay = backoff.next()
        self._backoff[key] = (trio.current_time() + delay, backoff)
        log.info("%s failed: %s; retry in %.1fs", what, exc.message, delay)


class SessionReaper:
    """Closes sessions whose lease ran out: a client that died without
    closing its files must not keep unlinked files alive forever."""

    def __init__(
        self, store: NamespaceStore, writer: Writer, jobs: StorageJobs, interval: float
    ) -> None:
        self.store = store
        self.writer = writer
        self.jobs = jobs
        self.interval = interval
        # a session's renewal and the reaping loop may both find the sweep due
        self._sweeping = trio.Lock()

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            try:
                await self.reap_once()
            except FsError as exc:
                log.warning("session reaping failed: %s", exc.message)

    async def reap_once(self) -> list[ExpiredSession]:
        expired = await self.writer(self.store.reap_sessions)
        for s in expired:
            log.info(
                "session expired session=%d client=%s host=%s pid=%d handles=%d freed=%d",
                s["session"],
                s["client"],
                s["host"],
                s["pid"],
                s["handles"],
                s["freed"],
            )
        if any(s["freed"] for s in expired):
            self.jobs.wake()
        await self.sweep_if_due()
        return expired

    async def sweep_if_due(self) -> None:
        """Once a restart's grace is over (every session then live has
        renewed or expired), free the unnamed inodes nothing holds."""
        if not self.store.read_only.sweep_due:
            return
        async with self._sweeping:  # once: the second caller finds it done
            if not self.store.read_only.sweep_due:
                return
            freed = await self.writer(self.store.sweep_orphans)
        log.info("restart grace over: every session re-reported or expired; freed=%d", freed)
        if freed:
            self.jobs.wake()
