"""A file's attributes as the kernel is given them (LOOKUP, GETATTR,
READDIRPLUS, CREATE replies)."""

from __future__ import annotations

import stat

import pyfuse3

from shufflefs.metadata.protocol import Attr, OwedAttrs

BLOCK_SIZE = 4096  # st_blksize: small, so buffered readers do not turn a 2 KiB read into 1 MiB


def entry_attributes(
    attr: Attr, entry_timeout: float, attr_timeout: float, age: float = 0.0
) -> pyfuse3.EntryAttributes:
    """*age*: seconds since *attr* were read; the kernel keeps them that
    much less (the mode's bound on seeing a change made elsewhere runs from
    the read)."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = attr["ino"]
    e.generation = 0
    e.entry_timeout = max(0.0, entry_timeout - age) if age else entry_timeout
    e.attr_timeout = max(0.0, attr_timeout - age) if age else attr_timeout
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


def setattr_fields(entry: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields) -> OwedAttrs:
    """What a SETATTR sets, but the size (mode: its permission bits)."""
    attrs = OwedAttrs()
    if fields.update_mode:
        attrs["mode"] = stat.S_IMODE(entry.st_mode)
    if fields.update_uid:
        attrs["uid"] = entry.st_uid
    if fields.update_gid:
        attrs["gid"] = entry.st_gid
    if fields.update_atime:
        attrs["atime"] = entry.st_atime_ns
    if fields.update_mtime:
        attrs["mtime"] = entry.st_mtime_ns
    return attrs
