"""The directory open-ahead of a mount (fuse/dir_ahead.py) against the real
metadata server in this process: a name is learned only if its file did not
change between the listing and the open (a change made in that window is
caught by the change counter, also when the listing came first); the open
cache's room bounds it; a name learned on a read-only mount answers for
``entry_timeout`` at most."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable

import pytest
import trio

from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.client.open_cache import CachedOpen
from shufflefs.fuse import dir_ahead
from shufflefs.fuse.dir_ahead import DirAhead
from shufflefs.metadata.protocol import ROOT_INODE, ReaddirPage
from shufflefs.rpc.errors import FsError

OPTIONS = ClientOptions(local_reads=False, open_linger=30.0, trust_open_cache=True)
OpenFs = Callable[[ClientOptions], Awaitable[FileSystem]]  # the `open_fs` fixture


async def directory(fs: FileSystem, files: int) -> tuple[int, list[int]]:
    """A directory of *files* empty files: its inode and theirs."""
    d = await fs.mkdir(ROOT_INODE, b"d", 0o755, 0, 0)
    inos = []
    for i in range(files):
        f, _ = await fs.create(d["ino"], f"f{i:02d}".encode(), 0o644, os.O_WRONLY, 0, 0)
        await fs.release(f.fh)
        inos.append(f.ino)
    return d["ino"], inos


async def test_a_file_changed_between_listing_and_open_is_not_learned(open_fs: OpenFs) -> None:
    writer = await open_fs(OPTIONS)
    reader = await open_fs(OPTIONS)
    d, inos = await directory(writer, 10)
    listing = reader.readdir

    async def changed_after_listing(
        ino: int, after: bytes | None, limit: int, watch: bool = False
    ) -> ReaddirPage:
        page = await listing(ino, after, limit, watch)
        await writer.setattr(inos[3], mode=0o600)  # after the listing, before the open
        return page

    reader.readdir = changed_after_listing  # type: ignore[method-assign]
    ahead = DirAhead(reader, None, 1024, entry_timeout=60.0)
    async with trio.open_nursery() as nursery:
        ahead.missed(d, await reader.lookup(d, b"f00"), nursery)
    assert ahead.counts.dirs == 1
    assert ahead.counts.changed == 1
    assert ahead.counts.files == 9
    learned = {name for (parent, name) in ahead.names if parent == d}
    assert learned == {f"f{i:02d}".encode() for i in range(10)} - {b"f03"}
    found = ahead.lookup(d, b"f05")
    assert found is not None and found[0]["ino"] == inos[5] and 0 < found[1] <= 60.0
    assert ahead.lookup(d, b"f03") is None
    # at most once per linger
    async with trio.open_nursery() as nursery:
        ahead.missed(d, await reader.lookup(d, b"f00"), nursery)
    assert ahead.counts.dirs == 1


async def test_a_file_removed_between_listing_and_open_is_not_kept_alive(
    open_fs: OpenFs,
) -> None:
    """A file unlinked after the listing but still held open elsewhere is
    opened (by inode) with no name left: its handle is given back by the
    next expiry, not kept for the linger, which held its space that long
    (a test that waited 10 s for a replaced file's chunks failed so once)."""
    writer = await open_fs(OPTIONS)
    reader = await open_fs(OPTIONS)
    d, inos = await directory(writer, 4)
    held, _ = await writer.open(inos[3], os.O_RDWR)  # keeps it alive once unlinked
    listing = reader.readdir

    async def removed_after_listing(
        ino: int, after: bytes | None, limit: int, watch: bool = False
    ) -> ReaddirPage:
        page = await listing(ino, after, limit, watch)
        await writer.unlink(d, b"f03")  # after the listing, before the open
        return page

    reader.readdir = removed_after_listing  # type: ignore[method-assign]
    ahead = DirAhead(reader, None, 1024, entry_timeout=60.0)
    async with trio.open_nursery() as nursery:
        ahead.missed(d, await reader.lookup(d, b"f00"), nursery)
    assert ahead.counts.files == 3  # f00-f02; f03 opened with no name left, not kept
    assert inos[3] not in reader.open_cache.entries
    assert ahead.lookup(d, b"f03") is None
    await reader.open_cache.expire()  # gives its handle back (not waiting for the linger)
    await writer.release(held.fh)  # the last handle: the file is freed
    with pytest.raises(FsError) as err:
        await reader.getattr(inos[3])
    assert err.value.code == errno.ENOENT


async def test_bounded_by_the_open_caches_room_and_by_entry_timeout(open_fs: OpenFs) -> None:
    fs = await open_fs(OPTIONS)
    d, _ = await directory(fs, 12)
    fs.open_cache.limit = 10  # room for 5 (half the limit)
    ahead = DirAhead(fs, None, 1024, entry_timeout=0.2)
    async with trio.open_nursery() as nursery:
        ahead.missed(d, await fs.lookup(d, b"f00"), nursery)
    assert ahead.counts.files == 5
    assert len(fs.open_cache.entries) == 5
    async with trio.open_nursery() as nursery:  # the cache is half full now
        ahead.missed(ROOT_INODE, await fs.lookup(d, b"f00"), nursery)
    assert ahead.counts.skipped == 1
    name = next(n for (p, n) in ahead.names if p == d)
    assert ahead.lookup(d, name) is not None
    await trio.sleep(0.3)
    assert ahead.lookup(d, name) is None  # older than entry_timeout


async def test_more_files_than_one_call_takes_are_opened_in_several(
    open_fs: OpenFs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`open_read_only` takes at most READDIR_MAX opens: a larger directory
    is opened in calls of that many (here made 4)."""
    monkeypatch.setattr(dir_ahead, "OPEN_BATCH", 4)
    fs = await open_fs(OPTIONS)
    d, _ = await directory(fs, 11)
    calls = []
    opened = fs.open_cache.open_ahead

    async def counted(inos: list[int]) -> dict[int, CachedOpen]:
        calls.append(len(inos))
        return await opened(inos)

    monkeypatch.setattr(fs.open_cache, "open_ahead", counted)
    ahead = DirAhead(fs, None, 1024, entry_timeout=60.0)
    async with trio.open_nursery() as nursery:
        ahead.missed(d, await fs.lookup(d, b"f00"), nursery)
    assert calls == [4, 4, 3]
    assert ahead.counts.files == 11 and ahead.counts.failed == 0
