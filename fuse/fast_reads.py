"""READs answered off the event loop: the remote read path of the mount.

A READ that pyfuse3 handles runs as a coroutine on its trio loop, and a
read through a storage daemon then costs the loop's waits and wake-ups on
top of the network round trip (docs/storage.md, "Thread channels and the
mount's fast READs"). Here the READ is taken in the libfuse callback itself
(`ReadInodes.fast`, fuse/read_inode.py), before pyfuse3 sees it:
`FastReads.read` plans it into the current batch (client/channel_reads.py)
and, before it returns, takes the READs already waiting in the kernel's
queue behind it the same way (`_drain`: receiving and dispatching them as
pyfuse3's loop would, without a trip through that loop each), then sends
the batch: replicas chosen for all its pieces at once, one frame and one
``sendmsg`` per storage node. The reply thread of each storage node's
connection receives the bytes straight into the READs' buffers and answers
the kernel (``fuse_reply_buf``, libfuse's own call, which any thread may
make) once a READ's last frame is in. No task, no trio wait, no thread hop;
under load, one system call and one wake-up on each side carry many READs
(the storage daemon's thread channel holds its replies back the same way
while more requests are buffered, rpc/channel.py).

It takes a READ only when it can be answered exactly as `ShuffleOps.read`
would: a known handle of a regular file open for reading, with none of this
mount's writes in flight for it; and either a connection to a replica of
every chain the read needs, or a replica of every one on this host. Those
last READs are the short circuit's (`_read_local`): the chunk files' bytes
in the page cache are answered right in the callback, and a READ that must
wait for the disk waits right there when nothing else waits on the mount
(`_wait_here`), else is read through the loop's io_uring and answered by
its reaper, a task of this loop (`_read_ring`: no thread, no GIL handed
back and forth), or, where there is no io_uring, by a thread of
`LOCAL_THREADS` (on the loop each was a task, a trip through trio's thread
pool and back, and a wake-up of the loop: most of a cold read's CPU,
measured). A READ
whose chains are partly local is left to the loop. Bytes the prefetcher
holds (fuse/prefetch.py) are answered at once. Everything else, and any
READ whose fast attempt
fails (a replica that is not serving, a checksum error, a reply that does
not come in time, a broken connection), goes through
`ShuffleOps.read_handle` on the loop, which fails over, retries and
reports, and answers the kernel itself; the replicas that failed are
marked so that it avoids them.

`close` is called before the FUSE session is: after it nothing here
touches a request again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio
from prometheus_client.metrics_core import Metric

from shufflefs.client.channel_reads import NOT_CONNECTED, ChannelRead, ReadChannels
from shufflefs.client.fs import FileSystem
from shufflefs.client.layout import Piece, plan
from shufflefs.cluster.metrics_client import counts_family
from shufflefs.cluster.routing import Routing
from shufflefs.fuse.libfuse import KernelQueue
from shufflefs.fuse.read_inode import FH_OFFSET, READ_INODES
from shufflefs.rpc.errors import FsError
from shufflefs.storage.uring import OFFLOAD_AT, FileOutcome, for_this_run

if TYPE_CHECKING:
    from shufflefs.fuse.ops import ShuffleOps

log = logging.getLogger("shufflefs.fuse.fast_reads")

MAX_LOCAL_FILES = 65536  # inodes remembered as all or partly on this host
LOCAL_THREADS = 16  # short-circuit READs waiting for the disk at once (as the loop's)
INLINE_WAIT_MAX = 0.002  # s: a disk wait on the loop's thread longer than this...
INLINE_PAUSE = 1.0  # s: ...stops such waits for this long (a slow or busy disk)


def _address(data: Any) -> tuple[Any, int]:
    """A pointer to *data*'s bytes for C (and what keeps them alive)."""
    view = memoryview(data)
    if view.readonly:
        data = bytearray(view)
        view = memoryview(data)
    if not view.nbytes:
        return None, 0
    buf = (ctypes.c_char * view.nbytes).from_buffer(view)
    return buf, view.nbytes


@dataclass
class FastReadCounts:
    """READs by what the fast path did with them (counted on the loop's
    thread only, exported when scraped: nothing on the READ's way)."""

    taken: int = 0  # taken off the loop (answered there, or after a failure on the loop)
    local: int = 0  # of those, read from this host's chunk files (the short circuit)
    fell_back: int = 0  # of those, answered on the loop after a failure
    inline: int = 0  # short-circuit READs that waited for the disk on the loop's thread
    ring: int = 0  # short-circuit READs that waited for the disk through io_uring
    offloaded: int = 0  # of those, the ones whose bytes the kernel's workers copied
    declined: int = 0  # left to pyfuse3 (partly local, no connection yet, unknown handle...)

    def collect(self) -> Iterable[Metric]:
        yield counts_family(
            "shufflefs_client_fast_reads",
            "READs of a mount by what its fast path (fuse/fast_reads.py) did with them",
            "outcome",
            self,
        )


@dataclass(slots=True)
class ColdRead:
    """A short-circuit READ waiting for the disk: what answers it needs."""

    req: int
    fh: int
    off: int
    size: int
    pieces: list[Piece]  # those not in the page cache
    out: bytearray  # the READ's bytes (the others are in place already)
    started: float


class FastReads:
    """The fast READ path of one mount (see the module docstring)."""

    def __init__(
        self,
        ops: ShuffleOps,
        fs: FileSystem,
        secret: bytes,
        nursery: trio.Nursery,
        queue: KernelQueue,
        counts: FastReadCounts | None = None,
        on_read: Callable[[float, int], None] | None = None,
    ) -> None:
        self.ops = ops
        self.fs = fs
        self.nursery = nursery
        self.token = trio.lowlevel.current_trio_token()
        self.channels = ReadChannels(secret, fs.storage.replicas)
        self.queue = queue
        self.libfuse = queue.libfuse
        queue.after_drain.append(self._send)
        queue.busy.append(self.awaiting)
        # READs handed to a storage node or a disk-wait thread, not answered yet
        self._handed = 0
        self._handed_lock = threading.Lock()
        # inode -> (routing map, True) when every chain of the file had a
        # replica here (its READs are the short circuit's without checking
        # again), (routing map, False) when a READ of it met chains with and
        # without one (its READs are declined at once)
        self._here: dict[int, tuple[Routing, bool]] = {}
        # short-circuit READs that must wait for the disk (`_read_local`)
        self._disk_waits = ThreadPoolExecutor(LOCAL_THREADS, thread_name_prefix="fuse-local")
        self._inline_after = 0.0  # perf_counter time before which no disk wait is inline
        self.on_read = on_read  # (started, bytes) of every read answered here: metrics
        self._replying = threading.Lock()  # held while answering; `close` takes it last
        self.closed = False
        self.counts = counts or FastReadCounts()
        self._warned = False

    def install(self) -> None:
        READ_INODES.hook_reads(self.read, self.ops.inode_reads is not None)

    # ---- the READ callback (the loop's thread, inside libfuse's dispatch) ----

    def read(self, req: int, ino: int, size: int, off: int, fi: int) -> bool:
        """Take the READ (True: it is answered, now or later) or decline.
        A READ taken here goes on to take the READs already waiting in the
        kernel behind it (`_drain`), then sends all their requests at once."""
        try:
            took = self._read(req, ino, size, off, fi)
        except Exception:
            if not self._warned:
                self._warned = True
                log.exception("fast READ of inode %d failed: such READs go the usual way", ino)
            took = False
        if not took:
            self.counts.declined += 1
        self.queue.answered(took)
        return took

    def awaiting(self) -> bool:
        """Whether a READ handed on is still unanswered (the loop's thread
        then does not poll the kernel's queue: libfuse.py, "spin")."""
        return self._handed > 0

    def _handing(self, n: int) -> None:
        with self._handed_lock:
            self._handed += n

    def _send(self) -> None:
        """(after the kernel's queue was drained) the READs planned meanwhile go out."""
        self.channels.flush(self._routing)

    def _read(self, req: int, ino: int, size: int, off: int, fi: int) -> bool:
        if self.closed:
            return False
        ops = self.ops
        if ops.inode_reads is not None:  # cache=immutable: READs carry no handle
            fh = ops.inode_reads.held(ino)
            if fh is None:
                started = time.perf_counter()
                ahead = ops.inode_reads.read_unopened(ino, off, size)
                if ahead is not None:  # prefetched: no handle needed
                    self._reply(req, ahead, started)
                    return True
                fh = ops.inode_reads.take_now(ino, self.nursery)
            if fh is None:
                # its first READ here, not in the open cache: opened on the
                # loop, then read here
                self.nursery.start_soon(self._open_then_read, req, ino, size, off)
                return True
        elif READ_INODES.fh_confirmed and fi:
            fh = ctypes.c_uint64.from_address(fi + FH_OFFSET).value
        else:
            return False
        fs = self.fs
        routing = fs.storage.routing.current
        here = self._here.get(ino)
        all_here = here[1] if here is not None and here[0] is routing else None
        if all_here is False:
            return False  # a READ of it met chains with and without a replica here
        f = fs.files.get(fh)
        if f is None or f.ino != ino or f.layout is None or not f.readable:
            return False
        st = fs.inodes.get(ino)
        if st is not None and st.behind:
            return False
        started = time.perf_counter()
        ahead = ops.prefetch.read(ino, off, size)
        if ahead is not None:
            ops.handed(ino, off, len(ahead))
            self._reply(req, ahead, started)
            return True
        if ino in ops.prefetch.landing.fetching:
            return False  # being read ahead right now: the loop waits for those bytes
        extents = fs.extents(f, ((off, size),))
        n = extents[0][3]
        if n == 0:
            self._reply(req, b"", started)
            return True
        pieces = plan(extents)
        if all_here:  # (checked on an earlier READ)
            return self._read_local(req, fh, ino, off, size, pieces, n, started)
        chains = {p[0] for p in pieces}
        local = self._local_chains(routing, chains)
        if local:
            if local == chains:  # the short circuit's; the file's too if all of it is here
                file_chains = set(f.layout["chains"])
                if self._local_chains(routing, file_chains) == file_chains:
                    self._remember(ino, routing, True)
                return self._read_local(req, fh, ino, off, size, pieces, n, started)
            # partly here: the loop reads both kinds (and every READ of this
            # file is declined at once from now on)
            self._remember(ino, routing, False)
            return False
        if not self.channels.connected(routing, chains):
            return False
        out = bytearray(n)
        done = functools.partial(self._done, req, fh, off, size, out, started)
        self._handing(1)
        self.channels.submit(pieces, memoryview(out), done)
        self.counts.taken += 1
        ops.handed(ino, off, n)
        return True

    def _read_local(
        self,
        req: int,
        fh: int,
        ino: int,
        off: int,
        size: int,
        pieces: list[Piece],
        n: int,
        started: float,
    ) -> bool:
        """The short circuit: bytes in the page cache answered now, the rest
        read by a thread that answers (the loop if a chunk file cannot serve)."""
        out = bytearray(n)
        rest = self.fs.storage.local.read_pieces(pieces, memoryview(out), wait=False)
        self.counts.taken += 1
        self.counts.local += 1
        self.ops.handed(ino, off, n)
        if not rest:
            self._reply(req, out, started)
            return True
        cold = ColdRead(req, fh, off, size, rest, out, started)
        job = functools.partial(self._wait_local, cold)
        self._handing(1)
        if self._wait_here():
            waited = time.perf_counter()
            job()
            now = time.perf_counter()
            if now - waited > INLINE_WAIT_MAX:
                self._inline_after = now + INLINE_PAUSE
            return True
        if self._read_ring(cold):
            return True
        try:
            self._disk_waits.submit(job)
        except RuntimeError:  # shut down: the mount is closing, the kernel aborts its requests
            self._handing(-1)
        return True

    def _wait_here(self) -> bool:
        """Wait for the disk on the loop's thread? Only when nothing else
        waits on this mount (no READ handed on, no request in the kernel's
        queue): the wait then holds up no one, and spares the hand-over to a
        disk-wait thread and back, two wake-ups across cores (one reader of
        cold samples: 150 µs of its 650 µs READ, measured). Not for
        `INLINE_PAUSE` after such a wait took over `INLINE_WAIT_MAX` (a slow
        or busy disk): a request that comes meanwhile waits one disk read
        at most."""
        if self._handed > 1 or time.perf_counter() < self._inline_after:
            return False
        if not self.queue.empty():
            return False
        self.counts.inline += 1
        return True

    def _read_ring(self, cold: ColdRead) -> bool:
        """Read what was not in the page cache through this loop's io_uring
        (False: not possible now; the caller hands it to a disk-wait thread).
        The ring's reaper, a task of this loop, answers once the disk did:
        no thread and no GIL handed back and forth (with four readers of
        cold samples, 31 futex calls per sample went to that, measured). The
        READ stays counted as handed (`_handing`) until then. With
        `OFFLOAD_AT` or more READs waiting for the disk, this thread is the
        busy one: the kernel's workers copy the bytes read instead
        (`UringReads.submit`'s *offload*; cold 110 KB samples from eight
        processes a median 5% more per second, from sixteen 8-21%; offloaded
        always, one process read a fifth fewer, the worker's wake-up being
        its latency: so not below that; docs/storage.md)."""
        ring = for_this_run()  # (opened on first use, then kept by the run)
        local = self.fs.storage.local
        planned = local.plan_pieces(cold.pieces, ring.opens_linked) if ring is not None else None
        if ring is None or planned is None:
            return False
        reads = local.disk_reads(planned)

        def then(outcomes: list[FileOutcome]) -> None:
            self._handing(-1)
            if local.finish_pieces(memoryview(cold.out), planned, outcomes):
                self.counts.ring += 1
                self._reply(cold.req, cold.out, cold.started)
            else:  # changed, damaged: the daemons decide
                self._fall_back(cold.req, cold.fh, cold.off, cold.size, ())

        offload = self._handed >= OFFLOAD_AT
        if not ring.submit(reads, then, offload=offload):
            local.discard(planned)
            return False
        self.counts.offloaded += offload
        return True

    def _wait_local(self, cold: ColdRead) -> None:
        """(a disk-wait thread, or the loop's: `_wait_here`) Read what was not
        in the page cache and answer."""
        try:
            rest = self.fs.storage.local.read_pieces(cold.pieces, memoryview(cold.out), wait=True)
        except Exception:
            log.exception("short-circuit READ at %d of handle %d", cold.off, cold.fh)
            rest = cold.pieces
        finally:
            self._handing(-1)
        if not rest:
            self._reply(cold.req, cold.out, cold.started)
            return
        # a chunk file that cannot serve (changed, damaged, gone): the loop's
        # read goes through the daemons, which decide
        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(self._fall_back, cold.req, cold.fh, cold.off, cold.size, ())

    async def _open_then_read(self, req: int, ino: int, size: int, off: int) -> None:
        """(the loop) A cache=immutable file's first READ: its handle (one
        metadata call, as `ShuffleOps.read` would make), then the fast path."""
        inode_reads = self.ops.inode_reads
        assert inode_reads is not None
        try:
            started = time.perf_counter()
            ahead = await inode_reads.read_prefetching(ino, off, size)  # (no handle needed)
            if ahead is not None:
                self._reply(req, ahead, started)
                return
            fh = await inode_reads.handle(ino)
        except FsError as exc:
            self._reply_error(req, exc.code)
            return
        except BaseException:
            self._reply_error(req, errno.EINTR)
            raise
        if inode_reads.held(ino) is not None and self._read(req, ino, size, off, 0):
            self.channels.flush(self._routing)
        else:
            self.counts.declined += 1
            await self._read_on_loop(req, fh, off, size)

    def _routing(self) -> Routing:
        return self.fs.storage.routing.current

    def _remember(self, ino: int, routing: Routing, all_here: bool) -> None:
        if len(self._here) >= MAX_LOCAL_FILES:
            self._here.clear()
        self._here[ino] = (routing, all_here)

    def _local_chains(self, routing: Routing, chains: set[int]) -> set[int]:
        """Those of *chains* with a serving replica on this host that the
        short circuit can read (it is on, and the target's files are
        readable by this process)."""
        storage = self.fs.storage
        local = storage.replicas.local_targets(routing) if storage.local.enabled else ()
        if not local:
            return set()
        serving, reader = storage.replicas.serving, storage.local.target
        return {
            chain
            for chain in chains
            if any(t["id"] in local and reader(routing, t["id"]) for t in serving(routing, chain))
        }

    # ---- answers (a reply thread, or the loop for fallbacks) ----------------

    def _done(
        self,
        req: int,
        fh: int,
        off: int,
        size: int,
        out: bytearray,
        started: float,
        read: ChannelRead,
    ) -> None:
        self._handing(-1)
        if read.ok:
            self._reply(req, out, started)
            return
        # (if the loop is gone, so is the mount: the kernel aborts its requests)
        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(self._fall_back, req, fh, off, size, read.failures)

    def _reply(self, req: int, data: Any, started: float) -> None:
        buf, n = _address(data)
        if self.on_read is not None:
            # counted before the reply: the reader may look at the mount's
            # counters as soon as it has its bytes (a READ the kernel then
            # drops, its reader killed meanwhile, is counted all the same)
            self.on_read(started, n)
        with self._replying:
            if self.closed:
                return
            ret = self.libfuse.reply_buf(req, buf, n)
        if ret == -errno.ENOENT:  # the reader was interrupted (killed) meanwhile
            log.debug("fuse_reply_buf: request already gone")
        elif ret:
            log.error("fuse_reply_buf failed: %s", errno.errorcode.get(-ret, ret))

    def _reply_error(self, req: int, code: int) -> None:
        with self._replying:
            if self.closed:
                return
            self.libfuse.reply_err(req, code)

    def _fall_back(
        self, req: int, fh: int, off: int, size: int, failures: Sequence[tuple[int, int]]
    ) -> None:
        """(the loop) Read it the usual way, avoiding the replicas that failed."""
        self.counts.fell_back += 1
        storage = self.fs.storage
        routing = storage.routing.current
        for tid, code in set(failures):
            if tid >= 0 and code != NOT_CONNECTED:  # (else nothing is known of the replica)
                storage.replicas.failed(routing, tid, FsError(code, f"fast read from target {tid}"))
        self.nursery.start_soon(self._read_on_loop, req, fh, off, size)

    async def _read_on_loop(self, req: int, fh: int, off: int, size: int) -> None:
        started = time.perf_counter()
        try:
            data = await self.ops.read_handle(fh, off, size)
        except pyfuse3.FUSEError as exc:
            self._reply_error(req, exc.errno)
        except BaseException:
            self._reply_error(req, errno.EINTR)
            raise
        else:
            self._reply(req, data, started)

    def close(self) -> None:
        """Stop taking READs and answering them (before the FUSE session
        closes); connections and reply threads end."""
        READ_INODES.hook_reads(None, self.ops.inode_reads is not None)
        with self._replying:
            self.closed = True
        self._disk_waits.shutdown(wait=False, cancel_futures=True)
        self.channels.close()
