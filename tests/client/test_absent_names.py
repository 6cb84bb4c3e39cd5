"""The names of a watched directory held by a client (client/cache_watch.py
`names`, `absent`), against the real metadata server in this process: its
own creates keep them without a notice from the server (which does not
tell a session of its own creates, metadata/cache_watch.py); another
client's create drops them before it returns; a reply whose directory
counter is not the next one drops them too."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from shufflefs.client.cache_watch import CacheWatch
from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.metadata.protocol import ROOT_INODE, WatchedDirPage
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.errors import FsError

from .test_open_cache import OpenFs

pytestmark = pytest.mark.trio


async def create(fs: FileSystem, parent: int, name: bytes) -> None:
    f, _ = await fs.create(parent, name, 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0, 0)
    await fs.release(f.fh)


async def learned(fs: FileSystem, parent: int) -> CacheWatch:
    """What a mount does after its first create in a directory."""
    watch = fs.cache_watch
    assert watch is not None
    await watch.learn_names(parent)
    assert parent in watch.names
    return watch


async def test_own_creates_keep_the_names_and_anothers_drop_them(open_fs: OpenFs) -> None:
    a = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    b = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    d = (await a.mkdir(ROOT_INODE, b"absent-1", 0o755, 0, 0))["ino"]
    await create(a, d, b"before")
    watch = await learned(a, d)
    assert watch.names[d] == {b"before"}
    for name in (b"x", b"y", b"z"):
        assert watch.absent(d, name)
        await create(a, d, name)
        assert not watch.absent(d, name)
    assert watch.names[d] == {b"before", b"x", b"y", b"z"}
    # none of those was told to a's watch: it still watches the directory
    assert watch.dir_attr(d) is not None
    await create(b, d, b"theirs")  # returns once a has dropped what it held
    assert d not in watch.names and not watch.absent(d, b"theirs")
    # listed again only after RELEARN
    await watch.learn_names(d)
    assert d not in watch.names
    watch._next_listing.clear()
    await watch.learn_names(d)
    assert watch.names[d] == {b"before", b"x", b"y", b"z", b"theirs"}
    # another change of a's own (not a create): dropped at once
    await a.unlink(d, b"x")
    assert d not in watch.names


async def test_a_reply_that_skips_a_change_drops_the_names(open_fs: OpenFs) -> None:
    a = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    d = (await a.mkdir(ROOT_INODE, b"absent-2", 0o755, 0, 0))["ino"]
    watch = await learned(a, d)
    attr, stamp = watch.dirs[d]
    watch.dirs[d] = ({**attr, "change": attr["change"] - 1}, stamp)  # as if one was missed
    await create(a, d, b"f")
    assert d not in watch.names and d not in watch.dirs


async def test_concurrent_creates_of_two_clients_in_one_directory(open_fs: OpenFs) -> None:
    """Creates of both clients in one directory at once (in the server's
    groups together): whatever each holds afterwards names every file."""
    a = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    b = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    d = (await a.mkdir(ROOT_INODE, b"absent-3", 0o755, 0, 0))["ino"]
    for fs in (a, b):
        await learned(fs, d)

    async def writer(fs: FileSystem, prefix: bytes) -> None:
        for i in range(20):
            await create(fs, d, prefix + str(i).encode())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, a, b"a")
        nursery.start_soon(writer, b, b"b")
    every = {p + str(i).encode() for p in (b"a", b"b") for i in range(20)}
    for fs in (a, b):
        watch = fs.cache_watch
        assert watch is not None
        held = watch.names.get(d)
        assert held is None or held == every
        for name in every:
            assert not watch.absent(d, name)


async def test_a_server_of_before_keeps_listings_watched_and_no_names(
    open_fs: OpenFs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A metadata server without `watch_dir`'s `names` (it refuses the
    argument, as the rpc schema does: EINVAL "unexpected argument 'names'")
    still watches the listing; the client holds no names from then on."""
    original = MetaStub.watch_dir

    async def before(
        self: MetaStub, session: int, ino: int, limit: int = 256, names: bool = False
    ) -> WatchedDirPage:
        if names:
            raise FsError(errno.EINVAL, "watch_dir: unexpected argument 'names'")
        return await original(self, session, ino, limit)

    monkeypatch.setattr(MetaStub, "watch_dir", before)
    a = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    d = (await a.mkdir(ROOT_INODE, b"absent-4", 0o755, 0, 0))["ino"]
    await create(a, d, b"x")
    watch = a.cache_watch
    assert watch is not None
    page = await a.readdir(d, None, 256, watch=True)
    assert [n for n, _ in page["entries"]] == [b"x"]
    assert watch.dir_attr(d) is not None and not watch.names_supported
    assert d not in watch.names and not watch.absent(d, b"y")
    await watch.learn_names(d)
    assert d not in watch.names
