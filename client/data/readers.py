"""Reading many (file, offset, length) ranges into one buffer.

Two ways in, one interface:

* `LocalReader`: plain paths on any mounted filesystem (a local disk, the
  shufflefs FUSE mount, NFS...), one ``os.preadv`` per range straight into the
  destination rows. This is also the baseline the native way is measured
  against.
* `NativeReader`: ``shufflefs://`` URLs through the native client. Each file is
  opened once per process and its layout kept; a whole batch's ranges, over
  all its files, go out as ONE request per storage node, through the native
  client's one read path (`Client.read_extents`: from the calling thread
  when it can, else inside the client's trio loop).

`submit` runs a read on a small per-reader thread pool and returns a future;
that is how readahead keeps several batches in flight (for the native reader
each thread reads over its own blocking connections, or waits on the trio
loop when the async path must answer). Both readers are fork-safe and
picklable: file descriptors, open handles and threads belong to one process,
are dropped when pickled and re-created lazily in a process that finds them
missing or inherited.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from shufflefs.client.data.mount_hints import MountHints
from shufflefs.client.data.urls import client_for, is_url, parse_url
from shufflefs.client.fs import FileSystem
from shufflefs.client.layout import Extent
from shufflefs.client.native import Client
from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.client.data")

IntArray = npt.NDArray[np.int64]

# open files kept per process by a native reader (each is a handle in the
# metadata server's session table): enough for any token dataset, an LRU for
# one-file-per-sample collections
MAX_OPEN_FILES = 4096
MAX_PARALLEL_OPENS = 64


async def _noop() -> None:
    return None


class RangeReader:
    """Reads ``lengths[i]`` bytes at ``offsets[i]`` of file ``files[i]`` (an
    index into *paths*) into *out*, the ranges laid end to end."""

    hints: MountHints | None = None  # where reads are hinted to a shufflefs mount

    def __init__(self, paths: Sequence[str], threads: int = 4) -> None:
        self.paths = list(paths)
        self.threads = max(1, threads)
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None

    def read_into(
        self, files: IntArray, offsets: IntArray, lengths: IntArray, out: memoryview
    ) -> None:
        raise TypeError(f"{type(self).__name__} does not read")

    def submit(
        self, files: IntArray, offsets: IntArray, lengths: IntArray, out: memoryview
    ) -> Future[None]:
        """Start `read_into` in the background."""
        return self._executor().submit(self.read_into, files, offsets, lengths, out)

    def _executor(self) -> ThreadPoolExecutor:
        # a forked child inherits the pool object but not its threads
        if self._pool is None or self._pid != os.getpid():
            self._reset()
        assert self._pool is not None
        return self._pool

    def _reset(self) -> None:
        """Forget everything that belongs to another process."""
        self._pid = os.getpid()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shufflefs-read")

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_pid"] = -1
        return state


class LocalReader(RangeReader):
    """Plain positioned reads on paths of any mounted filesystem."""

    def __init__(
        self, paths: Sequence[str], threads: int = 4, hints: MountHints | None = None
    ) -> None:
        super().__init__(paths, threads)
        self.hints = hints
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()

    def _reset(self) -> None:
        # inherited descriptors stay valid after fork, but their owner closes
        # them: take our own
        self._fds = {}
        self._fd_lock = threading.Lock()
        super()._reset()

    def _fd(self, index: int) -> int:
        fd = self._fds.get(index)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(index)
                if fd is None:
                    fd = self._fds[index] = os.open(self.paths[index], os.O_RDONLY | os.O_CLOEXEC)
                    if self.hints is not None:
                        # the kernel then asks the mount for just the pages
                        # read, which the hinted ranges hold (no readahead
                        # window beyond them)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def read_into(
        self, files: IntArray, offsets: IntArray, lengths: IntArray, out: memoryview
    ) -> None:
        out = out.cast("B") if out.format != "B" else out
        if self._pid != os.getpid():
            self._reset()
        dst = 0
        for f, off, n in zip(files.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
            got = os.preadv(self._fd(f), [out[dst : dst + n]], off)
            while got < n:  # a short read (a signal, a network filesystem): go on
                more = os.preadv(self._fd(f), [out[dst + got : dst + n]], off + got)
                if more == 0:
                    raise OSError(
                        errno.EIO, f"{self.paths[f]}: {n} bytes expected at {off}, file shrank?"
                    )
                got += more
            dst += n

    def close(self) -> None:
        super().close()  # first: reads still running must not reopen what we close
        if self.hints is not None:
            self.hints.close()
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_fds"] = {}
        state["_fd_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fd_lock = threading.Lock()


class _NativeFiles:
    """The open files of one native reader in one process: (inode, layout)
    per file index, an LRU of at most MAX_OPEN_FILES handles."""

    def __init__(self, fs: FileSystem) -> None:
        self.fs = fs
        self.open: OrderedDict[int, tuple[int, int, Layout]] = OrderedDict()  # -> (fh, ino, layout)
        self.opening: dict[int, trio.Event] = {}  # opens in flight, shared by concurrent reads


class NativeReader(RangeReader):
    """``shufflefs://`` URLs read through the native client, a batch at a time
    with one request per storage node."""

    def __init__(
        self,
        paths: Sequence[str],
        config: str | None = None,
        threads: int = 4,
        layouts: Sequence[tuple[int, Layout] | None] | None = None,
    ) -> None:
        super().__init__(paths, threads)
        self.config = config
        # (inode, layout) per file when a listing gave them (`readdir_layouts`):
        # those files are read without being opened
        self.layouts = list(layouts) if layouts is not None else None
        self.fs_paths = [os.fsencode(parse_url(p).path) for p in paths]
        self._files: _NativeFiles | None = None

    def _reset(self) -> None:
        self._files = None  # the parent's handles are the parent's to release
        super()._reset()
        # Connect (or, in a forked child, reconnect) now, in this thread: the
        # client restarts its loop on first use after a fork, and that first
        # use must not come from several pool threads at once.
        self.client._run(_noop)

    @property
    def client(self) -> Client:
        return client_for(self.config)

    async def _layouts(self, indices: list[int]) -> dict[int, tuple[int, Layout]]:
        """(ino, layout) of the given files, opening those not open yet (at
        most MAX_PARALLEL_OPENS at a time) and closing the least recently
        used beyond MAX_OPEN_FILES. Runs in the client's trio loop."""
        client = self.client
        fs = client.fs
        if fs is None:
            raise FsError(errno.ESHUTDOWN, "client is closed")
        if self._files is None or self._files.fs is not fs:
            self._files = _NativeFiles(fs)  # first use here, or the client reconnected
        files = self._files
        table = files.open
        missing = [i for i in dict.fromkeys(indices) if i not in table]
        if missing:
            limit = trio.CapacityLimiter(MAX_PARALLEL_OPENS)

            async def open_one(i: int) -> None:
                event = files.opening.get(i)
                if event is not None:  # another read is opening it
                    await event.wait()
                    if i in table:
                        return
                event = files.opening[i] = trio.Event()
                try:
                    async with limit:
                        f, _ = await fs.open_path(self.fs_paths[i], os.O_RDONLY)
                    if f.layout is None:
                        await fs.release(f.fh)
                        raise FsError(errno.EISDIR, f"{self.paths[i]} is not a regular file")
                    table[i] = (f.fh, f.ino, f.layout)
                finally:
                    del files.opening[i]
                    event.set()

            async with trio.open_nursery() as nursery:
                for i in missing:
                    nursery.start_soon(open_one, i)
        out: dict[int, tuple[int, Layout]] = {}
        for i in indices:
            fh, ino, layout = table[i]
            table.move_to_end(i)
            out[i] = (ino, layout)
        wanted = set(indices)
        while len(table) > MAX_OPEN_FILES:
            i, (fh, _, _) = next(iter(table.items()))
            if i in wanted:
                break
            del table[i]
            try:
                await fs.release(fh)
            except FsError as exc:
                log.warning("closing %s: %s", self.paths[i], exc.message)
        return out

    def _listed_layouts(self, indices: list[int]) -> dict[int, tuple[int, Layout]] | None:
        """(ino, layout) of the given files from the dataset's listing, if
        it has all of them. (No handle: the files must not be removed while
        the dataset reads them, as for any file dataset.)"""
        known = self.layouts
        if known is None:
            return None
        out = {}
        for i in indices:
            entry = known[i]
            if entry is None:
                return None
            out[i] = entry
        return out

    def _open_layouts(self, indices: list[int]) -> dict[int, tuple[int, Layout]] | None:
        """(ino, layout) of the given files when every one is open already,
        read from the caller's thread: a warm batch makes no trip to the
        client's loop. None if any is missing (or was just evicted)."""
        files = self._files
        if files is None or files.fs is not self.client.fs:
            return None
        try:
            return {i: files.open[i][1:] for i in indices}
        except KeyError:
            return None

    def read_into(
        self, files: IntArray, offsets: IntArray, lengths: IntArray, out: memoryview
    ) -> None:
        out = out.cast("B") if out.format != "B" else out
        if self._pid != os.getpid():
            self._reset()
        client = self.client
        file_list = files.tolist()
        layouts = self._listed_layouts(file_list) or self._open_layouts(file_list)
        if layouts is None:  # some file not open yet: open it in the client's loop
            layouts = client._run(self._layouts, file_list)
        extents: list[Extent] = []
        for f, off, n in zip(file_list, offsets.tolist(), lengths.tolist(), strict=True):
            ino, layout = layouts[f]
            extents.append((ino, layout, off, n))
        client.read_extents(extents, out)  # the one read path, blocking fast path first

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True, cancel_futures=True)  # reads still running end first
        files, self._files = self._files, None
        if files is not None and self._pid == os.getpid() and files.fs is self.client.fs:

            async def release_all() -> None:
                for fh, _, _ in files.open.values():
                    try:
                        await files.fs.release(fh)
                    except FsError as exc:
                        log.warning("closing fh %d: %s", fh, exc.message)

            try:
                self.client._run(release_all)
            except OSError as exc:
                log.warning("closing dataset files: %s", exc)
        super().close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_files"] = None
        return state


def make_reader(
    paths: Sequence[str],
    config: str | None,
    threads: int,
    *,
    hints: MountHints | None = None,
    find_hints: bool = True,
    layouts: Sequence[tuple[int, Layout] | None] | None = None,
) -> RangeReader:
    """The reader for *paths*: all local paths, or all ``shufflefs://`` URLs.
    Local paths on a shufflefs mount are hinted to it (*hints*, else, with
    *find_hints*, those `MountHints.find` finds)."""
    kinds = {is_url(p) for p in paths}
    if len(kinds) > 1:
        raise ValueError("a dataset's paths must be all local paths or all shufflefs:// URLs")
    if kinds == {True}:
        return NativeReader(paths, config, threads, layouts)
    if hints is None and find_hints:
        hints = MountHints.find(paths)
    return LocalReader(paths, threads, hints)
