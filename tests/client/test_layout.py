"""The one chunk planner: where every byte of a range goes, at chunk edges."""

from __future__ import annotations

import errno

import pytest

from shufflefs.client.layout import MAX_CHUNKS, plan
from shufflefs.metadata.protocol import Layout
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import chunk_id

CS = 4096
LAYOUT: Layout = {"chunk_size": CS, "chains": [7, 8, 9]}


def test_one_piece_per_chunk_touched() -> None:
    assert plan([(5, LAYOUT, 0, 1)]) == [(7, chunk_id(5, 0), 0, 1, 0)]
    assert plan([(5, LAYOUT, CS - 1, 1)]) == [(7, chunk_id(5, 0), CS - 1, 1, 0)]
    assert plan([(5, LAYOUT, CS, 1)]) == [(8, chunk_id(5, 1), 0, 1, 0)]
    assert plan([(5, LAYOUT, CS - 1, 2)]) == [
        (7, chunk_id(5, 0), CS - 1, 1, 0),
        (8, chunk_id(5, 1), 0, 1, 1),
    ]
    # three chunks, the middle one whole, the chains in turn and round again
    assert plan([(5, LAYOUT, 3 * CS - 10, CS + 20)]) == [
        (9, chunk_id(5, 2), CS - 10, 10, 0),
        (7, chunk_id(5, 3), 0, CS, 10),
        (8, chunk_id(5, 4), 0, 10, CS + 10),
    ]


def test_extents_laid_end_to_end() -> None:
    pieces = plan([(5, LAYOUT, 100, 50), (6, LAYOUT, 0, 0), (6, LAYOUT, CS - 5, 10)])
    assert pieces == [
        (7, chunk_id(5, 0), 100, 50, 0),
        (7, chunk_id(6, 0), CS - 5, 5, 50),
        (8, chunk_id(6, 1), 0, 5, 55),
    ]
    # every byte of the output is covered exactly once
    covered = sorted((p[4], p[4] + p[3]) for p in pieces)
    assert covered == [(0, 50), (50, 55), (55, 60)]


def test_refused_ranges() -> None:
    for extent, code in [
        ((5, LAYOUT, -1, 1), errno.EINVAL),
        ((5, LAYOUT, 0, -1), errno.EINVAL),
        ((5, {"chunk_size": CS, "chains": []}, 0, 1), errno.EIO),
        ((5, LAYOUT, MAX_CHUNKS * CS, 1), errno.EFBIG),
    ]:
        with pytest.raises(FsError) as info:
            plan([extent])
        assert info.value.code == code
    assert plan([(5, LAYOUT, MAX_CHUNKS * CS, 0)]) == []  # nothing to read is no error
