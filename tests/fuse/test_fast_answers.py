"""The parts of fuse/fast_answers.py that read libfuse's structures: the
SETATTR request's ``struct stat`` read at the offsets pyfuse3's own
EntryAttributes (the same struct) confirms, and its bits as pyfuse3 reads them."""

from __future__ import annotations

import time

import pyfuse3

from shufflefs.fuse.fast_answers import (
    SET_ATIME,
    SET_ATIME_NOW,
    SET_GID,
    SET_MODE,
    SET_MTIME,
    SET_MTIME_NOW,
    SET_UID,
    STAT_OFFSET,
    entry_layout_ok,
    setattr_request,
)


def a_stat() -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_mode, e.st_uid, e.st_gid = 0o104751, 1234, 5678
    e.st_atime_ns, e.st_mtime_ns = 1_300_000_000_123_456_789, 1_400_000_000_987_654_321
    return e


def test_the_layout_this_build_has_is_the_one_read() -> None:
    assert entry_layout_ok()


def test_a_setattr_request_reads_what_its_bits_name_and_only_that() -> None:
    e = a_stat()
    attr = id(e) + STAT_OFFSET
    assert setattr_request(attr, 0) == {}
    every = SET_MODE | SET_UID | SET_GID | SET_ATIME | SET_MTIME
    assert setattr_request(attr, every) == {
        "mode": 0o4751,  # the permission bits only, as the handler passes them
        "uid": 1234,
        "gid": 5678,
        "atime": 1_300_000_000_123_456_789,
        "mtime": 1_400_000_000_987_654_321,
    }
    assert setattr_request(attr, SET_GID) == {"gid": 5678}


def test_now_is_the_clock_unless_a_time_is_given_as_pyfuse3_reads_it() -> None:
    e = a_stat()
    attr = id(e) + STAT_OFFSET
    before = time.time_ns()
    got = setattr_request(attr, SET_ATIME_NOW | SET_MTIME_NOW)
    assert before <= got["atime"] == got["mtime"] <= time.time_ns()
    # both bits: the given time wins (pyfuse3's order)
    got = setattr_request(attr, SET_ATIME | SET_ATIME_NOW)
    assert got == {"atime": 1_300_000_000_123_456_789}
