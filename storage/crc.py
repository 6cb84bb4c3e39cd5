"""CRC-32C (Castagnoli) per fixed-size block of a chunk.

The data path uses ``google_crc32c`` (SSE4.2/ARMv8 instructions, ~12 GB/s);
``crcmod`` computes the same polynomial about 30x slower and is kept only as
the independent reference the tests check this module against.

``google_crc32c`` parses its argument as a read-only ``bytes`` object (``y#``):
a ``memoryview`` or ``bytearray`` is refused. Callers therefore hand over
``bytes``; `block_crcs` and `first_bad_block` take any buffer and copy one
block at a time only when the buffer is not already ``bytes``. A span of
`IN_PLACE_MIN` bytes or more of a writable buffer (a read's bytes, 128 KiB
and up) is checked where it lies instead: by ``crc32c_extend`` of the very C
library ``google_crc32c`` runs on (found among this process's mappings),
through ``ctypes``. Its call costs about a microsecond more than
``google_crc32c``'s, the copy it saves (a new ``bytes``, then a ``memmove``)
grows with the span: 9% of a storage daemon's CPU serving 128 KiB reads.

A chunk's checksums live in memory as an ``array('I')`` (native byte order,
4 bytes per block: a 1 MiB chunk of 4 KiB blocks costs 1 KiB, not the ~10 KiB
a tuple of ints would) and on disk and on the wire as 4-byte big-endian values.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import weakref
from array import array
from collections.abc import Callable

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
    if lo == 0 and hi == len(data):
        return data if isinstance(data, bytes) else bytes(data)
    if isinstance(data, bytes):
        return data[lo:hi]
    return bytes(memoryview(data)[lo:hi])


IN_PLACE_MIN = 32 << 10  # smaller spans: the copy costs less than the ctypes call


def _library_extend() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, pointer, length)`` of the library that
    ``google_crc32c``'s extension is linked to; None if it is not found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcrc32c" in line})
    except OSError:
        return None
    for path in paths:
        if not os.path.basename(path).startswith("libcrc32c"):
            continue
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        probe = bytearray(b"123456789")
        if fn(0, ctypes.addressof(ctypes.c_char.from_buffer(probe)), 9) != 0xE3069283:
            continue  # not the CRC-32C we know: keep to google_crc32c
        return fn
    return None


_extend = _library_extend()


def _crc_span(data: Buf, lo: int, hi: int) -> int:
    """CRC-32C of ``data[lo:hi]``, in place when that spares a big copy."""
    n = hi - lo
    if n >= IN_PLACE_MIN and _extend is not None and not isinstance(data, bytes):
        try:
            span = (ctypes.c_char * n).from_buffer(data, lo)
        except (TypeError, ValueError):  # read-only or not contiguous: copied below
            pass
        else:
            return _extend(0, ctypes.addressof(span), n)
    return crc32c(_block(data, lo, hi))


def block_crcs(data: Buf, block_size: int) -> array[int]:
    """One CRC per block of *data*; the last block may be partial. (One
    view, sliced and copied per block in a comprehension: half the time of
    a loop over `_block`, 14 µs for a 110 KB sample file's 27 blocks.)"""
    view = memoryview(data).cast("B")
    value = google_crc32c.value
    return array(
        CRC_TYPECODE,
        [value(bytes(view[lo : lo + block_size])) for lo in range(0, len(view), block_size)],
    )


# ---- the CRC of a run of blocks, from the blocks' CRCs ----------------------
#
# CRC-32C is linear: crc(A + B) = Z_len(B)(crc(A)) ^ crc(B), where Z_n is what
# n zero bytes do to the CRC register (a 32x32 bit matrix over GF(2), the same
# for every A). So the stored CRCs of k whole blocks combine into the CRC of
# the k blocks together, and a read of many blocks is verified with ONE
# hardware CRC over its bytes plus a cheap fold of the stored CRCs, instead of
# one call (and one copy: google_crc32c takes bytes only) per block. It is
# still a CRC-32C check against the stored per-block checksums; on a
# mismatch the blocks are checked one by one to name the damaged one.
#
# The fold is kept per chunk as prefix CRCs, P[k] = the CRC of blocks 0..k-1
# (P[0] = 0), so any run of blocks is one step: crc(blocks a..b-1) =
# P[b] ^ Z_(b-a) blocks(P[a]), by the same linearity, with Z_n applied as the
# product of the Z_(2^i blocks) of n's bits (four table lookups each). Folding
# the stored CRCs of a run anew (one step a block, in Python) was 11 µs for a
# 128 KiB read of 4 KiB blocks, more than the hardware CRC of its bytes (7 µs):
# a storage daemon serving random reads of a chunk pays it once per chunk now.
# Prefixes live as long as the checksum array they fold (a record's, which an
# update replaces, never changes), within `MAX_PREFIX_BLOCKS` and `MAX_PREFIXES`.

_POLY = 0x82F63B78  # CRC-32C, reflected
MAX_PREFIX_BLOCKS = 1 << 22  # prefix CRCs kept at once (16 MiB), then start over...
MAX_PREFIXES = 1 << 16  # ...or arrays of them (a sample file's record each)
Tables = tuple[list[int], list[int], list[int], list[int]]
_shift_tables: dict[int, list[Tables]] = {}  # per block size: Z_(2^i blocks), i = 0, 1, ...
_prefixes: dict[int, tuple[weakref.ref[array[int]], array[int]]] = {}  # id(crcs) ->
_prefix_blocks = 0
_building = threading.Lock()


def _byte_table() -> list[int]:
    table = []
    for b in range(256):
        r = b
        for _ in range(8):
            r = (r >> 1) ^ (_POLY if r & 1 else 0)
        table.append(r)
    return table


def _apply(matrix: list[int], v: int) -> int:
    out = 0
    k = 0
    while v:
        if v & 1:
            out ^= matrix[k]
        v >>= 1
        k += 1
    return out


def _zeros_operator(n: int) -> list[int]:
    """Z_n as 32 columns: n zero bytes through the register (square and multiply)."""
    table = _byte_table()
    power = [(1 << k >> 8) ^ table[(1 << k) & 0xFF] for k in range(32)]  # one zero byte
    result = [1 << k for k in range(32)]  # identity
    while n:
        if n & 1:
            result = [_apply(power, c) for c in result]
        power = [_apply(power, c) for c in power]
        n >>= 1
    return result


def _shift(t: Tables, c: int) -> int:
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24]


def _twice(t: Tables, v: int) -> int:
    return _shift(t, _shift(t, v))


def _tables(f: Callable[[int], int]) -> Tables:
    """The linear map *f* of the CRC register as four byte-indexed tables."""
    t0, t1, t2, t3 = ([f(b << (8 * j)) for b in range(256)] for j in range(4))
    return t0, t1, t2, t3


def _powers(block_size: int, levels: int) -> list[Tables]:
    """The tables of Z_(2^i blocks) for i < *levels* (at least), each built
    from the one before (applied twice), kept per block size."""
    powers = _shift_tables.get(block_size)
    if powers is not None and len(powers) >= levels:
        return powers
    with _building:  # (threads verify reads too: one builder, levels in order)
        powers = _shift_tables.get(block_size)
        if powers is None:
            z = _zeros_operator(block_size)
            powers = _shift_tables[block_size] = [_tables(functools.partial(_apply, z))]
        while len(powers) < levels:
            powers.append(_tables(functools.partial(_twice, powers[-1])))
    return powers


def shift_tables(block_size: int) -> Tables:
    """Z_block_size as four byte-indexed tables (cached per block size)."""
    return _powers(block_size, 1)[0]


def _prefix(crcs: array[int], block_size: int) -> array[int]:
    """The prefix CRCs of *crcs* (see above), folded once per array."""
    global _prefix_blocks
    key = id(crcs)
    entry = _prefixes.get(key)
    if entry is not None and entry[0]() is crcs:
        return entry[1]
    t0, t1, t2, t3 = shift_tables(block_size)
    prefix = array(CRC_TYPECODE, [0])
    append = prefix.append
    c = 0
    for x in crcs:
        c = t0[c & 0xFF] ^ t1[(c >> 8) & 0xFF] ^ t2[(c >> 16) & 0xFF] ^ t3[c >> 24] ^ x
        append(c)
    if _prefix_blocks + len(prefix) > MAX_PREFIX_BLOCKS or len(_prefixes) >= MAX_PREFIXES:
        _prefixes.clear()
        _prefix_blocks = 0
    _prefixes[key] = (weakref.ref(crcs, functools.partial(_forget_prefix, key)), prefix)
    _prefix_blocks += len(prefix)
    return prefix


def _forget_prefix(key: int, ref: weakref.ref[array[int]]) -> None:
    """(the array is gone) Its prefix goes too, unless already replaced."""
    global _prefix_blocks
    entry = _prefixes.get(key)
    if entry is not None and entry[0] is ref and _prefixes.pop(key, None) is not None:
        _prefix_blocks -= len(entry[1])


def combined_crc(crcs: array[int], first: int, count: int, block_size: int) -> int:
    """CRC-32C of blocks first..first+count-1 laid end to end (all whole),
    from their stored CRCs."""
    if count == 1:
        return crcs[first]
    prefix = _prefix(crcs, block_size)
    c = prefix[first]
    if c:
        powers = _powers(block_size, count.bit_length())
        n, i = count, 0
        while n:
            if n & 1:
                c = _shift(powers[i], c)
            n >>= 1
            i += 1
    return prefix[first + count] ^ c


def first_bad_block(data: Buf, first_block: int, crcs: array[int], block_size: int) -> int:
    """Check *data*, which starts at block *first_block* of its chunk, against
    the chunk's checksums; return the index of the first block that does not
    match, or -1. The last block of *data* may be partial (the chunk's end)."""
    n = len(data)
    if n == 0:
        return -1
    if n <= block_size:  # the common small random read: one call, no copy for bytes
        return -1 if crc32c(_block(data, 0, n)) == crcs[first_block] else first_block
    # the whole blocks in one CRC, the partial last one (a file's end) in
    # another: two calls and one copy instead of one of each per block
    count, tail = divmod(n, block_size)
    whole = count * block_size
    if _crc_span(data, 0, whole) == combined_crc(crcs, first_block, count, block_size) and (
        tail == 0 or crc32c(_block(data, whole, n)) == crcs[first_block + count]
    ):
        return -1
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
