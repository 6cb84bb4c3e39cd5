"""`FileSystem` without FUSE: create, write-behind, read-your-writes, reads
clamped at the end of the file, close-to-open between two clients, write
ordering per chunk and write failures reported at flush. Real metadata
server, mgmtd and storage daemons, all in this process."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable

import pytest
import trio
from clusters import CS, ChainCluster

from shufflefs.client.fs import ClientOptions, FileSystem, OpenFile
from shufflefs.client.layout import Piece
from shufflefs.metadata.protocol import ROOT_INODE, Layout
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import TRANSIENT

RDWR_CREATE = os.O_RDWR | os.O_CREAT
OpenFs = Callable[[ClientOptions], Awaitable[FileSystem]]  # the `open_fs` fixture


async def create(fs: FileSystem, name: bytes) -> OpenFile:
    f, _ = await fs.create(ROOT_INODE, name, 0o644, RDWR_CREATE, 0, 0)
    return f


async def test_write_read_back_at_edges_and_past_eof(fs: FileSystem, open_fs: OpenFs) -> None:
    f = await create(fs, b"edges")
    data = bytearray(os.urandom(3 * CS + 100))
    # in pieces that overlap, each across a chunk edge
    for offset, end in [(0, CS + 3), (CS - 1, 2 * CS + 3), (2 * CS + 3, len(data))]:
        assert await fs.write(f.fh, offset, data[offset:end]) == end - offset
    # read our own writes, before any flush
    assert await fs.read(f.fh, 0, len(data)) == data
    assert await fs.read(f.fh, CS - 1, 2) == data[CS - 1 : CS + 1]
    assert await fs.read(f.fh, CS - 100, CS + 200) == data[CS - 100 : 2 * CS + 100]
    assert await fs.read(f.fh, len(data) - 5, 100) == data[-5:]  # clamped at the end
    assert await fs.read(f.fh, len(data), 10) == b""
    assert await fs.read(f.fh, 10 * CS, 10) == b""
    # the one read path, many ranges at once
    ranges = [(0, 1), (CS - 1, 2), (len(data) - 3, 10), (len(data) + 1, 5)]
    extents = fs.extents(f, ranges)
    assert [e[3] for e in extents] == [1, 2, 3, 0]
    out = bytearray(6)
    await fs.read_into(extents, memoryview(out))
    assert out == data[0:1] + data[CS - 1 : CS + 1] + data[-3:]
    await fs.release(f.fh)

    # close-to-open: another client sees the data and the length
    other = await open_fs(ClientOptions(local_reads=False))
    attr = await other.lookup(ROOT_INODE, b"edges")
    assert attr["size"] == len(data)
    g, _ = await other.open(attr["ino"], os.O_RDONLY)
    assert await other.read(g.fh, 0, len(data) + 10) == data
    await other.release(g.fh)


WritePiece = Callable[[int, Layout, Piece, memoryview], Awaitable[None]]


async def test_write_behind_keeps_order_per_chunk(fs: FileSystem) -> None:
    """The first write of chunk 0 is held at the storage client: a later
    write of chunk 0 must wait for it (else the older bytes would land last),
    a write of chunk 1 must not."""
    f = await create(fs, b"ordered")
    real: WritePiece = fs.storage.writes.write_piece
    held = trio.Event()
    release = trio.Event()
    log: list[tuple[str, int, int]] = []  # (event, chunk index, length)

    async def write_piece(ino: int, layout: Layout, p: Piece, data: memoryview) -> None:
        index = int.from_bytes(p[1][8:], "big")
        log.append(("start", index, p[3]))
        if (index, p[3]) == (0, CS) and not held.is_set():
            held.set()
            await release.wait()
        await real(ino, layout, p, data)
        log.append(("done", index, p[3]))

    fs.storage.writes.write_piece = write_piece  # type: ignore[method-assign]
    old, new, other = os.urandom(CS), os.urandom(100), os.urandom(CS)
    await fs.write(f.fh, 0, old)  # chunk 0, held
    await fs.write(f.fh, 10, new)  # chunk 0 again: must wait for the first
    await fs.write(f.fh, CS, other)  # chunk 1: goes ahead
    await held.wait()
    with trio.fail_after(10):
        while ("done", 1, CS) not in log:
            await trio.sleep(0.01)
    assert ("start", 0, 100) not in log  # still behind the held write
    release.set()
    await fs.flush(f.fh)
    assert log.index(("start", 0, 100)) > log.index(("done", 0, CS))
    want = old[:10] + new + old[110:] + other
    assert await fs.read(f.fh, 0, 2 * CS) == want
    await fs.release(f.fh)


async def test_small_writes_behind_a_sent_one_go_as_one(fs: FileSystem) -> None:
    """While a chunk's first write is on its way, the writes that continue
    what waits behind it join it: 20 small writes cost 2 chain writes (the
    bytes in their order), and a write elsewhere in the chunk still waits
    its turn."""
    f = await create(fs, b"joined")
    real: WritePiece = fs.storage.writes.write_piece
    held = trio.Event()
    release = trio.Event()
    sent: list[tuple[int, int]] = []  # (offset in the chunk, length)

    async def write_piece(ino: int, layout: Layout, p: Piece, data: memoryview) -> None:
        sent.append((p[2], p[3]))
        if not held.is_set():
            held.set()
            await release.wait()
        await real(ino, layout, p, data)

    fs.storage.writes.write_piece = write_piece  # type: ignore[method-assign]
    data = os.urandom(20 * 1000)
    for i in range(20):
        buf = bytearray(data[i * 1000 : (i + 1) * 1000])
        await fs.write(f.fh, i * 1000, buf)
        buf[:] = bytes(1000)  # the caller reuses its buffer: what was written stays
    await held.wait()
    await fs.write(f.fh, 5, b"again")  # not a continuation: after the joined piece
    release.set()
    await fs.flush(f.fh)
    assert sent == [(0, 1000), (1000, 19000), (5, 5)]
    assert await fs.read(f.fh, 0, len(data)) == data[:5] + b"again" + data[10:]
    await fs.release(f.fh)


async def test_buffers_handed_over_are_sent_as_they_are(fs: FileSystem) -> None:
    """`bytes`, and a buffer written with ``owned=True`` (the import's), go
    to the storage client as they are, not copied; one that more joins
    while it waits is copied then, and the caller's buffer is left alone."""
    f = await create(fs, b"handed")
    real: WritePiece = fs.storage.writes.write_piece
    held = trio.Event()
    release = trio.Event()
    sent: list[tuple[int, object]] = []  # (offset in the chunk, the buffer the bytes are in)

    async def write_piece(ino: int, layout: Layout, p: Piece, data: memoryview) -> None:
        sent.append((p[2], data.obj))
        if not held.is_set():
            held.set()
            await release.wait()
        await real(ino, layout, p, data)

    fs.storage.writes.write_piece = write_piece  # type: ignore[method-assign]
    first = bytearray(os.urandom(1000))
    await fs.write(f.fh, 0, first, owned=True)  # sent at once, then held
    await held.wait()
    second, third = os.urandom(1000), bytearray(os.urandom(1000))
    await fs.write(f.fh, 1000, second)  # waits behind the first, as it is
    await fs.write(f.fh, 2000, third, owned=True)  # joins the second: copied now
    release.set()
    await fs.flush(f.fh)
    assert [offset for offset, _ in sent] == [0, 1000]
    assert sent[0][1] is first  # not copied
    assert sent[1][1] is not second and sent[1][1] is not third  # joined in a copy
    assert await fs.read(f.fh, 0, 3000) == first + second + third
    await fs.release(f.fh)


async def test_write_failure_is_reported_at_flush(
    meta_cluster: ChainCluster, open_fs: OpenFs
) -> None:
    fs = await open_fs(ClientOptions(local_reads=False, retry_budget=1.0))
    f = await create(fs, b"doomed")
    for node in meta_cluster.nodes:
        await meta_cluster.stop_node(node, clean=False)  # mgmtd is not told
    assert await fs.write(f.fh, 0, b"x" * 100) == 100  # behind: accepted at once
    with pytest.raises(FsError) as info:
        await fs.flush(f.fh)
    assert info.value.code in TRANSIENT
    assert "an earlier write failed" in info.value.message
    await fs.flush(f.fh)  # reported once; the length still reaches the metadata server
    assert (await fs.getattr(f.ino))["size"] == 100
    await fs.release(f.fh)


async def test_an_explicit_mtime_after_writes_is_kept_and_a_refused_one_is_not(
    fs: FileSystem, open_fs: OpenFs
) -> None:
    """cp -p sets times on the open file while its writes are still behind:
    the mtime it set stands after the close's length report, with no wait
    for the writes; a setattr the server refuses leaves the writes' time."""
    other = await open_fs(ClientOptions(local_reads=False))
    f = await create(fs, b"kept")
    await fs.write(f.fh, 0, b"a" * 1000)
    await fs.setattr(f.ino, mtime=5_000_000_000)  # explicit, writes unreported
    assert (await fs.getattr(f.ino))["mtime"] == 5_000_000_000  # what this client shows
    await fs.release(f.fh)  # reports the length, not the writes' time
    attr = await other.lookup(ROOT_INODE, b"kept")
    assert (attr["size"], attr["mtime"]) == (1000, 5_000_000_000)

    g = await create(fs, b"refused")
    before = (await fs.getattr(g.ino))["mtime"]
    await fs.write(g.fh, 0, b"b" * 1000)
    with pytest.raises(FsError):
        await fs.setattr(g.ino, mtime=2**63)  # out of range: EINVAL
    await fs.release(g.fh)
    attr = await other.lookup(ROOT_INODE, b"refused")
    assert attr["size"] == 1000 and attr["mtime"] > before  # the writes' time
    assert attr["mtime"] != 2**63


async def test_a_reply_answered_before_a_length_report_never_shrinks_the_file(
    fs: FileSystem,
) -> None:
    """A lookup answered before the close's length report landed, whose reply
    is handled after the report's (trio runs the tasks of replies that come
    in together in any order): this client keeps the newer size (by the
    attributes' change counter), for what it reports and for its reads."""
    f = await create(fs, b"late")
    stale = await fs.meta.call_read("lookup", lambda m: m.lookup(ROOT_INODE, b"late"))
    assert stale["size"] == 0
    await fs.write(f.fh, 0, b"c" * 1000)
    await fs.flush(f.fh)  # the length report lands: size 1000
    assert fs.overlay(stale)["size"] == 1000  # the late reply of the lookup
    assert fs.known_size(f.ino) == 1000
    assert bytes(await fs.read(f.fh, 0, 4096)) == b"c" * 1000
    fresh = await fs.lookup(ROOT_INODE, b"late")
    assert fresh["size"] == 1000 and fresh["change"] > stale["change"]
    await fs.release(f.fh)
    # handled after the close too (a writeback mount closes in the
    # background while the writer lists the directory), and after a reopen
    assert fs.overlay(stale)["size"] == 1000
    g, attr = await fs.open(f.ino, os.O_RDONLY)
    assert attr["size"] == 1000 and fs.overlay(stale)["size"] == 1000
    await fs.release(g.fh)
    # a newer reply (another client's truncate) is taken as it is
    other = await fs.meta.call_idempotent("setattr", lambda m: m.setattr(f.ino, size=10))
    assert fs.overlay(other)["size"] == 10 and fs.overlay(stale)["size"] == 10


async def test_a_write_goes_behind_at_once_only_with_room_and_nothing_to_report(
    fs: FileSystem,
) -> None:
    """`write_now` (a mount's WRITE answered in libfuse's callback) queues a
    write exactly as `write` does when that needs no wait; with an earlier
    failure to report, or no room behind, it does nothing and `write` decides."""
    f = await create(fs, b"now")
    st = fs.inodes[f.ino]
    assert fs.write_now(f.fh, 0, b"a" * 1000) == 1000
    assert st.dirty and st.size == 1000
    st.pending_bytes += fs.write_behind.limit  # (as if that much were still in flight)
    assert fs.write_now(f.fh, 1000, b"b" * 10) is None
    st.pending_bytes -= fs.write_behind.limit
    st.error = FsError(errno.EIO, "an earlier write failed")
    assert fs.write_now(f.fh, 1000, b"b" * 10) is None
    with pytest.raises(FsError):
        await fs.write(f.fh, 1000, b"b" * 10)  # reported by the usual way, once
    assert fs.write_now(f.fh, 1000, b"b" * 10) == 10
    assert fs.write_now(f.fh, 0, b"") is None  # (nothing to queue)
    await fs.release(f.fh)
    g, attr = await fs.open(f.ino, os.O_RDONLY)
    assert attr["size"] == 1010
    assert bytes(await fs.read(g.fh, 0, 2000)) == b"a" * 1000 + b"b" * 10
    await fs.release(g.fh)


async def test_attributes_set_behind_go_with_the_close_and_show_meanwhile(
    fs: FileSystem,
) -> None:
    """`setattr_behind` (a writeback mount's chmod, chown, utime of a file
    it writes): answered at once and laid over every reply of the file; the
    server has them after the close, never before (nothing else sent them)."""

    async def server(ino: int) -> dict[str, int]:
        return dict(await fs.meta.call_read("getattr", lambda m: m.getattr(ino)))

    f = await create(fs, b"tarred")
    await fs.write(f.fh, 0, b"t" * 100)
    shown = fs.setattr_behind(f.ino, {"mode": 0o600, "uid": 7, "gid": 8, "mtime": 10**18}, 60.0)
    assert shown is not None and shown["mode"] == 0o100600
    assert (shown["uid"], shown["gid"], shown["mtime"], shown["size"]) == (7, 8, 10**18, 100)
    before = await server(f.ino)
    assert before["mode"] != 0o100600 and before["uid"] != 7
    assert (await fs.getattr(f.ino))["mode"] == 0o100600  # over the server's reply
    assert fs.written_attr(f.ino, 60.0) is not None
    with pytest.raises(FsError) as bad:
        fs.setattr_behind(f.ino, {"uid": -1}, 60.0)  # refused now, as the server would
    assert bad.value.code == errno.EINVAL
    await fs.release(f.fh)
    after = await server(f.ino)
    assert (after["mode"], after["uid"], after["gid"]) == (0o100600, 7, 8)
    assert (after["mtime"], after["size"]) == (10**18, 100)
    # not open for writing here: the caller sends them itself
    assert fs.setattr_behind(f.ino, {"mode": 0o644}, 60.0) is None
    assert fs.written_attr(f.ino, 60.0) is None
    g, _ = await fs.open(f.ino, os.O_RDONLY)
    assert fs.setattr_behind(f.ino, {"mode": 0o644}, 60.0) is None
    await fs.release(g.fh)


async def test_attributes_set_behind_give_way_to_later_writes_setattrs_and_fsync(
    fs: FileSystem,
) -> None:
    """A write after a time set behind has its own time; a setattr sent now
    carries what is owed under its own values; fsync sends what is owed."""

    async def server(ino: int) -> dict[str, int]:
        return dict(await fs.meta.call_read("getattr", lambda m: m.getattr(ino)))

    f = await create(fs, b"owed")
    assert fs.setattr_behind(f.ino, {"mtime": 5, "atime": 6}, 60.0) is not None
    await fs.write(f.fh, 0, b"w" * 10)  # after the utime: the write's time wins
    await fs.release(f.fh)
    after = await server(f.ino)
    assert after["atime"] == 6 and after["mtime"] > 10**18

    g, _ = await fs.open(f.ino, os.O_RDWR)
    assert fs.setattr_behind(f.ino, {"mode": 0o640, "gid": 3}, 60.0) is not None
    await fs.setattr(f.ino, mode=0o604)  # sent now, with the owed gid under it
    assert fs.inodes[f.ino].owed == {}
    now = await server(f.ino)
    assert (now["mode"], now["gid"]) == (0o100604, 3)
    assert fs.setattr_behind(f.ino, {"uid": 9}, 60.0) is not None
    await fs.fsync(g.fh)  # durable and seen by others before the close
    assert (await server(f.ino))["uid"] == 9
    await fs.release(g.fh)
    assert (await server(f.ino))["uid"] == 9


async def test_attributes_are_not_set_behind_over_a_change_no_reply_told_of(
    fs: FileSystem,
) -> None:
    """After this client's unlink of a file it writes (its link count
    changed, and no reply said so), a setattr of it is not answered from
    what the client holds, nor after a late reply read before the unlink:
    the caller sends it, and the server's reply has the link count (CI: an
    fstat of a file open for writing on a writeback mount showed nlink 1
    after its last name was unlinked)."""
    f = await create(fs, b"unlinked")
    assert fs.setattr_behind(f.ino, {"mode": 0o600}, 60.0) is not None
    await fs.unlink(ROOT_INODE, b"unlinked")
    st = fs.inodes[f.ino]
    assert st.attr is not None
    st.newest(dict(st.attr))  # type: ignore[arg-type]  # a reply read before the unlink, late
    assert fs.setattr_behind(f.ino, {"mode": 0o644}, 60.0) is None
    assert fs.written_attr(f.ino, 60.0) is None
    assert (await fs.setattr(f.ino, mode=0o644))["nlink"] == 0
    assert fs.setattr_behind(f.ino, {"mode": 0o640}, 60.0) is not None  # fresh again
    await fs.release(f.fh)
