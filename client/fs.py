"""The filesystem as one client process sees it.

`FileSystem` offers inode-level operations (what the FUSE mount needs) and
path-level ones (what native code needs) over the metadata and storage
clients, and owns this client's open files:

* a metadata *session*, renewed in the background, under which every open
  file holds a handle (so an unlinked file keeps its data until closed);
* the layout of every open file, so reads and writes go straight to the
  storage daemons without asking the metadata server again;
* per-inode write state: a file's length and mtime after local writes are
  reported to the metadata server on flush/fsync/close (close-to-open, as
  in 3FS), and until then overlaid on the attributes this client hands out.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import posixpath
import stat
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from shufflefs.client.meta_client import MetaClient
from shufflefs.client.storage_client import StorageClient
from shufflefs.cluster.protocol import Capacity
from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.protocol import (
    ROOT_INODE,
    SESSION_EXPIRED,
    Attr,
    FsStats,
    Layout,
    MetaStub,
    OpenResult,
    ReaddirPage,
)
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.runtime import hostname
from shufflefs.rpc.transport import Buffer

log = logging.getLogger("shufflefs.client")

ACCESS_MODE = os.O_RDONLY | os.O_WRONLY | os.O_RDWR


@dataclass
class ClientOptions:
    meta_timeout: float = 10.0
    read_timeout: float = 10.0
    write_timeout: float = 30.0
    retry_budget: float = 30.0  # seconds a call keeps retrying through transient failures
    routing_poll: float = 1.0
    local_reads: bool = True  # read chunk files of this host's targets directly
    write_buffer: int = 64 << 20  # bytes per file written behind (0: every write waits)


@dataclass
class InodeState:
    """What this client knows better than the metadata server about a file it has open."""

    size: int
    opens: int = 0
    dirty: bool = False  # written since the length was last reported
    mtime: int = 0  # ns of the last local write
    generation: int = 0  # bumps with every local write
    # Writes acknowledged to the caller but still on their way to storage.
    pending_bytes: int = 0
    progress: trio.Event = field(default_factory=trio.Event)  # set when a write completes
    chunk_tails: dict[int, trio.Event] = field(default_factory=dict)  # last write per chunk
    error: FsError | None = None  # the first failure of a write: reported by the next call


@dataclass
class OpenFile:
    fh: int
    ino: int
    flags: int
    handle: int
    layout: Layout | None
    position: int = 0  # for the native file API
    lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def readable(self) -> bool:
        return self.flags & ACCESS_MODE != os.O_WRONLY

    @property
    def writable(self) -> bool:
        return self.flags & ACCESS_MODE != os.O_RDONLY


class FileSystem:
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
        )
        self.name = name or f"{hostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.session = 0
        self.files: dict[int, OpenFile] = {}
        self.inodes: dict[int, InodeState] = {}
        self._fh = itertools.count(1)
        self._session_lock = trio.Lock()

    # ---- lifecycle ------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        self.storage.background = nursery
        self.routing.listeners.append(self.storage.routing_changed)
        await self.routing.start(nursery)
        lease = await self._open_session()
        nursery.start_soon(self._keep_session, lease)

    async def _open_session(self) -> float:
        s = await self.meta.mutate(
            "session_open", lambda m: m.session_open(self.name, hostname(), os.getpid())
        )
        self.session = s["session"]
        log.info("metadata session %d opened (lease %.0fs)", self.session, s["lease"])
        return s["lease"]

    async def _keep_session(self, lease: float) -> None:
        while True:
            await trio.sleep(max(0.5, lease / 3))
            session = self.session
            try:
                # the lambda is awaited right here, inside this iteration
                await self.meta.read("session_renew", lambda m: m.session_renew(session))  # noqa: B023
            except FsError as exc:
                if exc.code != errno.ENOENT:
                    log.warning("session %d renewal failed: %s", session, exc.message)
                    continue
                await self._recover_session(session)

    async def _recover_session(self, lost: int) -> None:
        """The metadata server no longer holds session *lost* (it expired
        while we could not reach it): open a new one and take new handles for
        our open files. Several callers may notice at once; one recovers."""
        async with self._session_lock:
            if self.session != lost:
                return
            log.warning("session %d expired; opening a new one", lost)
            await self._open_session()
            await self._reopen_files()

    async def _reopen_files(self) -> None:
        """Take new handles for our open files under the new session."""
        for f in list(self.files.values()):
            try:
                res = await self.meta.mutate(
                    "reopen",
                    lambda m, f=f: m.open(f.ino, f.flags, self.session),  # type: ignore[misc]
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
        if self.session:
            try:
                await self.meta.mutate("session_close", lambda m: m.session_close(self.session))
            except FsError as exc:
                log.warning("closing session %d: %s", self.session, exc.message)
            self.session = 0

    # ---- attributes ---------------------------------------------------------

    def overlay(self, attr: Attr) -> Attr:
        """Attributes as this client must report them: the metadata server's,
        with unreported local writes applied."""
        st = self.inodes.get(attr["ino"])
        if st is None:
            return attr
        if st.dirty:
            return {
                **attr,
                "size": max(attr["size"], st.size),
                "mtime": st.mtime,
                "ctime": max(attr["ctime"], st.mtime),
            }
        st.size = attr["size"]
        return attr

    async def lookup(self, parent: int, name: bytes) -> Attr:
        return self.overlay(await self.meta.read("lookup", lambda m: m.lookup(parent, name)))

    async def getattr(self, ino: int) -> Attr:
        return self.overlay(await self.meta.read("getattr", lambda m: m.getattr(ino)))

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
        await self.drain(ino)
        if st is not None and st.dirty:
            # report pending writes first, so their mtime cannot overwrite an
            # explicit one later (cp -p sets times on the open file)
            await self._report_length(ino, st)
        attr = await self.meta.mutate(
            "setattr",
            lambda m: m.setattr(
                ino, mode=mode, uid=uid, gid=gid, size=size, atime=atime, mtime=mtime
            ),
        )
        if size is not None:
            self.storage.forget_local(ino)
        if st is not None and size is not None:
            st.size = size
        return self.overlay(attr)

    async def statfs(self) -> tuple[Capacity, FsStats]:
        capacity = await self.routing.mgmtd.capacity()
        stats = await self.meta.read("statfs", lambda m: m.statfs())
        return capacity, stats

    # ---- namespace ------------------------------------------------------------

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        return await self.meta.mutate("mkdir", lambda m: m.mkdir(parent, name, mode, uid, gid))

    async def mknod(
        self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int
    ) -> Attr:
        return await self.meta.mutate(
            "mknod", lambda m: m.mknod(parent, name, mode, rdev, uid, gid)
        )

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        return await self.meta.mutate(
            "symlink", lambda m: m.symlink(parent, name, target, uid, gid)
        )

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Attr:
        attr = await self.meta.mutate("link", lambda m: m.link(ino, new_parent, new_name))
        return self.overlay(attr)

    async def readlink(self, ino: int) -> bytes:
        return await self.meta.read("readlink", lambda m: m.readlink(ino))

    async def unlink(self, parent: int, name: bytes) -> None:
        await self.meta.mutate("unlink", lambda m: m.unlink(parent, name))

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.meta.mutate("rmdir", lambda m: m.rmdir(parent, name))

    async def rename(
        self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        await self.meta.mutate(
            "rename", lambda m: m.rename(parent, name, new_parent, new_name, flags)
        )

    async def readdir(self, ino: int, after: bytes | None, limit: int) -> ReaddirPage:
        page = await self.meta.read("readdir", lambda m: m.readdir(ino, after, limit))
        return {
            "entries": [(name, self.overlay(attr)) for name, attr in page["entries"]],
            "more": page["more"],
        }

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.meta.read("getxattr", lambda m: m.getxattr(ino, name))

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        await self.meta.mutate("setxattr", lambda m: m.setxattr(ino, name, value, flags))

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.meta.read("listxattr", lambda m: m.listxattr(ino))

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self.meta.mutate("removexattr", lambda m: m.removexattr(ino, name))

    # ---- open files -------------------------------------------------------------

    def _track(self, res: OpenResult, flags: int) -> tuple[OpenFile, Attr]:
        attr = res["attr"]
        ino = attr["ino"]
        # close-to-open: what this client cached of the file's chunks is re-read
        self.storage.forget_local(ino)
        st = self.inodes.get(ino)
        if st is None:
            st = self.inodes[ino] = InodeState(size=attr["size"])
        st.opens += 1
        f = OpenFile(next(self._fh), ino, flags, res["handle"], res["layout"])
        self.files[f.fh] = f
        return f, self.overlay(attr)

    async def _in_session(
        self, what: str, call: Callable[[MetaStub, int], Awaitable[OpenResult]]
    ) -> OpenResult:
        """An open/create under our session, renewing a lost session once."""
        session = self.session
        try:
            return await self.meta.mutate(what, lambda m: call(m, session))
        except FsError as exc:
            if exc.code != SESSION_EXPIRED:
                raise
        await self._recover_session(session)
        return await self.meta.mutate(what, lambda m: call(m, self.session))

    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int
    ) -> tuple[OpenFile, Attr]:
        res = await self._in_session(
            "create", lambda m, s: m.create(parent, name, mode, flags, uid, gid, s)
        )
        return self._track(res, flags)

    async def open(self, ino: int, flags: int) -> tuple[OpenFile, Attr]:
        res = await self._in_session("open", lambda m, s: m.open(ino, flags, s))
        return self._track(res, flags)

    def file(self, fh: int) -> OpenFile:
        f = self.files.get(fh)
        if f is None:
            raise FsError(errno.EBADF, f"no open file with handle {fh}")
        return f

    def known_size(self, ino: int) -> int:
        st = self.inodes.get(ino)
        return st.size if st is not None else 0

    async def read(self, fh: int, offset: int, size: int) -> bytes | bytearray:
        f = self.file(fh)
        if f.layout is None:
            raise FsError(errno.EINVAL, "not a regular file")
        st = self.inodes.get(f.ino)
        if st is not None and (st.pending_bytes or st.error):
            await self.drain(f.ino)  # read our own writes
        end = min(offset + size, self.known_size(f.ino))
        if offset >= end:
            return b""
        data = self.storage.read_local_fast(f.ino, f.layout, offset, end - offset)
        if data is not None:
            return data
        return await self.storage.read(f.ino, f.layout, offset, end - offset)

    async def read_many(self, fh: int, ranges: list[tuple[int, int]]) -> bytearray:
        """Many (offset, length) reads of one open file in one go (one request
        per storage node): their bytes end to end, each clamped to the file."""
        f = self.file(fh)
        if f.layout is None:
            raise FsError(errno.EINVAL, "not a regular file")
        await self.drain(f.ino)
        size = self.known_size(f.ino)
        extents = [
            (f.ino, f.layout, off, max(0, min(length, size - off))) for off, length in ranges
        ]
        out = bytearray(sum(e[3] for e in extents))
        if out:
            await self.storage.read_extents_into(extents, memoryview(out))
        return out

    async def write(self, fh: int, offset: int, data: Buffer) -> int:
        """Write-behind: the bytes are handed to background tasks and the call
        returns at once, so a stream of writes keeps several chunk writes in
        flight instead of paying each one's round trip (and durable commit)
        in turn. Writes to the same chunk stay in order. At most
        `options.write_buffer` bytes per file are in flight; flush, fsync,
        close, a truncate and any read of the file wait for them first and
        report the first failure (as a local filesystem reports a failed
        writeback at fsync/close); a failure also fails the next write."""
        f = self.file(fh)
        if f.layout is None:
            raise FsError(errno.EINVAL, "not a regular file")
        if not f.writable:
            raise FsError(errno.EBADF, "file not open for writing")
        n = len(data)
        if n == 0:
            return 0
        st = self.inodes[f.ino]
        self._raise_write_error(st)
        if self.storage.background is None or self.options.write_buffer <= 0:
            await self.storage.write(f.ino, f.layout, offset, data)
        else:
            while st.pending_bytes and st.pending_bytes + n > self.options.write_buffer:
                await st.progress.wait()
                self._raise_write_error(st)
            self._write_behind(f.ino, f.layout, st, offset, bytes(data))
        st.size = max(st.size, offset + n)
        st.dirty = True
        st.mtime = time.time_ns()
        st.generation += 1
        return n

    def _write_behind(
        self, ino: int, layout: Layout, st: InodeState, offset: int, data: bytes
    ) -> None:
        assert self.storage.background is not None
        view = memoryview(data)
        size = layout["chunk_size"]
        pos = offset
        while pos < offset + len(data):
            index = pos // size
            end = min((index + 1) * size, offset + len(data))
            piece = view[pos - offset : end - offset]
            before = st.chunk_tails.get(index)
            done = st.chunk_tails[index] = trio.Event()
            st.pending_bytes += len(piece)
            self.storage.background.start_soon(
                self._write_piece, ino, layout, st, index, pos, piece, before, done
            )
            pos = end

    async def _write_piece(
        self,
        ino: int,
        layout: Layout,
        st: InodeState,
        index: int,
        offset: int,
        piece: memoryview,
        before: trio.Event | None,
        done: trio.Event,
    ) -> None:
        try:
            if before is not None:
                await before.wait()
            if st.error is None:
                await self.storage.write(ino, layout, offset, piece)
        except FsError as exc:
            log.warning("write-behind ino=%d off=%d failed: %s", ino, offset, exc.message)
            if st.error is None:
                st.error = exc
        finally:
            st.pending_bytes -= len(piece)
            if st.chunk_tails.get(index) is done:
                del st.chunk_tails[index]
            done.set()
            st.progress.set()
            st.progress = trio.Event()

    @staticmethod
    def _raise_write_error(st: InodeState) -> None:
        if st.error is not None:
            exc, st.error = st.error, None
            raise FsError(exc.code, f"an earlier write failed: {exc.message}")

    async def drain(self, ino: int) -> None:
        """Wait for this file's writes in flight; raise the first failure."""
        st = self.inodes.get(ino)
        if st is None:
            return
        while st.pending_bytes:
            await st.progress.wait()
        self._raise_write_error(st)

    async def _report_length(self, ino: int, st: InodeState) -> None:
        generation = st.generation
        attr = await self.meta.read(
            "update_length", lambda m: m.update_length(ino, st.size, st.mtime)
        )
        if st.generation == generation:
            st.dirty = False
            st.size = attr["size"]

    async def flush(self, fh: int) -> None:
        """close(2) on a descriptor: make our writes visible to other clients."""
        f = self.file(fh)
        await self.drain(f.ino)
        st = self.inodes.get(f.ino)
        if st is not None and st.dirty:
            await self._report_length(f.ino, st)

    async def fsync(self, fh: int) -> None:
        # data is durable once a write is acknowledged; what remains is the length
        await self.flush(fh)

    async def release(self, fh: int) -> None:
        f = self.files.get(fh)
        if f is None:
            return
        try:
            await self.flush(fh)
        finally:
            del self.files[fh]
            st = self.inodes.get(f.ino)
            if st is not None:
                st.opens -= 1
                if st.opens <= 0:
                    del self.inodes[f.ino]
                    # no chunk file of it stays open here: a removed chunk's
                    # space must come back once the daemons delete it
                    self.storage.forget_local(f.ino)
            await self.meta.mutate("release", lambda m: m.release(f.ino, f.handle, self.session))

    # ---- paths (the native API) ---------------------------------------------------

    async def resolve(self, path: str | bytes, follow: bool = True) -> Attr:
        p = normalize(path)
        if p == b"/":
            return await self.getattr(ROOT_INODE)
        return self.overlay(await self.meta.read("resolve", lambda m: m.resolve(p, follow)))

    async def parent_of(self, path: str | bytes) -> tuple[int, bytes]:
        """(parent inode, name) of a path that need not exist."""
        p = normalize(path)
        head, name = posixpath.split(p)
        if not name:
            raise FsError(errno.EINVAL, "the root has no parent")
        parent = await self.resolve(head)
        if not stat.S_ISDIR(parent["mode"]):
            raise FsError(errno.ENOTDIR, f"{os.fsdecode(head)} is not a directory")
        return parent["ino"], name

    async def open_path(
        self, path: str | bytes, flags: int, mode: int = 0o666
    ) -> tuple[OpenFile, Attr]:
        uid, gid = os.getuid(), os.getgid()
        if flags & os.O_CREAT:
            parent, name = await self.parent_of(path)
            f, attr = await self.create(parent, name, mode & ~current_umask(), flags, uid, gid)
        else:
            attr = await self.resolve(path)
            if stat.S_ISDIR(attr["mode"]) and flags & ACCESS_MODE != os.O_RDONLY:
                raise FsError(errno.EISDIR, f"{os.fsdecode(normalize(path))} is a directory")
            f, attr = await self.open(attr["ino"], flags)
            if flags & os.O_TRUNC and f.writable and attr["size"]:
                attr = await self.setattr(f.ino, size=0)
        return f, attr

    async def listdir(self, path: str | bytes) -> list[bytes]:
        attr = await self.resolve(path)
        if not stat.S_ISDIR(attr["mode"]):
            raise FsError(errno.ENOTDIR, f"{os.fsdecode(normalize(path))} is not a directory")
        names: list[bytes] = []
        after: bytes | None = None
        while True:
            page = await self.readdir(attr["ino"], after, 1024)
            names.extend(name for name, _ in page["entries"])
            if not page["more"] or not page["entries"]:
                return names
            after = page["entries"][-1][0]


def normalize(path: str | bytes) -> bytes:
    """An absolute, normalized path as bytes ('..' resolved lexically)."""
    p = os.fsencode(path)
    if not p.startswith(b"/"):
        p = b"/" + p
    return posixpath.normpath(p).replace(b"//", b"/")


def current_umask() -> int:
    """This process's umask, read without changing it (os.umask would race
    with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
