"""The filesystem as one client process sees it.

`FileSystem` offers inode-level operations (what the FUSE mount needs) and
path-level ones (what native code needs) over the metadata and storage
clients, and owns this client's open files:

* the layout of every open file, so reads and writes go straight to the
  storage daemons without asking the metadata server again;
* the attribute overlay: a file's length and mtime after local writes are
  reported to the metadata server on flush/fsync/close (close-to-open, as
  in 3FS), and until then overlaid on the attributes this client hands out;
  a reply older than attributes already seen of an open file (by their
  `change` counter) gives way to those (`InodeState.newest`), and so does
  one of a file closed less than half a minute ago (`LastAttrs`).

Its parts, one module each: the metadata session (client/session.py),
write-behind (client/write_behind.py), and the storage side
(client/storage_client.py: replica choice, short-circuit reads, the read
engine, chain writes), all over the one chunk planner (client/layout.py).
`read_into` is the ONE read entry point: the FUSE mount, the native API and
the data sampler all read through it (the native ones first try the
blocking fast path of client/blocking_read.py, which shares its parts).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

import trio

from shufflefs.client.cache_watch import CacheWatch
from shufflefs.client.creates import Creates
from shufflefs.client.layout import Extent, plan
from shufflefs.client.length_reports import (
    BEHIND_LINGER,
    RELEASE_LINGER,
    Closes,
    lay_owed,
    owe_attrs,
    owed_now,
    report_length,
    sent_owed,
    setattr_in_order,
)
from shufflefs.client.meta_client import MetaClient
from shufflefs.client.namespace_calls import NamespaceCalls
from shufflefs.client.open_cache import CachedOpen, OpenCache
from shufflefs.client.path_ops import ACCESS_MODE, PathOps
from shufflefs.client.read_only_calls import ReadOnlyCalls
from shufflefs.client.session import Session
from shufflefs.client.storage_client import StorageClient
from shufflefs.client.write_behind import InodeState, LastAttrs, WriteBehind, drain
from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.protocol import (
    Attr,
    Layout,
    MountInfo,
    OpenResult,
    OwedAttrs,
    is_read_only_handle,
)
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.addresses import hostname
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.transport import Buffer

log = logging.getLogger("shufflefs.client")


@dataclass
class ClientOptions:
    meta_timeout: float = 10.0
    read_timeout: float = 10.0
    write_timeout: float = 30.0
    retry_budget: float = 30.0  # seconds a call keeps retrying through transient failures
    local_reads: bool = True  # read chunk files of this host's targets directly
    write_buffer: int = 64 << 20  # bytes per file written behind (0: every write waits)
    # seconds an idle read-only handle stays cached for the next open (0: no
    # open cache), and whether cached opens skip revalidation (client/open_cache.py)
    open_linger: float = 0.0
    trust_open_cache: bool = False
    cache_watch: bool = True  # without trust: cached opens kept fresh (client/cache_watch.py)
    mount: MountInfo | None = None  # what a FUSE mount reports of itself with its session
    inline_disk_waits: bool = True  # off for a mount (client/read_engine.py, `ReadEngine`)


@dataclass
class OpenFile:
    fh: int
    ino: int
    flags: int
    handle: int
    layout: Layout | None
    position: int = 0  # for the native file API
    cached: CachedOpen | None = None  # its handle is the open cache's (client/open_cache.py)
    created: bool = False  # made by this open (so it has no xattrs yet)
    parent_attr: Attr | None = None  # made by this open: its directory's attributes after it
    releasing: bool = False  # its release has begun: the session renewal no longer reports it

    @property
    def readable(self) -> bool:
        return self.flags & ACCESS_MODE != os.O_WRONLY

    @property
    def writable(self) -> bool:
        return self.flags & ACCESS_MODE != os.O_RDONLY


class FileSystem(NamespaceCalls, PathOps):
    def __init__(
        self,
        rpc: RpcClient,
        routing: RoutingCache,
        options: ClientOptions | None = None,
        name: str | None = None,
    ) -> None:
        self.options = options or ClientOptions()
        self.rpc = rpc
        self.routing = routing
        self.meta = MetaClient(
            rpc, routing, timeout=self.options.meta_timeout, retry_budget=self.options.retry_budget
        )
        self.storage = StorageClient(
            rpc,
            routing,
            read_timeout=self.options.read_timeout,
            write_timeout=self.options.write_timeout,
            retry_budget=self.options.retry_budget,
            local_reads=self.options.local_reads,
            inline_disk_waits=self.options.inline_disk_waits,
        )
        self.write_behind = WriteBehind(self.storage, self.options.write_buffer)
        self.name = name or f"{hostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.session = Session(
            self.meta,
            self.name,
            self._reopen_files,
            self._read_only_handles,
            mount=self.options.mount,
        )
        # the metadata calls of read-only opens (batched) and of giving handles back
        self.read_only = calls = ReadOnlyCalls(self.meta, self.session)
        self.closes = Closes(self.meta, self.session, calls.release)
        self.creates = Creates(self.session)  # overlapping ones in one call
        self.open_cache = OpenCache(
            calls.fresh_attr,
            calls.open,
            calls.release,
            release_many=calls.release_many,
            open_many=lambda inos: calls.open_many([(i, os.O_RDONLY) for i in inos]),
            trust=self.options.trust_open_cache,
            linger=self.options.open_linger,
        )
        # a read-write mount's cached opens kept fresh without a round trip each
        self.cache_watch: CacheWatch | None = None
        options = self.options
        if self.open_cache.enabled and options.cache_watch and not options.trust_open_cache:
            self.open_cache.watch = self.cache_watch = CacheWatch(
                self.meta, self.session, self.open_cache.changed, self.open_cache.drop_all
            )
        self.files: dict[int, OpenFile] = {}
        self.inodes: dict[int, InodeState] = {}
        self.last_attrs = LastAttrs()  # of files whose InodeState is gone
        self._fh = itertools.count(1)

    # ---- lifecycle ------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        self.storage.start(nursery)
        await self.routing.start(nursery)
        await self.session.start(nursery)
        if self.open_cache.enabled:
            nursery.start_soon(self.open_cache.run)
        if self.cache_watch is not None:
            await self.cache_watch.start(nursery)

    def _read_only_handles(self) -> list[list[int]]:
        """What the session renewal reports: [ino, handle] of each open file
        whose handle the metadata server holds in memory only."""
        # (not one being given back: a renewal reporting it again after its
        # release reached a restarted server would hold it there for good)
        held = {
            (f.ino, f.handle)
            for f in self.files.values()
            if is_read_only_handle(f.handle) and not f.releasing
        }
        held.update(self.open_cache.handles())
        return [[ino, handle] for ino, handle in held]

    async def _reopen_files(self) -> None:
        """Take new handles for our open files under a new session."""
        self.open_cache.clear()
        for f in list(self.files.values()):
            f.cached = None
            try:
                res = await self.meta.call_at_most_once(
                    "reopen",
                    lambda m, f=f: m.open(f.ino, f.flags, self.session.id),  # type: ignore[misc]
                )
                f.handle = res["handle"]
            except FsError as exc:
                log.error("cannot reopen ino=%d after session loss: %s", f.ino, exc.message)

    async def close(self) -> None:
        """Close every open file (reporting lengths) and the session."""
        for fh in list(self.files):
            try:
                await self.release(fh)
            except FsError as exc:
                log.warning("closing fh=%d: %s", fh, exc.message)
        if self.cache_watch is not None:
            self.cache_watch.stop()
        await self.session.close()

    # ---- attributes ---------------------------------------------------------

    def overlay(self, attr: Attr) -> Attr:
        """Attributes as this client must report them: the metadata server's,
        with unreported local writes applied."""
        self.open_cache.observe(attr)
        st = self.inodes.get(attr["ino"])
        if st is None:
            return self.last_attrs.newest(attr)
        attr = st.newest(attr)
        if st.dirty:
            attr = {
                **attr,
                "size": max(attr["size"], st.size),
                "mtime": attr["mtime"] if st.mtime_set else st.mtime,
                "ctime": max(attr["ctime"], st.mtime),
            }
        else:
            st.size = attr["size"]
        return lay_owed(st, attr) if st.owed else attr

    async def lookup(self, parent: int, name: bytes) -> Attr:
        return self.overlay(await self.meta.call_read("lookup", lambda m: m.lookup(parent, name)))

    async def lookup_open(self, parent: int, name: bytes) -> Attr:
        """`lookup` for an open that will not write (a read-only mount's, or a
        watched read-write mount's): a regular file opened read-only in the
        same call, its handle left in the open cache for that open."""
        if self.open_cache.enabled:
            stamp = self.open_cache.stamp()
            res = await self.read_only.lookup_open(parent, name)
            if res is not None:
                if res["handle"]:
                    self.open_cache.adopt(res, stamp)
                return self.overlay(res["attr"])
        return await self.lookup(parent, name)

    async def getattr(self, ino: int) -> Attr:
        st = self.inodes.get(ino)
        if st is None or not st.dirty:
            return self.overlay(await self._server_getattr(ino))
        async with st.meta_lock:  # not answered from before a report that overtook it
            return self.overlay(await self._server_getattr(ino))

    async def _server_getattr(self, ino: int) -> Attr:
        return await self.meta.call_read("getattr", lambda m: m.getattr(ino))

    async def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime: int | None = None,
        mtime: int | None = None,
    ) -> Attr:
        st = self.inodes.get(ino)
        if size is not None:
            # the writes in flight land first, and their length, before the cut
            await self.drain(ino)
            if st is not None and st.dirty:
                await report_length(self.meta, ino, st)

        owed = owed_now(st)  # set behind before: sent now, this call's values over them
        mode = owed.get("mode") if mode is None else mode
        uid = owed.get("uid") if uid is None else uid
        gid = owed.get("gid") if gid is None else gid
        atime = owed.get("atime") if atime is None else atime
        mtime = owed.get("mtime") if mtime is None else mtime

        def call(m: MetaStub) -> Awaitable[Attr]:
            return m.setattr(ino, mode=mode, uid=uid, gid=gid, size=size, atime=atime, mtime=mtime)

        sets_mtime = size is None and mtime is not None
        attr = await setattr_in_order(self.meta, st, call, sets_mtime)
        sent_owed(st, owed)  # (if refused, still owed: for the close)
        if size is not None:
            self.storage.local.forget(ino)
        if st is not None and size is not None:
            st.size = size
        return self.overlay(attr)

    def setattr_behind(self, ino: int, attrs: OwedAttrs, within: float) -> Attr | None:
        """*attrs* set with the close of a file this client has open for
        writing (`owe_attrs`), answered now with its attributes, if the
        server's part of those came within *within* seconds (`_writing`);
        else None (the caller sends them now, and the reply answers)."""
        writing = self._writing(ino, within)
        if writing is None:
            return None
        owe_attrs(writing[0], attrs)
        return self.overlay(writing[1])

    def written_attr(self, ino: int, within: float) -> Attr | None:
        """The attributes of a file this client has open for writing, if the
        server's part of them came within *within* seconds (what the kernel
        would still answer from its cache, had this client's writes not
        dropped it), else None."""
        writing = self._writing(ino, within)
        return None if writing is None else self.overlay(writing[1])

    def _writing(self, ino: int, within: float) -> tuple[InodeState, Attr] | None:
        """*ino*'s state and attributes if this client has it open for writing (a writable
        handle the kernel has not released) and holds its attributes from
        the server of less than *within* seconds ago, with no change of
        this client's since that no reply told of (an unlink's nlink:
        `_attrs_changed`)."""
        st = self.inodes.get(ino)
        if st is None or st.writers <= 0 or st.attr is None:
            return None
        return (st, st.attr) if time.monotonic() - st.attr_at < within else None

    # ---- open files -------------------------------------------------------------

    def _track(self, res: OpenResult, flags: int, fresh: bool = True) -> tuple[OpenFile, Attr]:
        attr = res["attr"]
        ino = attr["ino"]
        if fresh:
            # close-to-open: what this client cached of the file's chunks is
            # re-read (not after a cached open: the file is unchanged)
            self.storage.local.forget(ino)
        st = self.inodes.get(ino)
        if st is None:
            attr = self.last_attrs.newest(attr)  # not older than its last close
            st = self.inodes[ino] = InodeState(size=attr["size"], attr=attr)
        st.opens += 1
        f = OpenFile(next(self._fh), ino, flags, res["handle"], res["layout"])
        st.writers += f.writable
        f.created = res.get("created", False)
        f.parent_attr = res.get("parent_attr")
        self.files[f.fh] = f
        return f, self.overlay(attr)

    async def create(
        self,
        parent: int,
        name: bytes,
        mode: int,
        flags: int,
        uid: int,
        gid: int,
        together: bool = False,
    ) -> tuple[OpenFile, Attr]:
        """*together*: see client/creates.py (the import's files in flight)."""
        try:
            res = await self.creates.create(parent, name, mode, flags, uid, gid, together)
        except BaseException:
            self._dirs_changing(parent)  # (whether it landed is not known)
            raise
        if self.cache_watch is not None:
            if res.get("created"):
                self.cache_watch.created(parent, name, res.get("parent_attr"))
            else:  # it was there: the names held said otherwise, or did not say
                self._dirs_changing(parent)
        return self._track(res, flags)

    async def open(self, ino: int, flags: int) -> tuple[OpenFile, Attr]:
        if self._cacheable(flags):
            return self._track_cached(*await self.open_cache.open(ino, flags), flags)
        # our cached handle must not keep alive a file removed elsewhere for
        # an open that would write to it (reached through a stale name: the
        # server answers ENOENT once nothing holds it, the kernel looks again)
        await self.open_cache.discard(ino)
        res = await self.session.call("open", lambda m, s: m.open(ino, flags, s))
        return self._track(res, flags)

    def open_now(self, ino: int, flags: int) -> tuple[OpenFile, Attr] | None:
        """`open` when it needs no round trip (a read-only open the open
        cache answers: `OpenCache.open_now`), else None and nothing done."""
        hit = self.open_cache.open_now(ino) if self._cacheable(flags) else None
        return None if hit is None else self._track_cached(*hit, flags)

    def _cacheable(self, flags: int) -> bool:
        """Is an open with *flags* one the open cache answers (read-only)?"""
        return self.open_cache.enabled and flags & (ACCESS_MODE | os.O_TRUNC) == os.O_RDONLY

    def _track_cached(self, entry: CachedOpen, reused: bool, flags: int) -> tuple[OpenFile, Attr]:
        res: OpenResult = {"attr": entry.attr, "layout": entry.layout, "handle": entry.handle}
        f, attr = self._track(res, flags, fresh=not reused)
        f.cached = entry
        return f, attr

    def holds_open(self, ino: int) -> bool:
        """Whether a handle of this client (an open the kernel has not
        released) is on *ino*."""
        return any(f.ino == ino for f in self.files.values())

    def file(self, fh: int) -> OpenFile:
        f = self.files.get(fh)
        if f is None:
            raise FsError(errno.EBADF, f"no open file with handle {fh}")
        return f

    def known_size(self, ino: int) -> int:
        st = self.inodes.get(ino)
        return st.size if st is not None else 0

    def extents(self, f: OpenFile, ranges: Sequence[tuple[int, int]]) -> list[Extent]:
        """(offset, length) reads of an open file as extents, each clamped to
        the file's end as this client knows it (with its own writes)."""
        if f.layout is None:
            raise FsError(errno.EINVAL, "not a regular file")
        size = self.known_size(f.ino)
        return [(f.ino, f.layout, off, max(0, min(length, size - off))) for off, length in ranges]

    def writes_behind(self, extents: Sequence[Extent]) -> bool:
        """Whether a file of *extents* has writes in flight (or an unreported
        failure): then only `read_into` may read, as it waits for them."""
        inodes = self.inodes
        return any(st.behind for e in extents if (st := inodes.get(e[0])) is not None)

    async def read(self, fh: int, offset: int, size: int) -> bytearray:
        """One positioned read (what FUSE asks): clamped to the file's end."""
        f = self.file(fh)
        st = self.inodes.get(f.ino)
        if st is not None and st.behind:
            await self.drain(f.ino)  # read our own writes (and the size they give)
        extents = self.extents(f, ((offset, size),))
        out = bytearray(extents[0][3])
        if out:
            await self.read_into(extents, memoryview(out))
        return out

    async def read_into(
        self, extents: Sequence[Extent], out: memoryview, cold: bool = False
    ) -> None:
        """THE read: *extents* into *out*, laid end to end in the order given
        (the caller clamps each to its file; bytes past a chunk's end read as
        zeros, as a hole does). Our own writes first; then local chunk files
        inline (no task, no message: most reads on a storage host end here);
        the rest through the read engine, which fails over and retries.
        *cold*: the caller expects bytes the page cache does not hold (a
        prefetch along the shuffle): no inline attempt, whose readahead of
        a cold file would start on the event loop (`ReadEngine.read`)."""
        total = sum(e[3] for e in extents)
        if len(out) < total:
            raise FsError(errno.EINVAL, f"output buffer of {len(out)} bytes for {total} bytes")
        if self.writes_behind(extents):
            for ino in {e[0] for e in extents}:
                await self.drain(ino)
        out = out.cast("B") if out.format != "B" else out
        reads = self.storage.reads
        pieces = plan(extents) if cold else reads.read_local_now(plan(extents), out)
        if pieces:
            await reads.read(pieces, out, cold)

    async def write(self, fh: int, offset: int, data: Buffer, owned: bool = False) -> int:
        """Write-behind (see client/write_behind.py): returns once the bytes
        are handed over, unless `options.write_buffer` bytes of the file are
        already in flight; a failure is reported by the next call. *owned*:
        the caller never changes *data* again, so it is not copied."""
        f = self.file(fh)
        if f.layout is None:
            raise FsError(errno.EINVAL, "not a regular file")
        if not f.writable:
            raise FsError(errno.EBADF, "file not open for writing")
        n = len(data)
        if n == 0:
            return 0
        st = self.inodes[f.ino]
        await self.write_behind.write(f.ino, f.layout, st, offset, data, owned)
        _wrote(st, offset + n)
        return n

    def write_now(self, fh: int, offset: int, data: Buffer) -> int | None:
        """`write` when it goes behind with no wait (`WriteBehind.room`);
        None, and nothing done, when it would wait or fail."""
        f = self.files.get(fh)
        st = None if f is None else self.inodes.get(f.ino)
        n = len(data)
        if f is None or f.layout is None or not f.writable or st is None or not n:
            return None
        if not self.write_behind.room(st, n):
            return None
        self.write_behind.queue(f.ino, f.layout, st, offset, data)
        _wrote(st, offset + n)
        return n

    async def drain(self, ino: int) -> None:
        """Wait for this file's writes in flight; raise the first failure."""
        st = self.inodes.get(ino)
        if st is not None:
            await drain(st)

    async def flush(self, fh: int) -> None:
        """close(2) on a descriptor: make our writes visible to other clients."""
        f = self.file(fh)
        await self.drain(f.ino)
        st = self.inodes.get(f.ino)
        if st is None or not (st.dirty or st.owed) or await self.closes.report(f.ino, st):
            return
        if st.dirty:
            await report_length(self.meta, f.ino, st)
        if st.owed:
            await self.setattr(f.ino)  # what was set behind, durable and seen by others now

    async def fsync(self, fh: int) -> None:
        # data is durable once a write is acknowledged; what remains is the length
        await self.flush(fh)

    async def release(self, fh: int, behind: bool = False, unwaited: bool = False) -> None:
        """Close handle *fh* (a written file: its length reported, `Closes`);
        *behind*: nobody waits for it (a writeback mount's close), nor, when
        *unwaited*, for a release that owes nothing (the kernel's RELEASE
        after its FLUSH reported): each waits a while for others to share
        its call."""
        f = self.files.get(fh)
        if f is None:
            return
        f.releasing = True
        st = self.inodes.get(f.ino)
        if st is not None and f.writable and f.cached is None:
            # released by the kernel: what is set from now on is not this
            # close's (it may have left already), so not set behind
            st.writers -= 1
        closed = False
        try:
            if f.cached is None and f.writable:
                await self.drain(f.ino)
                # the length report owed and the release in one call, with
                # the closes that overlap it (`Closes`)
                closed = True
                linger = BEHIND_LINGER if behind else 0.0
                if unwaited and (st is None or not (st.dirty or st.owed)):
                    linger = RELEASE_LINGER  # for the next flush's report to carry it
                await self.closes.close(f.ino, f.handle, st, linger)
            else:
                await self.flush(fh)
        finally:
            self._untrack(f)
            if f.cached is not None:
                await self.open_cache.close(f.cached)  # no round trip
            elif not closed:
                await self.read_only.release(f.ino, f.handle)

    def release_now(self, fh: int) -> bool:
        """`release` when it needs no round trip and no wait (a file the
        open cache answered, with nothing to flush and its cached handle
        not to be given back), else False and nothing done."""
        f = self.files.get(fh)
        if f is None or f.cached is None or (f.cached.dropped and f.cached.users <= 1):
            return False
        st = self.inodes.get(f.ino)
        if st is not None and (st.behind or st.dirty):
            return False
        self._untrack(f)
        self.open_cache.close_now(f.cached)
        return True

    def _untrack(self, f: OpenFile) -> None:
        del self.files[f.fh]
        st = self.inodes.get(f.ino)
        if st is not None:
            st.opens -= 1
            if st.opens <= 0:
                del self.inodes[f.ino]
                if st.attr is not None:
                    self.last_attrs.keep(st.attr)
                # no chunk file of it stays open here: a removed chunk's
                # space must come back once the daemons delete it
                self.storage.local.close_file(f.ino)


def _wrote(st: InodeState, end: int) -> None:
    """A local write up to *end* went behind: the length and time this
    client owes the metadata server."""
    st.size = max(st.size, end)
    st.dirty = True
    st.mtime = time.time_ns()
    st.mtime_set = False
    st.owed.pop("mtime", None)  # the write's time, not one set before it
    st.generation += 1
