"""fuse/kept_listings.py without a mount: its records are byte for byte what
libfuse's ``fuse_add_direntry_plus`` writes for pyfuse3's EntryAttributes;
a READDIRPLUS gets the records from the offset it resumes at to the last
one its size holds, with the timeouts written into those and only those;
listings are gathered only whole, from their first page, in order, fresh,
and within the bound."""

from __future__ import annotations

import ctypes
import stat
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest
import trio

from shufflefs.fuse import readdir_token
from shufflefs.fuse.dir_handles import Offsets, dot_entry
from shufflefs.fuse.direntplus import DIRENTPLUS, build, dot_record, join, record
from shufflefs.fuse.entry_attrs import entry_attributes
from shufflefs.fuse.fast_answers import ENTRY_OFFSET, entry_layout_ok
from shufflefs.fuse.kept_listings import MAX_GATHERING, KeptListings

NAMES = (b"s00001.jpg", b"x", b"abcdefgh", b"\xc3\xa9t\xc3\xa9", b"n" * 255)


def an_attr(ino: int, mode: int = stat.S_IFREG | 0o644, parent: int = 0) -> dict[str, int]:
    return {
        "ino": ino,
        "mode": mode,
        "nlink": 1 if stat.S_ISREG(mode) else 2,
        "uid": 1000,
        "gid": 100,
        "rdev": 0,
        "size": 112_640 + ino,
        "atime": 1_700_000_000_123_456_789,
        "mtime": 1_700_000_001_987_654_321 + ino,
        "ctime": 1_700_000_002_000_000_001,
        "parent": parent,
    }


def libfuse_record(name: bytes, entry: Any, cookie: int) -> bytes:
    """What libfuse writes for *entry* (a pyfuse3 EntryAttributes)."""
    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "libfuse3.so" in line)
    add = ctypes.CDLL(path).fuse_add_direntry_plus
    add.argtypes = (
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.c_int64,
    )
    add.restype = ctypes.c_size_t
    buf = ctypes.create_string_buffer(4096)
    n = add(None, buf, len(buf), name, id(entry) + ENTRY_OFFSET, cookie)
    return buf.raw[:n]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", [stat.S_IFREG | 0o640, stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777])
def test_a_record_is_what_libfuse_writes(name: bytes, mode: int) -> None:
    assert entry_layout_ok()
    attr = an_attr(77, mode)
    entry = entry_attributes(attr, 299.75, 123.5)  # type: ignore[arg-type]
    assert record(name, attr, 4242, 299.75, 123.5) == libfuse_record(name, entry, 4242)  # type: ignore[arg-type]


def test_dots_are_what_libfuse_writes() -> None:
    assert dot_record(b".", 42, 1) == libfuse_record(b".", dot_entry(42), 1)
    assert dot_record(b"..", 7, 2) == libfuse_record(b"..", dot_entry(7), 2)


def a_listing(n: int, read_at: float = 0.0) -> tuple[Any, list[tuple[bytes, Any]]]:
    entries = [(f"f{i:04d}".encode(), an_attr(100 + i)) for i in range(n)]
    return build(9, 1, read_at, Offsets(), entries), entries  # type: ignore[arg-type]


def unpack(buf: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
    """(name, the record's fields) of each record in a reply."""
    out, at = [], 0
    while at < len(buf):
        head = DIRENTPLUS.unpack_from(buf, at)
        namelen = head[-2]
        name = buf[at + DIRENTPLUS.size : at + DIRENTPLUS.size + namelen]
        out.append((name, head))
        at += DIRENTPLUS.size + namelen + (-namelen % 8)
    return out


def reply(kept: Any, first: int, last: int) -> bytes:
    return ctypes.string_at(kept.address(first), kept.starts[last] - kept.starts[first])


def test_a_readdirplus_gets_the_records_after_its_offset_that_its_size_holds() -> None:
    kept, entries = a_listing(40)
    size = DIRENTPLUS.size + 8  # each record here: 152 + "fNNNN" padded to 8
    # from the start: '.', '..', then entries, as many as fit
    first, last = kept.span(0, 10 * size)
    got = unpack(reply(kept, first, last))
    assert [n for n, _ in got] == [b".", b".."] + [e[0] for e in entries[:8]]
    # resuming at the offset of the last record taken
    cookie = got[-1][1][-3]
    first, last = kept.span(cookie, 10 * size + 7)  # (7 bytes too few for one more)
    again = unpack(reply(kept, first, last))
    assert [n for n, _ in again] == [e[0] for e in entries[8:18]]
    # '..' alone next after '.', the first entry after '..'
    assert [n for n, _ in unpack(reply(kept, *kept.span(1, size)))] == [b".."]
    assert [n for n, _ in unpack(reply(kept, *kept.span(2, size)))] == [entries[0][0]]
    # at the end: nothing (the end of the directory); an offset never handed out: declined
    end_cookie = unpack(reply(kept, *kept.span(2, 100 * size)))[-1][1][-3]
    first, last = kept.span(end_cookie, 4096)
    assert first == last
    assert kept.span(10**9, 4096) is None


def test_timeouts_are_written_into_the_records_handed_out_only() -> None:
    kept, _ = a_listing(10)
    kept.stamp(2, 5, 12.25, 3.5)
    got = unpack(reply(kept, 0, len(kept.starts) - 1))
    valid = [(h[2], h[3], h[4], h[5]) for _, h in got]
    assert valid[:4] == [(0, 0, 0, 0)] * 4  # '.', '..', entries 0 and 1
    assert valid[4:7] == [(12, 3, 250_000_000, 500_000_000)] * 3
    assert valid[7:] == [(0, 0, 0, 0)] * 5


def kept_listings(max_entries: int = 1000, fresh: float = 5.0) -> KeptListings:
    options = SimpleNamespace(
        read_only=True, entry_timeout=fresh, attr_timeout=fresh + 1, keep_listings=max_entries
    )
    ops = SimpleNamespace(options=options, fs=SimpleNamespace(cache_watch=None))
    return KeptListings(ops, max_entries)  # type: ignore[arg-type]


def pages(n: int, per: int) -> list[list[tuple[bytes, Any]]]:
    entries = [(f"f{i:04d}".encode(), an_attr(100 + i)) for i in range(n)]
    return [entries[i : i + per] for i in range(0, n, per)]


async def test_a_listing_is_kept_once_whole_from_its_first_page_in_order() -> None:
    k, offsets = kept_listings(), Offsets()
    parts = pages(10, 4)
    k.page(9, 1, None, parts[0], True, 0.0, offsets)
    k.page(9, 1, parts[0][-1][0], parts[1], True, 0.0, offsets)
    assert k.current(9) is None  # not whole yet
    k.page(9, 1, parts[1][-1][0], parts[2], False, 0.0, offsets)
    kept = k.current(9)
    assert kept is not None and kept.inos == list(range(100, 110))
    assert kept.offsets is offsets and k.entries == 10
    # a page that does not follow the one gathered before (another listing's) keeps nothing
    k.page(8, 1, None, parts[0], True, 0.0, offsets)
    k.page(8, 1, parts[1][-1][0], parts[2], False, 0.0, offsets)
    assert k.current(8) is None
    # nor a page that is not a listing's first
    k.page(7, 1, parts[0][-1][0], parts[1], False, 0.0, offsets)
    assert k.current(7) is None


async def test_kept_listings_age_out_and_are_bounded() -> None:
    k = kept_listings(max_entries=20, fresh=5.0)
    (one,) = pages(3, 3)
    # answered from for half the timeouts (min 5 s): read 2.5 s ago or more, not kept
    k.page(9, 1, None, one, False, 2.5, Offsets())
    assert k.current(9) is None
    k.page(9, 1, None, one, False, 2.4, Offsets())
    assert k.current(9) is not None
    await trio.sleep(0.2)  # its first page is now 2.6 s old
    assert k.current(9) is None and k.entries == 0
    # a directory over a quarter of the bound is not kept
    (big,) = pages(6, 6)
    k.page(5, 1, None, big, False, 0.0, Offsets())
    assert k.current(5) is None
    # beyond the bound, the least recently listed go first
    for ino in range(10, 18):
        k.page(ino, 1, None, one, False, 0.0, Offsets())
    assert k.entries <= 20
    assert [ino for ino in range(10, 18) if k.current(ino) is not None] == [12, 13, 14, 15, 16, 17]
    # listings left unfinished: the oldest dropped beyond MAX_GATHERING
    for ino in range(100, 100 + MAX_GATHERING + 5):
        k.page(ino, 1, None, one, True, 0.0, Offsets())
    assert len(k.gathering) == MAX_GATHERING and 100 not in k.gathering


class Watch:
    """What a read-write mount's cache watch says of directories (the
    change counter it holds each at; absent: not watched)."""

    def __init__(self) -> None:
        self.dirs: dict[int, int] = {}

    def dir_attr(self, ino: int) -> dict[str, int] | None:
        change = self.dirs.get(ino)
        return None if change is None else {"ino": ino, "change": change}


def read_write(watch: Watch | None) -> KeptListings:
    options = SimpleNamespace(read_only=False, entry_timeout=1.0, attr_timeout=1.0)
    ops = SimpleNamespace(options=options, fs=SimpleNamespace(cache_watch=watch))
    return KeptListings(ops, 1000)  # type: ignore[arg-type]


def test_a_read_write_mount_without_a_cache_watch_keeps_none() -> None:
    assert not read_write(None).enabled


async def test_a_read_write_mount_keeps_names_while_its_watch_keeps_the_directory() -> None:
    watch = Watch()
    k = read_write(watch)
    parts = pages(6, 3)
    # not watched: nothing would tell a change, nothing kept
    k.page(9, 1, None, parts[0], True, 0.0, Offsets())
    k.page(9, 1, parts[0][-1][0], parts[1], False, 0.0, Offsets())
    assert k.current(9) is None
    # watched at change 5 from the first page to the last: kept, names only
    watch.dirs[9] = 5
    offsets = Offsets()
    k.page(9, 1, None, parts[0], True, 0.0, offsets)
    k.page(9, 1, parts[0][-1][0], parts[1], False, 0.0, offsets)
    kept = k.current(9)
    assert kept is not None and kept.change == 5
    # with attributes, for half the mode's timeouts; names only after (`strip`)
    with_attrs = unpack(reply(kept, *kept.span(0, 4096)))
    assert [h[0] for _, h in with_attrs[2:]] == list(range(100, 106))  # node ids
    kept.strip()
    got = unpack(reply(kept, *kept.span(0, 4096)))
    assert [n for n, _ in got] == [b".", b".."] + [f"f{i:04d}".encode() for i in range(6)]
    for (_, head), (_, before) in zip(got[2:], with_attrs[2:], strict=True):
        assert head[:22] == (0,) * 22  # node id 0, no attributes
        assert head[22:] == before[22:]  # the same inode number, offset, name, type
    assert [h[22] for _, h in got[2:]] == list(range(100, 106))  # their inode numbers
    assert {h[25] for _, h in got[2:]} == {stat.S_IFREG >> 12}
    # and long after the mode's timeouts, while the watch holds it
    await trio.sleep(1.1)
    assert k.current(9) is kept
    # a change (the counter moved, or the watch let it go) ends it
    watch.dirs[9] = 6
    assert k.current(9) is None
    # a change between the first page and the last: not kept
    k.page(9, 1, None, parts[0], True, 0.0, offsets)
    watch.dirs[9] = 7
    k.page(9, 1, parts[0][-1][0], parts[1], False, 0.0, offsets)
    assert k.current(9) is None


def test_pages_joined_are_the_listing_built_at_once() -> None:
    entries = [(f"f{i:04d}".encode(), an_attr(100 + i)) for i in range(10)]
    offsets = Offsets()
    whole = build(9, 1, 0.0, offsets, entries)
    parts = [build(9, 1, 0.0, offsets, entries[:4])]
    parts += [build(9, None, 0.0, offsets, entries[4:7]), build(9, None, 0.0, offsets, entries[7:])]
    assert parts[1].lead == 0 and parts[1].span(1, 4096) is None  # no dots in a later page
    joined = join(parts)
    assert bytes(joined.records) == bytes(whole.records)
    assert (joined.starts, joined.resume, joined.inos) == (whole.starts, whole.resume, whole.inos)
    assert joined.names == [n for n, _ in entries]


def listing_ops(fresh: float = 5.0, max_entries: int = 1000) -> Any:
    """What KeptListings asks of the mount when it hands records out, recorded."""
    told: list[int] = []
    options = SimpleNamespace(
        read_only=True, entry_timeout=fresh, attr_timeout=fresh + 1, keep_listings=max_entries
    )
    return SimpleNamespace(
        options=options,
        fs=SimpleNamespace(cache_watch=None),
        listings=SimpleNamespace(offsets={}),
        dir_ahead=SimpleNamespace(listed_files=lambda ino, files: None),
        told_many=lambda inos, versions, parents, regular: told.extend(inos),
        watched=None,
        told=told,
    )


async def test_a_listing_being_gathered_hands_out_each_page_read_so_far() -> None:
    ops = listing_ops()
    k = KeptListings(ops, 1000)
    offsets = Offsets()
    parts = pages(10, 4)
    k.page(9, 1, None, parts[0], True, 0.0, offsets)
    records, first, last, whole = k.locate(9, 0, 4096)  # type: ignore[misc]
    assert (first, last, whole) == (0, 6, False)  # '.', '..', the first page's four
    cookie = offsets.of(parts[0][-1][0])
    assert k.locate(9, cookie, 4096) is None  # the next page is not read yet
    k.page(9, 1, parts[0][-1][0], parts[1], True, 0.0, offsets)
    records, first, last, whole = k.locate(9, cookie, 4096)  # type: ignore[misc]
    assert [n for n, _ in unpack(reply(records, first, last))] == [n for n, _ in parts[1]]
    # within a page, from the offset the kernel stands at
    records, first, last, _ = k.locate(9, offsets.of(parts[1][1][0]), 4096)  # type: ignore[misc]
    assert [n for n, _ in unpack(reply(records, first, last))] == [n for n, _ in parts[1][2:]]
    # the last page in: kept whole, its end is the listing's end
    k.page(9, 1, parts[1][-1][0], parts[2], False, 0.0, offsets)
    records, first, last, whole = k.locate(9, offsets.of(parts[2][-1][0]), 4096)  # type: ignore[misc]
    assert whole and first == last
    # handed out through pyfuse3's reply: the bytes, the timeouts, the entries told
    token = pyfuse3.ReaddirToken()
    ctypes.c_uint64.from_address(
        id(token) + readdir_token.FIELDS_OFFSET + readdir_token.SIZE
    ).value = 4096
    try:
        assert k.into_reply(9, offsets.of(parts[0][1][0]), token, told=False)
        got = written(token)
    finally:
        release(token)
    assert [n for n, _ in unpack(got)] == [f"f{i:04d}".encode() for i in range(2, 10)]
    assert {(h[2], h[3]) for _, h in unpack(got)} == {(4, 5)}  # 5 s and 6 s, less their age
    assert ops.told == list(range(102, 110))


def written(token: Any) -> bytes:
    at = id(token) + readdir_token.FIELDS_OFFSET
    start = ctypes.c_uint64.from_address(at + readdir_token.BUF_START).value
    buf = ctypes.c_uint64.from_address(at + readdir_token.BUF).value
    return ctypes.string_at(start, buf - start) if start else b""


def release(token: Any) -> None:
    """Free a token's buffer, as pyfuse3 does after its reply."""
    at = id(token) + readdir_token.FIELDS_OFFSET
    start = ctypes.c_uint64.from_address(at + readdir_token.BUF_START)
    if start.value:
        ctypes.CDLL(None).free(ctypes.c_void_p(start.value))
    start.value = 0


def test_a_reply_is_written_where_pyfuse3s_readdir_reply_writes() -> None:
    assert readdir_token.layout_ok()
    kept, entries = a_listing(5)
    token = pyfuse3.ReaddirToken()
    size = ctypes.c_uint64.from_address(
        id(token) + readdir_token.FIELDS_OFFSET + readdir_token.SIZE
    )
    size.value = 1000
    try:
        # entry by entry through pyfuse3, then records after them: one reply
        assert pyfuse3.readdir_reply(token, b".", dot_entry(9), 1)
        assert readdir_token.room(token) == 1000 - 160
        first, last = kept.span(1, readdir_token.room(token))
        readdir_token.write(token, kept.address(first), kept.starts[last] - kept.starts[first])
        got = [n for n, _ in unpack(written(token))]
        assert got == [b".", b".."] + [e[0] for e in entries[:4]]  # what 1,000 bytes hold
        with pytest.raises(ValueError):
            readdir_token.write(token, kept.address(0), readdir_token.room(token) + 1)
    finally:
        release(token)


async def test_a_reply_too_small_for_the_next_record_is_not_the_end() -> None:
    k, offsets = KeptListings(listing_ops(), 1000), Offsets()
    (page,) = pages(3, 3)
    k.page(9, 1, None, page, False, 0.0, offsets)
    assert k.locate(9, offsets.of(page[0][0]), 100) is None  # a record takes 160 bytes
    records, first, last, whole = k.locate(9, offsets.of(page[-1][0]), 100)  # type: ignore[misc]
    assert whole and first == last == records.end  # after the last: the end
