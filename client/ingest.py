"""Copy a local directory tree into the cluster with many files in flight:
what `shufflefs import` runs (docs/operations.md, "Ingesting a dataset").

A dataset of one file per sample written through a mount pays, per file,
the kernel's LOOKUP, CREATE, WRITE, FLUSH and RELEASE, each through the
mount's loop, and every writer process waits for its own file's create,
chain write and length report before the next one: one process loop of
`open`/`write`/`close` makes a hundred or two files a second. Here one
process keeps ``concurrency`` files in flight through the client's own
calls (`FileSystem.create`, `write`, `release`): their creates share the
metadata server's group commits, their chain writes share each target's
flushes and record commits, and their length reports go together
(`Closes`, the close behind's linger); there is no FUSE round trip at all.

What lands, per source entry (the tree is walked depth first, in name
order): a directory is made (its permission bits kept; one that is there
already is used as it is); a regular file is created with its permission
bits and written whole, then closed, so it shows its full length only
once every byte is on every replica; a symbolic link is made with the same
target; anything else (a FIFO, a socket, a device) is left out and named.
New entries belong to the importing user, as with ``cp -r``; times are not
kept. With *skip_existing*, a regular file already at its destination
with the size of its source is left alone: a run that stopped (an error,
a ^C, a lost machine) is finished by running it again.

A file that cannot be read here or written there is named and skipped,
and the rest goes on; a cluster that takes nothing more (full, read-only,
gone for longer than the client's retries) stops the whole import.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import trio

from shufflefs.client.fs import FileSystem
from shufflefs.metadata.protocol import ROOT_INODE, Attr
from shufflefs.rpc.errors import FsError, first_fs_error

PIECE = 4 << 20  # bytes read and written at a time (a file bigger than this streams)
INLINE_READ_MAX = 1 << 20  # a file up to this size is read on the event loop if cached...
# ...and on one of these (a disk or memory of this machine: no server to wait for)
LOCAL_FSTYPES = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "tmpfs", "ramfs", "overlay"}
)
# files in flight (`shufflefs import --concurrency`): many, so that their chain
# writes fill big `write_many` frames (3 replicas, 110 KB files: 593 files/s at
# 64, 733 at 128, 774 at 256 in one run: docs/storage.md, "Batched writes")
DEFAULT_CONCURRENCY = 256
# ...holding at most this many bytes of their contents at once (a file's size,
# at most a PIECE): 64 big files' worth
BYTES_IN_FLIGHT = 64 * PIECE
READDIR_PAGE = 1024
MAX_NAMED = 1000  # problems kept to report (the rest are counted)
# the cluster takes nothing more: stop rather than fail every file the same way
STOPPING = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ESHUTDOWN, errno.ENOTCONN})
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


@dataclass
class Imported:
    """What an import did (`as_json` for scripts)."""

    files: int = 0
    bytes: int = 0
    dirs: int = 0
    links: int = 0
    skipped: int = 0  # already there (a file of the same size, a name for a link)
    left_out: list[str] = field(default_factory=list)  # neither file, directory nor link
    errors: list[str] = field(default_factory=list)
    unnamed: int = 0  # problems beyond MAX_NAMED, counted only
    stopped: str | None = None  # why the import stopped early

    def problem(self, into: list[str], text: str) -> None:
        if len(self.left_out) + len(self.errors) < MAX_NAMED:
            into.append(text)
        else:
            self.unnamed += 1

    @property
    def failed(self) -> bool:
        return bool(self.errors) or self.stopped is not None or self.unnamed > 0

    def as_json(self, seconds: float) -> dict[str, Any]:
        return {
            "files": self.files,
            "bytes": self.bytes,
            "dirs": self.dirs,
            "links": self.links,
            "skipped": self.skipped,
            "left_out": self.left_out,
            "errors": self.errors,
            "unnamed_problems": self.unnamed,
            "stopped": self.stopped,
            "seconds": round(seconds, 3),
            "files_per_second": round(self.files / seconds, 1) if seconds > 0 else None,
            "bytes_per_second": round(self.bytes / seconds) if seconds > 0 else None,
        }


class Held(NamedTuple):
    """What a destination directory holds under a name (small: a listing
    of a directory of a million samples is kept whole)."""

    ino: int
    mode: int
    size: int

    @classmethod
    def of(cls, attr: Attr) -> Held:
        return cls(attr["ino"], attr["mode"], attr["size"])


Listing = dict[bytes, Held]


@dataclass(frozen=True)
class _Entry:
    name: bytes
    mode: int  # st_mode, not following a link
    size: int
    target: bytes | None  # a link's
    dev: int  # st_dev: the filesystem it is on


def _entry(path: bytes, name: bytes, st: os.stat_result) -> _Entry:
    """Local *path* (not followed), to be copied as *name*."""
    target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    return _Entry(name, st.st_mode, st.st_size, target, st.st_dev)


def local_devices(mountinfo: str = "/proc/self/mountinfo") -> frozenset[int]:
    """The devices (``st_dev``) of this machine's mounts of a filesystem
    in `LOCAL_FSTYPES`. Only their files are opened on the event loop
    (`_read_cached`): an open on NFS, SMB or a FUSE mount (another cluster's
    included) may wait on a server, and the loop keeps the client's session
    alive. A mount made during the import is not listed, so its files go
    to the worker thread."""
    try:
        with open(mountinfo) as f:
            lines = f.readlines()
    except OSError:
        return frozenset()  # every read goes to the worker thread
    out: set[int] = set()
    for line in lines:
        fields = line.split()
        try:
            major, minor = fields[2].split(":")
            fstype = fields[fields.index("-") + 1]
        except (IndexError, ValueError):
            continue
        if fstype in LOCAL_FSTYPES:
            out.add(os.makedev(int(major), int(minor)))
    return frozenset(out)


def _scan(path: bytes) -> list[_Entry]:
    """(worker thread) The entries of local directory *path*, in name order."""
    with os.scandir(path) as it:
        out = [_entry(e.path, e.name, e.stat(follow_symlinks=False)) for e in it]
    out.sort(key=lambda e: e.name)
    return out


def _read(path: bytes, offset: int, length: int) -> bytes:
    """(worker thread) Up to *length* bytes of local file *path* from *offset*."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _read_cached(path: bytes, length: int) -> bytearray | None:
    """The first *length* bytes of local file *path* (that many: the caller
    knows its size) if the page cache holds them all, else None. Never
    waits for the disk (``RWF_NOWAIT``), so it runs on the event loop: a
    source read a moment ago, or written before the import, is most of
    what an import copies, and the worker thread's hand-off both ways costs
    more than the copy (a third of the import's CPU, 110 KB files)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None  # (the worker thread's read names the error)
    buf = bytearray(length)
    try:
        got = os.preadv(fd, [buf], 0, os.RWF_NOWAIT)
    except OSError:  # EAGAIN: not all cached; EOPNOTSUPP: a filesystem without it
        return None
    finally:
        os.close(fd)
    return buf if got == length else None


class ByteBudget:
    """At most *limit* bytes held at once, in any amounts (one bigger than
    the limit is granted the whole limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lot = trio.lowlevel.ParkingLot()

    async def acquire(self, n: int) -> int:
        """Wait until *n* bytes fit; returns what was granted (for `release`)."""
        n = min(n, self.limit)
        await trio.lowlevel.checkpoint_if_cancelled()
        while self.held + n > self.limit:
            await self._lot.park()
        self.held += n
        return n

    def release(self, n: int) -> None:
        self.held -= n
        self._lot.unpark_all()


class Importer:
    """One import: a walk of the source that keeps *concurrency* files in
    flight (`run`); *progress(files, nbytes)* is told of each file done."""

    def __init__(
        self,
        fs: FileSystem,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        skip_existing: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.fs = fs
        self.skip_existing = skip_existing
        self.progress = progress
        self.done = Imported()
        self._limit = trio.Semaphore(max(1, concurrency))
        self._bytes = ByteBudget(BYTES_IN_FLIGHT)
        self._uid = os.getuid()
        self._gid = os.getgid()
        self._local_devices = local_devices()
        self._nursery: trio.Nursery | None = None

    async def run(self, source: str | bytes, dest: str) -> Imported:
        """Copy *source* (a directory: its contents go into *dest*, made with
        its missing parents if need be; a file: to *dest*, or into it if
        *dest* is a directory) into the cluster."""
        src = os.fsencode(source)
        st = os.lstat(src)  # OSError: the caller's to report (a usage error)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if stat.S_ISDIR(st.st_mode):
                    ino, existing = await self._dest_dir(os.fsencode(dest), st.st_mode)
                    await self._copy_dir(src, ino, existing)
                elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    parent, name = await self._dest_file(os.fsencode(dest), os.path.basename(src))
                    existing = await self._held(parent, name) if self.skip_existing else None
                    await self._copy_entry(src, parent, existing, _entry(src, name, st))
                else:
                    self.done.problem(self.done.left_out, f"{os.fsdecode(src)}: not a regular file")
        except* FsError as group:
            exc = first_fs_error(group)
            if exc.code not in STOPPING:
                raise exc from None
            self.done.stopped = f"{exc.message} (errno {exc.code})"
        return self.done

    # ---- the destination ----------------------------------------------------

    async def _dest_dir(self, dest: bytes, mode: int) -> tuple[int, Listing | None]:
        """The inode of directory *dest* (made, with its missing parents) and,
        if it was there and *skip_existing*, what it holds."""
        ino = ROOT_INODE
        made = False
        for part in [p for p in dest.split(b"/") if p]:
            try:
                attr = await self.fs.lookup(ino, part)
            except FsError as exc:
                if exc.code != errno.ENOENT:
                    raise
                attr = await self.fs.mkdir(ino, part, stat.S_IMODE(mode), self._uid, self._gid)
                self.done.dirs += 1
                made = True
            else:
                made = False
            if not stat.S_ISDIR(attr["mode"]):
                raise FsError(
                    errno.ENOTDIR, f"{os.fsdecode(dest)}: {os.fsdecode(part)} is not a directory"
                )
            ino = attr["ino"]
        return ino, (await self._listing(ino) if self.skip_existing and not made else None)

    async def _dest_file(self, dest: bytes, name: bytes) -> tuple[int, bytes]:
        """Where a single file goes: into *dest* if it is a directory, else
        at *dest* (whose parent must exist)."""
        try:
            attr = await self.fs.resolve(dest)
        except FsError as exc:
            if exc.code != errno.ENOENT:
                raise
        else:
            if stat.S_ISDIR(attr["mode"]):
                return attr["ino"], name
        try:
            return await self.fs.parent_of(dest)
        except FsError as exc:
            if exc.code != errno.ENOENT:
                raise
            raise FsError(
                errno.ENOENT, f"{os.fsdecode(dest)}: no such directory to put it in"
            ) from None

    async def _held(self, parent: int, name: bytes) -> Listing:
        """What directory *parent* holds under *name* alone (a listing of one)."""
        try:
            attr = await self.fs.lookup(parent, name)
        except FsError as exc:
            if exc.code != errno.ENOENT:
                raise
            return {}
        return {name: Held.of(attr)}

    async def _listing(self, ino: int) -> Listing:
        """Every entry of directory *ino*, by name."""
        out: Listing = {}
        after: bytes | None = None
        while True:
            page = await self.fs.readdir(ino, after, READDIR_PAGE)
            for name, attr in page["entries"]:
                out[name] = Held.of(attr)
            if not page["more"] or not page["entries"]:
                return out
            after = page["entries"][-1][0]

    # ---- the walk -----------------------------------------------------------

    async def _copy_dir(self, src: bytes, ino: int, existing: Listing | None) -> None:
        try:
            entries = await trio.to_thread.run_sync(_scan, src)
        except OSError as exc:
            self.done.problem(self.done.errors, f"{os.fsdecode(src)}: {exc.strerror or exc}")
            return
        for entry in entries:
            path = src + b"/" + entry.name
            if stat.S_ISDIR(entry.mode):
                sub = await self._make_dir(path, ino, entry, existing)
                if sub is not None:
                    await self._copy_dir(path, *sub)
            else:
                await self._copy_entry(path, ino, existing, entry)

    async def _make_dir(
        self, path: bytes, parent: int, entry: _Entry, existing: Listing | None
    ) -> tuple[int, Listing | None] | None:
        """The destination directory of *entry* (made here, or the one there),
        and what it holds if it was there and *skip_existing*; None if there
        is none (named as an error: its contents are left out)."""
        try:
            attr = await self.fs.mkdir(
                parent, entry.name, stat.S_IMODE(entry.mode), self._uid, self._gid
            )
            self.done.dirs += 1
            return attr["ino"], ({} if self.skip_existing else None)
        except FsError as exc:
            if exc.code in STOPPING:
                raise
            if exc.code != errno.EEXIST:
                self.done.problem(self.done.errors, f"{os.fsdecode(path)}: {exc.message}")
                return None
        held = (existing or {}).get(entry.name)
        if held is None:
            attr = await self.fs.lookup(parent, entry.name)
            held = Held.of(attr)
        if not stat.S_ISDIR(held.mode):
            self.done.problem(
                self.done.errors, f"{os.fsdecode(path)}: not a directory in the cluster; left out"
            )
            return None
        return held.ino, (await self._listing(held.ino) if self.skip_existing else None)

    async def _copy_entry(
        self, path: bytes, parent: int, existing: Listing | None, entry: _Entry
    ) -> None:
        if stat.S_ISREG(entry.mode):
            there = existing.get(entry.name) if existing is not None else None
            if there is not None and stat.S_ISREG(there.mode) and there.size == entry.size:
                self.done.skipped += 1
                return
            await self._limit.acquire()  # the walk waits here while the files fill the window
            try:
                held = await self._bytes.acquire(min(entry.size, PIECE))
            except BaseException:
                self._limit.release()
                raise
            assert self._nursery is not None
            self._nursery.start_soon(self._copy_file, path, parent, entry, held)
        elif stat.S_ISLNK(entry.mode):
            await self._copy_link(path, parent, existing, entry)
        else:
            self.done.problem(
                self.done.left_out, f"{os.fsdecode(path)}: not a regular file, directory or link"
            )

    async def _copy_link(
        self, path: bytes, parent: int, existing: Listing | None, entry: _Entry
    ) -> None:
        assert entry.target is not None
        if existing is not None and entry.name in existing:
            self.done.skipped += 1
            return
        try:
            try:
                await self.fs.symlink(parent, entry.name, entry.target, self._uid, self._gid)
            except FsError as exc:
                if exc.code != errno.EEXIST or not await self._same_link(parent, entry):
                    raise
                self.done.skipped += 1  # (an import run again)
            else:
                self.done.links += 1
        except FsError as exc:
            if exc.code in STOPPING:
                raise
            self.done.problem(self.done.errors, f"{os.fsdecode(path)}: {exc.message}")

    async def _same_link(self, parent: int, entry: _Entry) -> bool:
        """Is the entry at *entry*'s name a link to the same target?"""
        attr = await self.fs.lookup(parent, entry.name)
        return stat.S_ISLNK(attr["mode"]) and await self.fs.readlink(attr["ino"]) == entry.target

    async def _copy_file(self, path: bytes, parent: int, entry: _Entry, held: int) -> None:
        try:
            first: bytes | bytearray | None = None
            if 0 < entry.size <= INLINE_READ_MAX and entry.dev in self._local_devices:
                first = _read_cached(path, entry.size)
            if first is None:
                first = await trio.to_thread.run_sync(_read, path, 0, min(entry.size, PIECE))
            f, _ = await self.fs.create(
                parent,
                entry.name,
                stat.S_IMODE(entry.mode),
                CREATE_FLAGS,
                self._uid,
                self._gid,
                together=True,  # the files in flight: their creates in one call
            )
            written = 0
            try:
                data = first
                while data:
                    await self.fs.write(f.fh, written, data, owned=True)  # (read for it alone)
                    written += len(data)
                    if written >= entry.size:
                        break  # (a file that grew meanwhile: copied as it was listed)
                    data = await trio.to_thread.run_sync(_read, path, written, PIECE)
            finally:
                # every write acknowledged by every replica, then the length
                # reported with the closes that overlap it; raises a failed write
                await self.fs.release(f.fh, behind=True)
        except FsError as exc:
            if exc.code in STOPPING:
                raise
            self.done.problem(self.done.errors, f"{os.fsdecode(path)}: {exc.message}")
        except OSError as exc:  # reading the source
            self.done.problem(self.done.errors, f"{os.fsdecode(path)}: {exc.strerror or exc}")
        else:
            self.done.files += 1
            self.done.bytes += written
            if self.progress is not None:
                self.progress(1, written)
        finally:
            self._bytes.release(held)
            self._limit.release()
