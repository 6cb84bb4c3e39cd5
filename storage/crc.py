"""CRC-32C (Castagnoli) per fixed-size block of a chunk.

The data path uses ``google_crc32c`` (SSE4.2/ARMv8 instructions, ~12 GB/s);
``crcmod`` computes the same polynomial about 30x slower and is kept only as
the independent reference the tests check this module against.

``google_crc32c`` parses its argument as a read-only ``bytes`` object (``y#``):
a ``memoryview`` or ``bytearray`` is refused. Callers therefore hand over
``bytes``; `block_crcs` and `first_bad_block` take any buffer and copy one
block at a time only when the buffer is not already ``bytes``.

A chunk's checksums live in memory as an ``array('I')`` (native byte order,
4 bytes per block: a 1 MiB chunk of 4 KiB blocks costs 1 KiB, not the ~10 KiB
a tuple of ints would) and on disk and on the wire as 4-byte big-endian values.
"""

from __future__ import annotations

import sys
from array import array

import google_crc32c

Buf = bytes | bytearray | memoryview

CRC_TYPECODE = "I"
if array(CRC_TYPECODE).itemsize != 4:  # pragma: no cover - every Linux ABI has 4-byte int
    raise ImportError("array('I') is not 4 bytes on this platform")
_LITTLE = sys.byteorder == "little"

_zero_block_crc: dict[int, int] = {}


def crc32c(data: bytes) -> int:
    """CRC-32C of *data* (bytes only, see the module docstring)."""
    value: int = google_crc32c.value(data)
    return value


def zero_block_crc(block_size: int) -> int:
    """CRC of a block of zeros: gaps in sparse writes are checksummed without
    materializing them."""
    crc = _zero_block_crc.get(block_size)
    if crc is None:
        crc = _zero_block_crc[block_size] = crc32c(bytes(block_size))
    return crc


def _block(data: Buf, lo: int, hi: int) -> bytes:
    if isinstance(data, bytes):
        return data if lo == 0 and hi == len(data) else data[lo:hi]
    return bytes(memoryview(data)[lo:hi])


def block_crcs(data: Buf, block_size: int) -> array[int]:
    """One CRC per block of *data*; the last block may be partial."""
    out = array(CRC_TYPECODE)
    n = len(data)
    for lo in range(0, n, block_size):
        out.append(crc32c(_block(data, lo, min(lo + block_size, n))))
    return out


def first_bad_block(data: Buf, first_block: int, crcs: array[int], block_size: int) -> int:
    """Check *data*, which starts at block *first_block* of its chunk, against
    the chunk's checksums; return the index of the first block that does not
    match, or -1. The last block of *data* may be partial (the chunk's end)."""
    n = len(data)
    if n == 0:
        return -1
    if n <= block_size:  # the common small random read: one call, no copy for bytes
        return -1 if crc32c(_block(data, 0, n)) == crcs[first_block] else first_block
    index = first_block
    for lo in range(0, n, block_size):
        if crc32c(_block(data, lo, min(lo + block_size, n))) != crcs[index]:
            return index
        index += 1
    return -1


def crcs_to_bytes(crcs: array[int]) -> bytes:
    """Big-endian wire/disk form."""
    if not _LITTLE:  # pragma: no cover
        return crcs.tobytes()
    swapped = array(CRC_TYPECODE, crcs)
    swapped.byteswap()
    return swapped.tobytes()


def crcs_from_bytes(raw: Buf) -> array[int]:
    """Inverse of `crcs_to_bytes`; *raw* must be a multiple of 4 bytes long."""
    out = array(CRC_TYPECODE)
    out.frombytes(raw)
    if _LITTLE:
        out.byteswap()
    return out
