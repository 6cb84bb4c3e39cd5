"""A file's attributes as the kernel is given them (LOOKUP, GETATTR,
READDIRPLUS, CREATE replies)."""

from __future__ import annotations

import pyfuse3

from shufflefs.metadata.protocol import Attr

BLOCK_SIZE = 4096  # st_blksize: small, so buffered readers do not turn a 2 KiB read into 1 MiB


def entry_attributes(
    attr: Attr, entry_timeout: float, attr_timeout: float
) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = attr["ino"]
    e.generation = 0
    e.entry_timeout = entry_timeout
    e.attr_timeout = attr_timeout
    e.st_mode = attr["mode"]
    e.st_nlink = attr["nlink"]
    e.st_uid = attr["uid"]
    e.st_gid = attr["gid"]
    e.st_rdev = attr["rdev"]
    e.st_size = attr["size"]
    e.st_blksize = BLOCK_SIZE
    e.st_blocks = (attr["size"] + 511) // 512
    e.st_atime_ns = attr["atime"]
    e.st_mtime_ns = attr["mtime"]
    e.st_ctime_ns = attr["ctime"]
    return e


def no_longer_than(entry: pyfuse3.EntryAttributes, keep: float) -> pyfuse3.EntryAttributes:
    """*entry* kept by the kernel no longer than *keep* seconds (how long
    the name it answers is good)."""
    entry.entry_timeout = min(entry.entry_timeout, keep)
    entry.attr_timeout = min(entry.attr_timeout, keep)
    return entry
