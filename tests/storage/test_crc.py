"""google_crc32c (the data path) against crcmod (the independent reference)."""

from __future__ import annotations

import gc
import random

import crcmod.predefined
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shufflefs.storage import crc as crc_module
from shufflefs.storage.crc import (
    block_crcs,
    combined_crc,
    crc32c,
    crcs_from_bytes,
    crcs_to_bytes,
    first_bad_block,
    zero_block_crc,
)

reference = crcmod.predefined.mkCrcFun("crc-32c")


def test_known_vector() -> None:
    # the CRC-32C check value (RFC 3720 appendix B.4 uses the same polynomial)
    assert crc32c(b"123456789") == 0xE3069283 == reference(b"123456789")


@pytest.mark.parametrize("size", [0, 1, 3, 4, 7, 8, 63, 64, 511, 512, 4095, 4096, 4097, 65536 + 13])
def test_matches_reference_on_random_data(size: int) -> None:
    rng = random.Random(size)
    for _ in range(20):
        data = rng.randbytes(size)
        assert crc32c(data) == reference(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=20000), st.sampled_from([512, 1024, 4096]))
def test_block_crcs_match_reference(data: bytes, block_size: int) -> None:
    expected = [reference(data[i : i + block_size]) for i in range(0, len(data), block_size)]
    for buf in (data, bytearray(data), memoryview(data)):
        assert list(block_crcs(buf, block_size)) == expected
    crcs = block_crcs(data, block_size)
    assert crcs_from_bytes(crcs_to_bytes(crcs)) == crcs
    assert crcs_to_bytes(crcs) == b"".join(c.to_bytes(4, "big") for c in expected)
    assert first_bad_block(data, 0, crcs, block_size) == -1


def test_first_bad_block_finds_the_damage() -> None:
    rng = random.Random(1)
    data = bytearray(rng.randbytes(10 * 512 + 100))
    crcs = block_crcs(bytes(data), 512)
    assert first_bad_block(bytes(data[1024:]), 2, crcs, 512) == -1
    data[3 * 512 + 7] ^= 0x40
    assert first_bad_block(bytes(data), 0, crcs, 512) == 3
    assert first_bad_block(data[3 * 512 : 4 * 512], 3, crcs, 512) == 3
    assert first_bad_block(bytes(data[4 * 512 :]), 4, crcs, 512) == -1


def test_zero_block_crc() -> None:
    for bs in (512, 4096):
        assert zero_block_crc(bs) == reference(bytes(bs))


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([512, 1024, 4096]),
    st.integers(1, 12),
    st.integers(0, 11),
    st.integers(0, 1 << 30),
)
def test_combined_crc_is_the_crc_of_the_blocks_together(
    block_size: int, blocks: int, first: int, seed: int
) -> None:
    """The fold of stored block CRCs (what a read of many blocks checks its
    one CRC against) equals the reference CRC of those blocks end to end; any
    flipped byte in any block is still caught and named."""
    rng = random.Random(seed)
    first = min(first, blocks - 1)
    data = bytearray(rng.randbytes(blocks * block_size))
    crcs = block_crcs(bytes(data), block_size)
    span = data[first * block_size :]
    assert combined_crc(crcs, first, blocks - first, block_size) == reference(bytes(span))
    assert first_bad_block(span, first, crcs, block_size) == -1
    at = rng.randrange(len(span))
    span[at] ^= 1 << rng.randrange(8)
    assert first_bad_block(span, first, crcs, block_size) == first + at // block_size


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([512, 4096]),
    st.integers(1, 12),
    st.integers(1, 4095),
    st.integers(0, 1 << 30),
)
def test_a_span_ending_in_a_partial_block_is_checked_whole(
    block_size: int, blocks: int, tail: int, seed: int
) -> None:
    """A file's last block is short: the whole blocks are checked in one CRC
    and the short one alone, and damage in either is named."""
    rng = random.Random(seed)
    tail = tail % block_size or 1
    data = bytearray(rng.randbytes(blocks * block_size + tail))
    crcs = block_crcs(bytes(data), block_size)
    assert first_bad_block(data, 0, crcs, block_size) == -1
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    assert first_bad_block(data, 0, crcs, block_size) == at // block_size
    assert first_bad_block(memoryview(data), 0, crcs, block_size) == at // block_size


def test_any_run_of_blocks_is_checked_from_one_prefix_fold_per_chunk() -> None:
    """`combined_crc` folds a chunk's checksums once (its prefix CRCs) and
    answers every run of blocks from that, the CRC of those blocks end to end;
    the fold lives as long as the checksums it folds, within its bound."""
    rng = random.Random(3)
    block_size = 512
    data = rng.randbytes(300 * block_size)
    crcs = block_crcs(data, block_size)
    runs = [(0, 300), (3, 17), (0, 3), (299, 1), (10, 2), (1, 256), (44, 255), (7, 128)]
    runs += [(f, rng.randint(1, 300 - f)) for f in (rng.randrange(300) for _ in range(40))]
    for first, count in runs:
        whole = data[first * block_size : (first + count) * block_size]
        assert combined_crc(crcs, first, count, block_size) == crc32c(whole), (first, count)
    assert len([k for k in crc_module._prefixes if k == id(crcs)]) == 1  # folded once
    gc.collect()  # (other tests' garbage first: its folds go now, not below)
    held = crc_module._prefix_blocks
    del crcs  # the record is gone: so is its fold
    gc.collect()
    assert crc_module._prefix_blocks == held - 301
    crc_module._prefixes.clear()
    crc_module._prefix_blocks = crc_module.MAX_PREFIX_BLOCKS - 10  # nearly full: starts over
    again = block_crcs(data, block_size)
    assert combined_crc(again, 5, 200, block_size) == crc32c(data[5 * 512 : 205 * 512])
    assert crc_module._prefix_blocks == 301 and len(crc_module._prefixes) == 1
    keep = [block_crcs(data[: 3 * block_size], block_size) for _ in range(5)]
    crc_module.MAX_PREFIXES, limit = 3, crc_module.MAX_PREFIXES
    try:  # as many arrays as allowed: starts over, never more
        for crcs in keep:
            assert combined_crc(crcs, 0, 3, block_size) == crc32c(data[: 3 * block_size])
            assert len(crc_module._prefixes) <= 3
    finally:
        crc_module.MAX_PREFIXES = limit


def test_big_spans_are_checked_in_place_and_still_catch_damage() -> None:
    """Spans of IN_PLACE_MIN and more of a writable buffer are checksummed where
    they lie (the C library's crc32c_extend); any buffer type, any offset into
    it, gives the reference CRC, and a flipped byte is still found."""
    assert crc_module._extend is not None  # found among this process's mappings
    rng = random.Random(7)
    bs = 4096
    data = rng.randbytes(40 * bs + 123)
    crcs = block_crcs(data, bs)
    backing = bytearray(b"x" * 5 + data)
    kinds = {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(bytearray(data)),
        "offset view": memoryview(backing)[5:],
        "read-only view": memoryview(bytearray(data)).toreadonly(),
    }
    for name, buf in kinds.items():
        n = len(buf)
        assert crc_module._crc_span(buf, 0, n) == reference(data), name
        assert crc_module._crc_span(buf, bs, n) == reference(data[bs:]), name
        assert first_bad_block(buf, 0, crcs, bs) == -1, name
    damaged = bytearray(data)
    damaged[17 * bs + 9] ^= 0x01
    assert first_bad_block(damaged, 0, crcs, bs) == 17
    assert first_bad_block(memoryview(damaged)[bs:], 1, crcs, bs) == 17
