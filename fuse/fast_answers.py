"""Requests the mount's caches answer, answered in libfuse's callback before
pyfuse3 sees them: OPEN, RELEASE, LOOKUP and GETATTR; OPENDIR when the mount
knows the directory (fuse/listings.py, `open_now`) and every RELEASEDIR (a
directory scanned from a listing the mount holds costs no task on pyfuse3's
loop at all: fuse/kept_listings.py); and WRITE when it goes
behind with no wait, and the GETXATTR of ``security.capability`` the kernel
sends before each of them, when its absence is known; FLUSH, a written
file's RELEASE and the SETATTR of a file open for writing (owner, mode,
times: set with its close) on ``-o writeback``.

A warm sample read through a read-write or ``-o ro`` mount costs the mount
its OPEN and its RELEASE (the kernel answers the READs from its page cache),
and on a read-write mount now and then a LOOKUP or GETATTR of a name whose
kernel entry expired (on ``cache=immutable``, where the kernel sends no OPEN
or RELEASE, the LOOKUPs of a cold epoch); none needs a round trip when the client's open cache
and cache watch answer it (client/open_cache.py, fuse/watched_entries.py).
Handled as pyfuse3 handles any request, each still cost a task of its own
on the trio loop: pyfuse3's callback, its coroutine, our handler, the
reply; measured on a ``-o ro`` mount read warm by four processes, that
machinery was five times the handlers' own work and the mount's one core
the limit.

So the trampolines in front of pyfuse3's callbacks (fuse/read_inode.py)
offer each such request here first, on the loop's thread, inside libfuse's
dispatch. `ShuffleOps.open_now`, `release_now`, `lookup_now` and
`getattr_now` answer it exactly as the handlers would when that takes no
wait (a read-only open the open cache trusts; the release of such a file
with nothing to flush and no handle to give back; a name or attributes the
watch keeps fresh): the same bookkeeping, then libfuse's reply. Anything
else (a miss, a revalidation, a write open, a dropped entry's last close)
is declined and goes through pyfuse3 as before. After an answer the
requests already waiting in the kernel's queue are taken the same way
(fuse/libfuse.py, `KernelQueue`).

Where libfuse's structures are read or written: a file info's handle at
`FH_OFFSET`, only once that offset was confirmed against pyfuse3's own
reading (`ReadInodes.confirm`); a reply's ``struct fuse_entry_param`` is
the one inside pyfuse3's ``EntryAttributes`` object, found at
`ENTRY_OFFSET` from the object's address, which `entry_layout_ok` checks
against known values before LOOKUP and GETATTR are answered here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import pyfuse3
import trio
from prometheus_client.metrics_core import Metric

from shufflefs.cluster.metrics_client import counts_family
from shufflefs.fuse.libfuse import FUSE_BUF_IS_FD, FuseBufvec, KernelQueue
from shufflefs.fuse.read_inode import BITS_OFFSET, DIRECT_IO_BIT, FH_OFFSET, KEEP_CACHE_BIT
from shufflefs.metadata.protocol import OwedAttrs

if TYPE_CHECKING:
    from shufflefs.fuse.ops import ShuffleOps
    from shufflefs.fuse.read_inode import ReadInodes

log = logging.getLogger("shufflefs.fuse.fast_answers")

# pyfuse3's EntryAttributes: PyObject_HEAD, then `struct fuse_entry_param`
# (ino, generation, struct stat, attr_timeout, entry_timeout); x86_64 sizes
ENTRY_OFFSET = 16
STAT_OFFSET = ENTRY_OFFSET + 16
STAT_SIZE = 144
# struct stat (x86_64): st_mode, st_uid, st_gid (u32); st_atim, st_mtim (s, ns)
MODE_AT, UID_AT, GID_AT, ATIME_AT, MTIME_AT = 24, 28, 32, 72, 88
# fuse_lowlevel.h: what a SETATTR sets
SET_MODE, SET_UID, SET_GID, SET_SIZE, SET_ATIME, SET_MTIME = 1, 2, 4, 8, 16, 32
SET_ATIME_NOW, SET_MTIME_NOW = 1 << 7, 1 << 8

P = ParamSpec("P")
T = TypeVar("T")


def entry_layout_ok() -> bool:
    """Does an EntryAttributes hold its fuse_entry_param where the replies
    here read it? (Checked with distinctive values: a build or platform that
    lays it out otherwise leaves LOOKUP and GETATTR to pyfuse3.)"""
    e = pyfuse3.EntryAttributes()
    e.st_ino = 0x0123456789AB
    e.generation = 0x5A5A5A
    e.st_size = 0x77777777
    e.attr_timeout = 12.5
    e.entry_timeout = 7.25
    base = id(e) + ENTRY_OFFSET
    u64 = ctypes.c_uint64.from_address
    f64 = ctypes.c_double.from_address
    e.st_mode, e.st_uid, e.st_gid = 0o100640, 0x1234, 0x5678
    e.st_atime_ns, e.st_mtime_ns = 1_234_567_891_234, 9_876_543_219_876
    u32 = ctypes.c_uint32.from_address
    at = STAT_OFFSET + id(e)
    return (
        (u32(at + MODE_AT).value, u32(at + UID_AT).value, u32(at + GID_AT).value)
        == (e.st_mode, e.st_uid, e.st_gid)
        and stat_time(at + ATIME_AT) == e.st_atime_ns
        and stat_time(at + MTIME_AT) == e.st_mtime_ns
        and u64(base).value == e.st_ino
        and u64(base + 8).value == e.generation
        and u64(STAT_OFFSET + id(e) + 8).value == e.st_ino  # struct stat's st_ino
        and u64(STAT_OFFSET + id(e) + 48).value == e.st_size
        and f64(STAT_OFFSET + id(e) + STAT_SIZE).value == e.attr_timeout
        and f64(STAT_OFFSET + id(e) + STAT_SIZE + 8).value == e.entry_timeout
    )


def stat_time(address: int) -> int:
    """A ``struct timespec`` at *address*, in ns."""
    i64 = ctypes.c_int64.from_address
    return i64(address).value * 1_000_000_000 + i64(address + 8).value


def setattr_request(attr: int, to_set: int) -> OwedAttrs:
    """What a SETATTR (but its size) sets, read as pyfuse3 reads it: its
    ``struct stat`` at *attr*, *to_set* its FUSE_SET_ATTR_* bits."""
    u32 = ctypes.c_uint32.from_address
    attrs = OwedAttrs()
    if to_set & SET_MODE:
        attrs["mode"] = stat.S_IMODE(u32(attr + MODE_AT).value)
    if to_set & SET_UID:
        attrs["uid"] = u32(attr + UID_AT).value
    if to_set & SET_GID:
        attrs["gid"] = u32(attr + GID_AT).value
    now = time.time_ns() if to_set & (SET_ATIME_NOW | SET_MTIME_NOW) else 0
    if to_set & SET_ATIME:
        attrs["atime"] = stat_time(attr + ATIME_AT)
    elif to_set & SET_ATIME_NOW:
        attrs["atime"] = now
    if to_set & SET_MTIME:
        attrs["mtime"] = stat_time(attr + MTIME_AT)
    elif to_set & SET_MTIME_NOW:
        attrs["mtime"] = now
    return attrs


@dataclass
class FastAnswerCounts:
    """Requests answered here, per operation (counted on the loop's thread,
    exported when scraped)."""

    open: int = 0
    release: int = 0
    lookup: int = 0
    absent: int = 0  # LOOKUPs of names a watched directory's names show absent
    getattr: int = 0
    write: int = 0  # gone behind (client/write_behind.py)
    flush: int = 0  # -o writeback: the release does the work, behind
    setattr: int = 0  # -o writeback: owner, mode, times of a file open for writing
    getxattr: int = 0  # security.capability before a write, known absent (ENODATA)
    ioctl: int = 0  # taken while draining the queue: libfuse answers them (ENOSYS)
    hint: int = 0  # prefetch hints by name, queued by a task of their own (fuse/fast_hints.py)
    listing: int = 0  # READDIRPLUS from a listing's records (fuse/kept_listings.py)
    opendir: int = 0
    releasedir: int = 0

    def collect(self) -> Iterable[Metric]:
        yield counts_family(
            "shufflefs_client_fast_answers",
            "Requests a mount's caches answered in libfuse's callback (fuse/fast_answers.py)",
            "op",
            self,
        )


class CallbackAnswers:
    """What answers requests in libfuse's callback works with: the
    operations, the trampolines' hooks, a nursery for what it answers later,
    the kernel's queue (drained behind what it takes) and its counts."""

    def __init__(
        self,
        ops: ShuffleOps,
        hooks: ReadInodes,
        nursery: trio.Nursery,
        queue: KernelQueue,
        counts: FastAnswerCounts,
    ) -> None:
        self.ops = ops
        self.nursery = nursery
        self.hooks = hooks
        self.queue = queue
        self.libfuse = queue.libfuse
        self.counts = counts


class FastAnswers(CallbackAnswers):
    _warned = False  # a failed answer was logged (once)

    def install(self) -> None:
        self.hooks.fast_open = self.open
        self.hooks.fast_release = self.release
        self.hooks.fast_write = self.write
        self.hooks.fast_flush = self.flush
        self.hooks.fast_getxattr = self.getxattr
        self.hooks.fast_opendir = self.opendir
        self.hooks.fast_releasedir = self.releasedir
        self.queue.on_inline = self._answered_by_libfuse
        if entry_layout_ok():
            self.hooks.fast_lookup = self.lookup
            self.hooks.fast_getattr = self.getattr
            self.hooks.fast_setattr = self.setattr
        else:
            log.warning("LOOKUP and GETATTR stay with pyfuse3: its EntryAttributes layout differs")

    def _answered_by_libfuse(self) -> None:
        self.counts.ioctl += 1

    def close(self) -> None:
        """Take no more requests (before the FUSE session closes)."""
        self.hooks.fast_open = self.hooks.fast_release = None
        self.hooks.fast_write = self.hooks.fast_flush = self.hooks.fast_getxattr = None
        self.hooks.fast_lookup = self.hooks.fast_getattr = self.hooks.fast_setattr = None
        self.hooks.fast_opendir = self.hooks.fast_releasedir = None

    def open(self, req: int, ino: int, fi: int) -> bool:
        """Answer an OPEN (True) or decline it (nothing done)."""
        flags = ctypes.c_int.from_address(fi).value
        info = self._try("OPEN", ino, self.ops.open_now, ino, flags)
        if info is None:
            return self._declined()
        bits = ctypes.c_uint32.from_address(fi + BITS_OFFSET)
        bits.value |= (KEEP_CACHE_BIT if info.keep_cache else 0) | (
            DIRECT_IO_BIT if info.direct_io else 0
        )
        ctypes.c_uint64.from_address(fi + FH_OFFSET).value = info.fh
        ret = self.libfuse.reply_open(req, fi)
        if ret:
            # the opener was interrupted meanwhile: the kernel will send no
            # RELEASE for a handle it never got
            log.debug("fuse_reply_open: %s", errno.errorcode.get(-ret, ret))
            if not self.ops.release_now(info.fh):
                self.nursery.start_soon(self._give_back, info.fh)
        return self._answered("open")

    def release(self, req: int, ino: int, fi: int) -> bool:
        """Answer a RELEASE (True) or decline it (nothing done)."""
        fh = ctypes.c_uint64.from_address(fi + FH_OFFSET).value
        if not self._try("RELEASE", ino, self.ops.release_now, fh):
            return self._declined()
        self.libfuse.reply_err(req, 0)
        return self._answered("release")

    def opendir(self, req: int, ino: int, fi: int) -> bool:
        """Answer an OPENDIR (True) or decline it (nothing done); its
        caching flags are in *fi* already (fuse/read_inode.py)."""
        fh = self._try("OPENDIR", ino, self.ops.listings.open_now, ino)
        if fh is None:
            return self._declined()
        ctypes.c_uint64.from_address(fi + FH_OFFSET).value = fh
        if self.libfuse.reply_open(req, fi):  # interrupted: no RELEASEDIR will come
            self.ops.listings.release(fh)
        return self._answered("opendir")

    def releasedir(self, req: int, ino: int, fi: int) -> bool:
        """Answer a RELEASEDIR (True)."""
        self.ops.listings.release(ctypes.c_uint64.from_address(fi + FH_OFFSET).value)
        self.libfuse.reply_err(req, 0)
        return self._answered("releasedir")

    def write(self, req: int, ino: int, bufv: int, off: int, fi: int) -> bool:
        """Answer a WRITE (True) or decline it (nothing done)."""
        vec = FuseBufvec.from_address(bufv)
        buf = vec.buf
        if vec.count != 1 or vec.idx or buf.flags & FUSE_BUF_IS_FD or not buf.mem:
            return self._declined()
        fh = ctypes.c_uint64.from_address(fi + FH_OFFSET).value
        data = ctypes.string_at(buf.mem + vec.off, buf.size - vec.off)  # (pyfuse3 copies too)
        n = self._try("WRITE", ino, self.ops.write_now, fh, off, data)
        if n is None:
            return self._declined()
        vec.off += n  # consumed (what libfuse asks of write_buf)
        self.libfuse.reply_write(req, n)
        return self._answered("write")

    def flush(self, req: int, ino: int, fi: int) -> bool:
        """Answer a FLUSH (True) or decline it (nothing done)."""
        if not self._try("FLUSH", ino, self.ops.flush_now):
            return self._declined()
        self.libfuse.reply_err(req, 0)
        return self._answered("flush")

    def lookup(self, req: int, parent: int, name: int) -> bool:
        """Answer a LOOKUP (True) or decline it (nothing done)."""
        entry = self._try("LOOKUP", parent, self.ops.lookup_now, parent, ctypes.string_at(name))
        if entry is None:
            return self._declined()
        self.libfuse.reply_entry(req, id(entry) + ENTRY_OFFSET)
        return self._answered("lookup" if entry.st_ino else "absent")

    def getattr(self, req: int, ino: int, fi: int) -> bool:
        """Answer a GETATTR (True) or decline it (nothing done)."""
        entry = self._try("GETATTR", ino, self.ops.getattr_now, ino)
        if entry is None:
            return self._declined()
        self.libfuse.reply_attr(req, id(entry) + STAT_OFFSET, entry.attr_timeout)
        return self._answered("getattr")

    def setattr(self, req: int, ino: int, attr: int, to_set: int) -> bool:
        """Answer a SETATTR (True) or decline it (nothing done)."""
        if not attr or to_set & SET_SIZE:
            return self._declined()
        attrs = setattr_request(attr, to_set)
        entry = self._try("SETATTR", ino, self.ops.setattr_now, ino, attrs)
        if entry is None:
            return self._declined()
        self.libfuse.reply_attr(req, id(entry) + STAT_OFFSET, entry.attr_timeout)
        return self._answered("setattr")

    def getxattr(self, req: int, ino: int, name: int) -> bool:
        """Answer a GETXATTR (True: ENODATA, an attribute known absent) or
        decline it (nothing done)."""
        if not self._try("GETXATTR", ino, self.ops.known_absent, ino, ctypes.string_at(name)):
            return self._declined()
        self.libfuse.reply_err(req, errno.ENODATA)
        return self._answered("getxattr")

    # ---- internals -------------------------------------------------------------

    def _try(
        self, what: str, ino: int, answer: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T | None:
        try:
            return answer(*args, **kwargs)
        except Exception:
            if not self._warned:
                self._warned = True
                log.exception("fast %s of inode %d failed: it goes the usual way", what, ino)
            return None

    def _answered(self, op: str) -> bool:
        setattr(self.counts, op, getattr(self.counts, op) + 1)
        self.queue.answered(True)
        return True

    def _declined(self) -> bool:
        self.queue.answered(False)
        return False

    async def _give_back(self, fh: int) -> None:
        with contextlib.suppress(pyfuse3.FUSEError):
            await self.ops.release(fh)
