"""Bytes written straight into the reply pyfuse3 sends for a READDIRPLUS.

pyfuse3 gives a readdir handler a ``ReaddirToken`` and builds the reply one
entry per `pyfuse3.readdir_reply` call (an ``EntryAttributes`` each, libfuse's
``fuse_add_direntry_plus``), then sends what the token's buffer holds. A
listing whose records the mount has already built (fuse/direntplus.py) is
copied into that buffer in one piece instead (`TokenWriter.write`): the token
is a Cython object whose fields (``req``, ``buf_start``, ``buf``, ``size``:
handlers.pxi) follow the object's header, read and written here at
`FIELDS_OFFSET` once `layout_ok` has checked that offset against what
``readdir_reply`` itself does to a token. The buffer is allocated as
``readdir_reply`` allocates it (``calloc`` of the request's size) and freed
by pyfuse3 after the reply, as always.
"""

from __future__ import annotations

import ctypes
import logging

import pyfuse3

log = logging.getLogger("shufflefs.fuse")

FIELDS_OFFSET = 16  # PyObject_HEAD; then req, buf_start, buf, size (8 bytes each)
REQ, BUF_START, BUF, SIZE = 0, 8, 16, 24

_libc = ctypes.CDLL(None)
_calloc = _libc.calloc
_calloc.restype = ctypes.c_void_p
_calloc.argtypes = (ctypes.c_size_t, ctypes.c_size_t)
_free = _libc.free
_free.restype = None
_free.argtypes = (ctypes.c_void_p,)


def _field(token: pyfuse3.ReaddirToken, at: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(id(token) + FIELDS_OFFSET + at)


def room(token: pyfuse3.ReaddirToken) -> int:
    """Bytes the reply has left."""
    return _field(token, SIZE).value


def write(token: pyfuse3.ReaddirToken, address: int, nbytes: int) -> None:
    """Append *nbytes* at *address* to the reply (they must fit: `room`)."""
    size = _field(token, SIZE)
    if nbytes > size.value:
        raise ValueError(f"{nbytes} bytes do not fit in the {size.value} left")
    if nbytes <= 0:
        return
    start, buf = _field(token, BUF_START), _field(token, BUF)
    if not start.value:
        start.value = buf.value = _calloc(size.value, 1) or 0
        if not start.value:
            raise MemoryError("calloc")
    ctypes.memmove(buf.value, address, nbytes)
    buf.value += nbytes
    size.value -= nbytes


def layout_ok() -> bool:
    """Does a ReaddirToken hold its fields where `write` expects them?
    (Checked by watching `pyfuse3.readdir_reply` fill one: a build that lays
    it out otherwise keeps the reply entry by entry.)"""
    token = pyfuse3.ReaddirToken()
    if type(token).__basicsize__ != FIELDS_OFFSET + 32:
        return False
    entry = pyfuse3.EntryAttributes()
    entry.st_ino, entry.st_mode = 42, 0o100644
    start, buf, size = (_field(token, at) for at in (BUF_START, BUF, SIZE))
    if start.value or buf.value or size.value:
        return False
    size.value = 4096
    try:
        if not pyfuse3.readdir_reply(token, b"probe", entry, 7):
            return False
        written = buf.value - start.value
        # a record: 152 bytes, the name, padding to 8 bytes
        return bool(start.value) and written == 160 and size.value == 4096 - written
    finally:
        if start.value:
            _free(start.value)
        start.value = buf.value = size.value = 0
