"""A listing's entries as READDIRPLUS carries them: ``struct fuse_direntplus``
records end to end, built once per page of the metadata server's listing and
handed to the kernel in slices (fuse/kept_listings.py).

Each record is what libfuse's ``fuse_add_direntry_plus`` writes for pyfuse3's
``EntryAttributes`` (`record`; tests/fuse/test_kept_listings.py compares the
two): a ``struct fuse_entry_out`` (node id, generation, the two timeouts, the
attributes) and a ``struct fuse_dirent`` (inode, the offset to resume at, the
name's length and type), then the name padded to 8 bytes. The timeouts are
written into a slice when it is handed out (`Records.stamp`), as they depend
on the records' age then. A record whose ``fuse_entry_out`` is all zeros
(node id 0: `Records.strip`) gives the kernel the name, inode number and
type only: it links no entry and caches no attributes.
"""

from __future__ import annotations

import bisect
import ctypes
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shufflefs.fuse.dir_handles import Offsets
from shufflefs.fuse.entry_attrs import BLOCK_SIZE
from shufflefs.fuse.prefetch_hints import Version, version_of
from shufflefs.metadata.protocol import Attr

# struct fuse_entry_out (nodeid, generation, entry_valid, attr_valid, their
# nsecs, struct fuse_attr), then struct fuse_dirent without its name
# (ino, off, namelen, type): FUSE_NAME_OFFSET_DIRENTPLUS bytes
DIRENTPLUS = struct.Struct("<QQQQIIQQQQQQIIIIIIIIIIQQII")
assert DIRENTPLUS.size == 152  # FUSE_NAME_OFFSET_DIRENTPLUS
# 64-bit words into a record: entry_valid, attr_valid, then both nsecs in one
ENTRY_VALID, ATTR_VALID, VALID_NSECS = 2, 3, 4
ENTRY_OUT_WORDS = 16  # struct fuse_entry_out: 128 bytes
NS = 1_000_000_000


def record(
    name: bytes, attr: Attr, cookie: int, entry_timeout: float, attr_timeout: float
) -> bytes:
    """*attr*'s entry named *name* as READDIRPLUS carries it, resuming after
    it at *cookie*."""
    ino, mode, size = attr["ino"], attr["mode"], attr["size"]
    at, mt, ct = attr["atime"], attr["mtime"], attr["ctime"]
    e_sec, e_nsec = timeout_parts(entry_timeout)
    a_sec, a_nsec = timeout_parts(attr_timeout)
    head = DIRENTPLUS.pack(
        ino, 0, e_sec, a_sec, e_nsec, a_nsec,
        ino, size, (size + 511) // 512, at // NS, mt // NS, ct // NS,
        at % NS, mt % NS, ct % NS, mode, attr["nlink"], attr["uid"], attr["gid"],
        attr["rdev"], BLOCK_SIZE, 0,
        ino, cookie, len(name), stat.S_IFMT(mode) >> 12,
    )  # fmt: skip
    return head + name + bytes(-len(name) % 8)


def dot_record(name: bytes, ino: int, cookie: int) -> bytes:
    """'.' or '..' (the kernel takes only the inode: fuse/dir_handles.py,
    `dot_entry`)."""
    zero = ("size", "atime", "mtime", "ctime", "uid", "gid", "rdev")
    attr = {**dict.fromkeys(zero, 0), "ino": ino, "mode": stat.S_IFDIR, "nlink": 1}
    return record(name, attr, cookie, 0.0, 0.0)  # type: ignore[arg-type]


def timeout_parts(seconds: float) -> tuple[int, int]:
    """libfuse's split of a timeout (calc_timeout_sec/nsec)."""
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


@dataclass(eq=False)
class Records:
    """Some of directory *ino*'s entries as records: with `lead` 2 a listing
    from its start ('.' and '..' are records 0 and 1, entry i record 2 + i),
    with `lead` 0 a later page of one (entry i is record i)."""

    ino: int
    read_at: float  # trio time of the (first) page's read
    offsets: Offsets
    records: bytearray
    starts: list[int]  # byte offset of each record, and the end
    resume: dict[int, int]  # an offset the kernel resumes at -> the record after it
    names: list[bytes]  # of entry i
    inos: list[int]
    versions: list[Version]
    parents: list[int]  # attr["parent"] of entry i (0 for a file)
    regular: list[bool]
    lead: int = 2
    with_attrs: bool = True  # else names only (`strip`)
    change: int = 0  # read-write: the directory's change counter when listed
    _address: int = 0
    _view: ctypes.Array[ctypes.c_char] | None = None
    _words: np.ndarray | None = None  # the records as 64-bit words
    _entry_words: np.ndarray | None = None  # word index of entry i's record

    def __post_init__(self) -> None:
        self._view = (ctypes.c_char * len(self.records)).from_buffer(self.records)
        self._address = ctypes.addressof(self._view)
        self._words = np.frombuffer(self.records, dtype="<u8")
        self._entry_words = np.array(self.starts[self.lead : -1], dtype=np.int64) // 8

    def __len__(self) -> int:
        return len(self.inos)

    @property
    def end(self) -> int:
        """Past the last record."""
        return len(self.starts) - 1

    def span(self, off: int, size: int) -> tuple[int, int] | None:
        """The records a READDIRPLUS at offset *off* of *size* bytes gets
        (first, past the last), or None for an offset not handed out here."""
        first = (off if self.lead else None) if off <= 2 else self.resume.get(off)
        return None if first is None else self.span_from(first, size)

    def span_from(self, first: int, size: int) -> tuple[int, int]:
        """From record *first*, as many as *size* bytes hold."""
        starts = self.starts
        last = bisect.bisect_right(starts, starts[first] + size, first) - 1
        return first, max(first, min(last, self.end))

    def entries(self, first: int, last: int) -> tuple[int, int]:
        """The entries among records *first*..*last*-1 (lo, hi)."""
        return max(first, self.lead) - self.lead, max(last, self.lead) - self.lead

    def stamp(self, lo: int, hi: int, entry_timeout: float, attr_timeout: float) -> None:
        """Write the kernel's timeouts into entries *lo*..*hi*-1."""
        assert self._words is not None and self._entry_words is not None
        if hi <= lo:
            return
        at = self._entry_words[lo:hi]
        e_sec, e_nsec = timeout_parts(entry_timeout)
        a_sec, a_nsec = timeout_parts(attr_timeout)
        words = self._words
        words[at + ENTRY_VALID] = e_sec
        words[at + ATTR_VALID] = a_sec
        words[at + VALID_NSECS] = e_nsec | (a_nsec << 32)

    def strip(self) -> None:
        """Names only from now on: every entry's ``fuse_entry_out`` zeroed."""
        assert self._words is not None and self._entry_words is not None
        if self.with_attrs and len(self):
            at = self._entry_words[:, None] + np.arange(ENTRY_OUT_WORDS)
            self._words[at.ravel()] = 0
        self.with_attrs = False

    def address(self, first: int) -> int:
        return self._address + self.starts[first]


def build(
    ino: int,
    parent: int | None,
    read_at: float,
    offsets: Offsets,
    entries: Sequence[tuple[bytes, Attr]],
) -> Records:
    """*entries* of directory *ino* read at *read_at*, as records (timeouts
    written when handed out); with a *parent*, a listing from its start
    ('.' and '..' first), else a later page of one."""
    parts = [] if parent is None else [dot_record(b".", ino, 1), dot_record(b"..", parent, 2)]
    starts, end = [0], 0
    for part in parts:
        end += len(part)
        starts.append(end)
    resume, lead = {}, len(parts)
    of = offsets.of
    for i, (name, attr) in enumerate(entries):
        cookie = of(name)
        part = record(name, attr, cookie, 0.0, 0.0)
        parts.append(part)
        end += len(part)
        starts.append(end)
        resume[cookie] = i + lead + 1
    return Records(
        ino,
        read_at,
        offsets,
        bytearray(b"".join(parts)),
        starts,
        resume,
        [name for name, _ in entries],
        [a["ino"] for _, a in entries],
        [version_of(a) for _, a in entries],
        [a["parent"] for _, a in entries],
        [stat.S_ISREG(a["mode"]) for _, a in entries],
        lead,
    )


def join(parts: Sequence[Records]) -> Records:
    """A listing's pages' records (the first from its start, each next one
    following the one before) as one listing, as old as the oldest."""
    head = parts[0]
    head.read_at = min(part.read_at for part in parts)
    if len(parts) == 1:
        return head
    starts: list[int] = []
    resume: dict[int, int] = {}
    names: list[bytes] = []
    inos: list[int] = []
    versions: list[Version] = []
    parents: list[int] = []
    regular: list[bool] = []
    base_bytes = base_records = 0
    for part in parts:
        starts.extend(s + base_bytes for s in part.starts[:-1])
        resume.update((cookie, i + base_records) for cookie, i in part.resume.items())
        names += part.names
        inos += part.inos
        versions += part.versions
        parents += part.parents
        regular += part.regular
        base_bytes += len(part.records)
        base_records += part.end
    starts.append(base_bytes)
    records = bytearray(b"".join(part.records for part in parts))
    return Records(
        head.ino, head.read_at, head.offsets, records, starts, resume,
        names, inos, versions, parents, regular, head.lead, head.with_attrs,
    )  # fmt: skip
