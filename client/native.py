"""The native client for ordinary (blocking) Python code.

    from shufflefs.client import Client
    with Client() as fs:                       # finds the cluster like the CLI does
        fs.write_bytes("/data/a.bin", b"...")
        with fs.open("/data/a.bin", "rb") as f:
            f.seek(1024); f.read(2048)
        fs.pread("/data/a.bin", 4096, 2048)

No mount needed: calls go straight to the metadata server and the storage
daemons. The async `FileSystem` runs on a trio loop in a background thread;
each blocking call hands one coroutine to it. Errors are OSErrors with the
errno Linux would give (FileNotFoundError, IsADirectoryError, ...).
"""

from __future__ import annotations

import atexit
import errno
import functools
import io
import os
import stat as stat_mod
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import trio

from shufflefs.client.blocking_read import BlockingReader
from shufflefs.client.fs import ClientOptions, FileSystem, OpenFile
from shufflefs.client.ingest import DEFAULT_CONCURRENCY, Imported, Importer
from shufflefs.client.layout import Extent
from shufflefs.client.paths import current_umask
from shufflefs.cluster.config import find_client_config, load_client_config
from shufflefs.cluster.metrics_client import counted_reads, start_client_metrics
from shufflefs.cluster.routing import RoutingCache
from shufflefs.metadata.protocol import Attr
from shufflefs.rpc.client import open_rpc_client
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.heap import keep_freed_pages, uninitialized

T = TypeVar("T")

PathLike = str | bytes | os.PathLike[str]


def os_error(exc: FsError) -> OSError:
    """The OSError subclass Python itself would raise for this errno."""
    return OSError(exc.code, exc.message)


def to_stat(attr: Attr) -> os.stat_result:
    return os.stat_result(
        (
            attr["mode"],
            attr["ino"],
            0,
            attr["nlink"],
            attr["uid"],
            attr["gid"],
            attr["size"],
            attr["atime"] // 10**9,
            attr["mtime"] // 10**9,
            attr["ctime"] // 10**9,
            attr["atime"] / 1e9,
            attr["mtime"] / 1e9,
            attr["ctime"] / 1e9,
            attr["atime"],
            attr["mtime"],
            attr["ctime"],
        )
    )


def _flags(mode: str) -> int:
    kinds = set(mode) - {"b", "t"}
    plus = "+" in kinds
    kinds.discard("+")
    if len(kinds) != 1:
        raise ValueError(f"invalid mode: {mode!r}")
    kind = kinds.pop()
    table = {
        "r": os.O_RDWR if plus else os.O_RDONLY,
        "w": (os.O_RDWR if plus else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC,
        "a": (os.O_RDWR if plus else os.O_WRONLY) | os.O_CREAT | os.O_APPEND,
        "x": (os.O_RDWR if plus else os.O_WRONLY) | os.O_CREAT | os.O_EXCL,
    }
    if kind not in table:
        raise ValueError(f"invalid mode: {mode!r}")
    return table[kind]


def _close_at_exit(ref: weakref.ref[Client]) -> None:
    client = ref()
    if client is not None:
        client.close()


class Client:
    """A connection to one shufflefs cluster."""

    def __init__(
        self,
        config: str | os.PathLike[str] | None = None,
        options: ClientOptions | None = None,
        *,
        metrics: str | None = None,
    ) -> None:
        """*metrics*: serve Prometheus metrics of this client's reads and
        writes at host:port (port 0: any free one; off by default). A forked
        child serves its own on the same host, at any free port."""
        self.config_path = find_client_config(config)
        self.options = options or ClientOptions()
        self.metrics = metrics
        self.metrics_url: str | None = None
        self._pid = -1
        self._start_locks: dict[int, threading.Lock] = {}
        # a batch's buffer is fresh heap each call: without this the process
        # faults its pages in again on every read (a fifth of a batched 4 KiB
        # read's time here; rpc/heap.py)
        keep_freed_pages()
        self._start()
        if metrics:
            vars(self)["read_extents"] = counted_reads(self.read_extents)
        # at exit, before the interpreter stops daemon threads (and with them the
        # loop): close while the loop can still report lengths and end the session
        atexit.register(_close_at_exit, weakref.ref(self))

    def _start(self) -> None:
        config, secret = load_client_config(self.config_path)
        ready = threading.Event()
        failure: list[BaseException] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self.fs: FileSystem | None = None
        self._reader: BlockingReader | None = None

        async def main() -> None:
            try:
                async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
                    fs = FileSystem(rpc, RoutingCache(rpc, config.mgmtd), self.options)
                    await fs.start(nursery)
                    self.metrics_url = await start_client_metrics(
                        nursery,
                        fs,
                        self._metrics_address(),
                        rpc=rpc,
                        mgmtd=config.mgmtd,
                        kind="client",
                        reads=False,  # counted in read_extents, which may not reach read_into
                    )
                    self.fs = fs
                    self._reader = BlockingReader(fs.storage, secret)
                    self._stop = trio.Event()
                    self._token = trio.lowlevel.current_trio_token()
                    ready.set()
                    await self._stop.wait()
                    with trio.move_on_after(10):
                        await fs.close()
                    nursery.cancel_scope.cancel()
            except BaseException as exc:
                failure.append(exc)
                ready.set()

        self._thread = threading.Thread(
            target=trio.run, args=(main,), name="shufflefs-client", daemon=True
        )
        self._thread.start()
        ready.wait()
        self._pid = os.getpid()  # last: other threads see a started client only now
        if failure:
            exc = failure[0]
            raise os_error(exc) if isinstance(exc, FsError) else exc

    def _metrics_address(self) -> str | None:
        if self.metrics is None or self._pid in (-1, os.getpid()):
            return self.metrics
        return f"{self.metrics.rpartition(':')[0]}:0"  # a forked child: the parent has the port

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        self._after_fork()
        if self._token is None or not self._thread.is_alive():
            raise OSError(errno.ESHUTDOWN, "client is closed")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except FsError as exc:
            raise os_error(exc) from None

    def _after_fork(self) -> None:
        """In a forked child (a DataLoader worker) the loop thread did not come
        along: start a fresh one with its own connections. Files opened before
        the fork stay with the parent."""
        pid = os.getpid()
        if pid != self._pid:
            # one lock per process: a lock copied from the parent may be held forever
            with self._start_locks.setdefault(pid, threading.Lock()):
                if pid != self._pid:  # another thread of this child got here first
                    self._start()

    @property
    def _fs(self) -> FileSystem:
        # callers evaluate `self._fs.method` before `_run`: reconnect here too,
        # so the method is the child's, bound to the child's loop
        self._after_fork()
        if self.fs is None:
            raise OSError(errno.ESHUTDOWN, "client is closed")
        return self.fs

    def read_ranges(self, handle: OpenFile, ranges: list[tuple[int, int]]) -> bytearray:
        """(offset, length) reads of an open file, end to end, each clamped to
        the file's end."""
        fs = self._fs
        try:
            extents = fs.extents(handle, ranges)
        except FsError as exc:
            raise os_error(exc) from None
        # every byte of it is placed, zeros past a chunk's end included
        out = uninitialized(sum(e[3] for e in extents))
        if out:
            self.read_extents(extents, memoryview(out))
        return out

    def read_extents(self, extents: list[Extent], out: memoryview) -> None:
        """The native way into `FileSystem.read_into` (file API and data
        sampler alike): from this thread when it can (see `BlockingReader`),
        else through the async core, which waits for our own writes, fails
        over and retries."""
        fs = self._fs
        reader = self._reader
        # with writes in flight the async path must answer: it waits for them
        if reader is not None and not fs.writes_behind(extents) and reader.read_into(extents, out):
            return
        self._run(fs.read_into, extents, out)

    def close(self) -> None:
        """Close open files (their lengths reported) and the session."""
        if (
            self._token is not None
            and self._stop is not None
            and os.getpid() == self._pid
            and self._thread.is_alive()
        ):
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join(15)
        self._token = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- paths ---------------------------------------------------------------

    def stat(self, path: PathLike) -> os.stat_result:
        return to_stat(self._run(self._fs.resolve, os.fsencode(path), True))

    def lstat(self, path: PathLike) -> os.stat_result:
        return to_stat(self._run(self._fs.resolve, os.fsencode(path), False))

    def exists(self, path: PathLike) -> bool:
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    def isdir(self, path: PathLike) -> bool:
        try:
            return stat_mod.S_ISDIR(self.stat(path).st_mode)
        except FileNotFoundError:
            return False

    def listdir(self, path: PathLike = "/") -> list[str]:
        return [os.fsdecode(n) for n in self._run(self._fs.listdir, os.fsencode(path))]

    def walk(self, top: PathLike = "/") -> Iterator[tuple[str, list[str], list[str]]]:
        top_s = os.fsdecode(top)
        dirs: list[str] = []
        files: list[str] = []
        for name in self.listdir(top_s):
            full = f"{top_s.rstrip('/')}/{name}"
            (dirs if stat_mod.S_ISDIR(self.lstat(full).st_mode) else files).append(name)
        yield top_s, dirs, files
        for d in dirs:
            yield from self.walk(f"{top_s.rstrip('/')}/{d}")

    def mkdir(self, path: PathLike, mode: int = 0o777) -> None:
        async def op() -> None:
            parent, name = await self._fs.parent_of(os.fsencode(path))
            await self._fs.mkdir(parent, name, mode & ~current_umask(), os.getuid(), os.getgid())

        self._run(op)

    def makedirs(self, path: PathLike, mode: int = 0o777, exist_ok: bool = False) -> None:
        parts = [p for p in os.fsdecode(path).split("/") if p]
        for i in range(1, len(parts) + 1):
            sub = "/" + "/".join(parts[:i])
            try:
                self.mkdir(sub, mode)
            except FileExistsError:
                if i == len(parts) and not exist_ok:
                    raise
                if not self.isdir(sub):
                    raise NotADirectoryError(errno.ENOTDIR, f"{sub} is not a directory") from None

    def _parent_call(self, path: PathLike, fn: Callable[[int, bytes], Awaitable[T]]) -> T:
        async def op() -> T:
            parent, name = await self._fs.parent_of(os.fsencode(path))
            return await fn(parent, name)

        return self._run(op)

    def unlink(self, path: PathLike) -> None:
        self._parent_call(path, self._fs.unlink)

    remove = unlink

    def rmdir(self, path: PathLike) -> None:
        self._parent_call(path, self._fs.rmdir)

    def rename(self, src: PathLike, dst: PathLike) -> None:
        async def op() -> None:
            p1, n1 = await self._fs.parent_of(os.fsencode(src))
            p2, n2 = await self._fs.parent_of(os.fsencode(dst))
            await self._fs.rename(p1, n1, p2, n2, 0)

        self._run(op)

    def symlink(self, target: PathLike, path: PathLike) -> None:
        self._parent_call(
            path, lambda p, n: self._fs.symlink(p, n, os.fsencode(target), os.getuid(), os.getgid())
        )

    def readlink(self, path: PathLike) -> str:
        async def op() -> bytes:
            attr = await self._fs.resolve(os.fsencode(path), False)
            return await self._fs.readlink(attr["ino"])

        return os.fsdecode(self._run(op))

    def truncate(self, path: PathLike, size: int) -> None:
        async def op() -> None:
            attr = await self._fs.resolve(os.fsencode(path))
            await self._fs.setattr(attr["ino"], size=size)

        self._run(op)

    def chmod(self, path: PathLike, mode: int) -> None:
        async def op() -> None:
            attr = await self._fs.resolve(os.fsencode(path))
            await self._fs.setattr(attr["ino"], mode=stat_mod.S_IMODE(mode))

        self._run(op)

    # ---- files ----------------------------------------------------------------

    def open(self, path: PathLike, mode: str = "r", buffering: int = -1) -> Any:
        """Like the builtin open(): binary modes give a buffered binary file,
        text modes a TextIOWrapper; buffering=0 gives the raw `File`."""
        flags = _flags(mode)
        f, _ = self._run(self._fs.open_path, os.fsencode(path), flags, 0o666)
        raw = File(self, f, os.fsdecode(path), mode)
        if buffering == 0:
            if "b" not in mode:
                raise ValueError("can't have unbuffered text I/O")
            return raw
        size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
        buffered: io.BufferedIOBase
        if raw.readable() and raw.writable():
            buffered = io.BufferedRandom(raw, size)
        elif raw.writable():
            buffered = io.BufferedWriter(raw, size)
        else:
            buffered = io.BufferedReader(raw, size)
        return buffered if "b" in mode else io.TextIOWrapper(buffered)

    def read_bytes(self, path: PathLike) -> bytes:
        with self.open(path, "rb", buffering=0) as f:
            return bytes(f.readall())

    def write_bytes(self, path: PathLike, data: bytes | bytearray | memoryview) -> int:
        with self.open(path, "wb", buffering=0) as f:
            return int(f.write(data))

    def import_tree(
        self,
        source: PathLike,
        dest: PathLike,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        skip_existing: bool = False,
    ) -> Imported:
        """Copy local *source* (a directory's contents, or a file) to *dest*
        in the cluster, *concurrency* files in flight: `shufflefs import`
        (client/ingest.py). Files that fail are named in the result, not
        raised; a cluster that takes no more stops it (``stopped``)."""
        importer = Importer(self._fs, concurrency=concurrency, skip_existing=skip_existing)
        return self._run(importer.run, os.fspath(source), os.fsdecode(dest))

    def pread(self, path: PathLike, offset: int, length: int) -> bytes:
        """One positioned read, opening and closing the file around it."""
        with self.open(path, "rb", buffering=0) as f:
            return f.pread(offset, length)


class File(io.RawIOBase):
    """An open file on shufflefs (unbuffered)."""

    def __init__(self, client: Client, handle: OpenFile, name: str, mode: str) -> None:
        super().__init__()
        self._client = client
        self._handle = handle
        self.name = name
        self.mode = mode
        self._released = False

    def readable(self) -> bool:
        return self._handle.readable

    def writable(self) -> bool:
        return self._handle.writable

    def seekable(self) -> bool:
        return True

    def _size(self) -> int:
        return self._client._fs.known_size(self._handle.ino)

    def pread(self, offset: int, length: int) -> bytes:
        self._check_open()
        return bytes(self._client.read_ranges(self._handle, [(offset, length)]))

    def pread_batch(self, ranges: list[tuple[int, int]]) -> bytearray:
        """Many positioned reads in one call, grouped into one request per
        storage node: the bytes of every (offset, length), end to end (each
        clamped to the end of the file)."""
        self._check_open()
        return self._client.read_ranges(self._handle, ranges)

    def readinto(self, buffer: Any) -> int:
        self._check_open()
        if not self.readable():
            raise io.UnsupportedOperation("not readable")
        view = memoryview(buffer).cast("B")
        data = self._client.read_ranges(self._handle, [(self._handle.position, len(view))])
        n = len(data)
        view[:n] = data
        self._handle.position += n
        return n

    def write(self, data: Any) -> int:
        self._check_open()
        if not self.writable():
            raise io.UnsupportedOperation("not writable")
        if self._handle.flags & os.O_APPEND:
            self._handle.position = self._size()
        view = memoryview(data).cast("B")
        n = self._client._run(self._client._fs.write, self._handle.fh, self._handle.position, view)
        self._handle.position += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._handle.position + offset
        elif whence == io.SEEK_END:
            pos = self._size() + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise OSError(errno.EINVAL, "negative seek position")
        self._handle.position = pos
        return pos

    def tell(self) -> int:
        return self._handle.position

    def truncate(self, size: int | None = None) -> int:
        self._check_open()
        size = self._handle.position if size is None else size
        self._client._run(functools.partial(self._client._fs.setattr, self._handle.ino, size=size))
        return size

    def flush(self) -> None:
        if not self.closed and not self._released:
            self._client._run(self._client._fs.flush, self._handle.fh)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("shufflefs files have no OS file descriptor; use the mount")

    def close(self) -> None:
        if not self.closed and not self._released:
            self._released = True  # release flushes; RawIOBase.close() must not flush again
            try:
                if self._client._token is not None:  # else the client closed it already
                    self._client._run(self._client._fs.release, self._handle.fh)
            finally:
                super().close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")
