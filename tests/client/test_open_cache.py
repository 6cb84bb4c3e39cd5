"""Read-only opens answered from the client's cache (client/open_cache.py),
against the real metadata server and storage daemons in this process; the
server's own per-method request counts (`rpc_calls`) show what each open cost.

* revalidate (the read-write mount): a cached open costs one getattr and no
  open/release (overlapping ones share a getattrs call); a change closed
  elsewhere is seen by the next open;
* trust (the -o ro mount): a cached open costs nothing; a change is seen once
  attributes fetched for any reason show the new change counter;
* a cached handle is a real handle: a file unlinked elsewhere keeps its data
  until the handle lingers out, and session renewals report it; handles that
  linger out together go back in one call.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable

import pytest
import trio
from clusters import ChainCluster

from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.errors import FsError

OpenFs = Callable[[ClientOptions], Awaitable[FileSystem]]  # the `open_fs` fixture
DATA = b"sample " * 1000


async def calls(fs: FileSystem) -> dict[str, int]:
    address = fs.routing.current.meta_address()
    result: dict[str, int] = await fs.rpc.call(address, "rpc_calls", {}, timeout=5.0)
    return result


async def put(fs: FileSystem, name: bytes, data: bytes) -> int:
    """Create (or overwrite in place) and close: close-to-open's 'close'."""
    try:
        ino = (await fs.lookup(ROOT_INODE, name))["ino"]
        f, _ = await fs.open(ino, os.O_WRONLY)
    except FsError:
        f, _ = await fs.create(ROOT_INODE, name, 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
    await fs.write(f.fh, 0, data)
    await fs.release(f.fh)
    return f.ino


async def read(fs: FileSystem, ino: int) -> bytes:
    f, attr = await fs.open(ino, os.O_RDONLY)
    try:
        return bytes(await fs.read(f.fh, 0, attr["size"] + 1))
    finally:
        await fs.release(f.fh)


def delta(before: dict[str, int], after: dict[str, int], *methods: str) -> tuple[int, ...]:
    return tuple(after.get(m, 0) - before.get(m, 0) for m in methods)


async def test_revalidated_open_costs_one_getattr_and_sees_closed_changes(
    open_fs: OpenFs,
) -> None:
    writer = await open_fs(ClientOptions(local_reads=False))
    reader = await open_fs(ClientOptions(local_reads=False, open_linger=30.0, cache_watch=False))
    ino = await put(writer, b"f", DATA)
    assert await read(reader, ino) == DATA  # opened afresh, handle kept
    before = await calls(reader)
    for _ in range(5):
        assert await read(reader, ino) == DATA
    after = await calls(reader)
    assert delta(before, after, "open", "release", "getattr") == (0, 0, 5)
    assert reader.open_cache.hits == 5

    # same size, in place: only the change counter tells the two apart
    await put(writer, b"f", DATA.upper())
    before = await calls(reader)
    assert await read(reader, ino) == DATA.upper()
    # the revalidation, then a fresh open (and the stale handle given back)
    assert delta(before, await calls(reader), "getattr", "open", "release") == (1, 1, 1)


async def test_concurrent_revalidations_go_in_one_call_and_see_closed_changes(
    open_fs: OpenFs,
) -> None:
    """Opens that overlap (a loader's workers) revalidate in one `getattrs`
    call (client/open_batch.py), each still seeing what was closed before it;
    so do the opens once the handles lingered out (`open_read_only`)."""
    writer = await open_fs(ClientOptions(local_reads=False))
    reader = await open_fs(ClientOptions(local_reads=False, open_linger=30.0, cache_watch=False))
    inos = [await put(writer, b"c%d" % i, DATA) for i in range(8)]
    for ino in inos:
        assert await read(reader, ino) == DATA
    await put(writer, b"c3", DATA.upper())  # closed before the opens below
    got: dict[int, bytes] = {}

    async def one_of(fs: FileSystem, ino: int) -> None:
        got[ino] = await read(fs, ino)

    async def one(ino: int) -> None:
        await one_of(reader, ino)

    before = await calls(reader)
    async with trio.open_nursery() as nursery:
        for ino in inos:
            nursery.start_soon(one, ino)
    single, batched = delta(before, await calls(reader), "getattr", "getattrs")
    assert got == {ino: DATA.upper() if ino == inos[3] else DATA for ino in inos}
    assert batched >= 1 and single + batched <= 3, (single, batched)
    assert reader.read_only.attr_batch.asked >= 5

    # handles lingered out (an epoch longer than handle_linger): the opens
    # go together the same way, each with a handle of its own
    brief = await open_fs(ClientOptions(local_reads=False, open_linger=0.2))
    for ino in inos:
        await read(brief, ino)
    with trio.fail_after(10):
        while brief.open_cache.entries:
            await trio.sleep(0.1)
    await put(writer, b"c5", DATA.upper())
    got.clear()
    before = await calls(brief)
    async with trio.open_nursery() as nursery:
        for ino in [*inos, inos[0]]:  # inos[0] twice: two handles
            nursery.start_soon(lambda ino: one_of(brief, ino), ino)
    single, batched = delta(before, await calls(brief), "open", "open_read_only")
    assert got == {ino: DATA.upper() if ino in (inos[3], inos[5]) else DATA for ino in inos}
    assert batched >= 1 and single + batched <= 3, (single, batched)
    assert brief.read_only.open_batch.asked >= 6


async def test_trusted_open_costs_nothing_until_attributes_show_a_change(
    open_fs: OpenFs,
) -> None:
    writer = await open_fs(ClientOptions(local_reads=False))
    reader = await open_fs(
        ClientOptions(local_reads=False, open_linger=30.0, trust_open_cache=True)
    )
    ino = await put(writer, b"g", DATA)
    assert await read(reader, ino) == DATA
    before = await calls(reader)
    for _ in range(5):
        assert await read(reader, ino) == DATA
    assert delta(before, await calls(reader), "open", "release", "getattr") == (0, 0, 0)

    longer = DATA + b"more"
    await put(writer, b"g", longer)
    # the size the reader knows is the cached one: what the kernel would
    # also show until its attr_timeout ran out
    assert await read(reader, ino) == longer[: len(DATA)]
    await reader.getattr(ino)  # the kernel asking again after attr_timeout
    assert await read(reader, ino) == longer


async def test_cached_handle_keeps_an_unlinked_file_until_it_lingers_out(
    open_fs: OpenFs, meta_cluster: ChainCluster
) -> None:
    writer = await open_fs(ClientOptions(local_reads=False))
    # (a cache watch would drop the entry at the unlink: see the watch's test)
    reader = await open_fs(ClientOptions(local_reads=False, open_linger=1.0, cache_watch=False))
    ino = await put(writer, b"h", DATA)
    other = await put(writer, b"h2", DATA)
    before = await calls(reader)
    assert await read(reader, ino) == DATA
    assert await read(reader, other) == DATA
    held = [[ino, h] for i, h in reader.open_cache.handles() if i == ino]
    assert held and all(p in reader._read_only_handles() for p in held)  # renewals report it

    await writer.unlink(ROOT_INODE, b"h")
    attr = await writer.getattr(ino)  # kept: the reader's cached handle holds it
    assert attr["nlink"] == 0

    stub = MetaStub(writer.rpc, writer.routing.current.meta_address())

    async def gone() -> bool:
        try:
            await writer.getattr(ino)
        except FsError:
            return True
        return False

    # (generous: the free waits for the linger, a sweep and the metadata
    # server's commits, and this VM's disk stalls fsyncs for seconds at times)
    with trio.fail_after(60):
        while not await gone():
            await trio.sleep(0.1)
    assert reader.open_cache.handles() == []
    # idle handles go back in one call per sweep (an epoch longer than the
    # linger expires one per sample), the unlinked file's last one freeing it
    gave_back = delta(before, await calls(reader), "release", "release_read_only")
    assert gave_back[0] == 0 and 1 <= gave_back[1] <= 2
    mine = [s for s in await stub.sessions() if s["session"] == reader.session.id]
    assert mine and mine[0]["open_ro"] == 0 and mine[0]["mount"] is None


async def test_an_open_for_writing_does_not_reach_a_file_only_the_cache_kept(
    open_fs: OpenFs,
) -> None:
    """A name removed elsewhere, opened through a stale name for writing (what
    `O_CREAT` through a cached dentry does): the cached handle is given back
    first, so the server answers ENOENT (the mount turns it into ESTALE and
    the kernel creates the file anew) instead of writing into the removed one."""
    writer = await open_fs(ClientOptions(local_reads=False))
    reader = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    ino = await put(writer, b"w", DATA)
    assert await read(reader, ino) == DATA
    await writer.unlink(ROOT_INODE, b"w")
    with pytest.raises(FsError) as err:
        await reader.open(ino, os.O_WRONLY)
    assert err.value.code == errno.ENOENT
    assert reader.open_cache.handles() == []


async def test_watched_open_costs_nothing_and_sees_closed_changes(open_fs: OpenFs) -> None:
    """With a cache watch (the read-write mount's default), an open of a
    cached file asks nothing, and a change closed elsewhere is still seen by
    the next open: the writer's close returned only once the reader had
    dropped its entry (metadata/cache_watch.py)."""
    writer = await open_fs(ClientOptions(local_reads=False))
    reader = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    assert reader.cache_watch is not None and writer.cache_watch is None
    ino = await put(writer, b"cw", DATA)
    assert await read(reader, ino) == DATA
    methods = ("open", "release", "getattr", "getattrs", "open_read_only")
    before = await calls(reader)
    for _ in range(5):
        assert await read(reader, ino) == DATA
    assert delta(before, await calls(reader), *methods) == (0, 0, 0, 0, 0)
    assert reader.open_cache.hits == 5

    for round_ in range(3):  # same size, in place: only the change counter differs
        data = DATA.upper() if round_ % 2 == 0 else DATA
        await put(writer, b"cw", data)
        assert ino not in reader.open_cache.entries  # dropped before the close returned
        assert await read(reader, ino) == data
        assert await read(reader, ino) == data  # the fresh open is trusted in turn
    await writer.unlink(ROOT_INODE, b"cw")
    assert ino not in reader.open_cache.entries
    # opened afresh: removed (the mount answers ESTALE, and the kernel
    # looks the name up again), or gone once the dropped handle went back
    try:
        f, attr = await reader.open(ino, os.O_RDONLY)
    except FsError as exc:
        assert exc.code == errno.ENOENT
    else:
        assert attr["nlink"] == 0
        await reader.release(f.fh)


async def test_a_silent_watcher_holds_a_writer_only_for_its_lease(open_fs: OpenFs) -> None:
    """A reader whose watch stops answering (a stopped or cut-off mount)
    delays the close of a writer of a file it caches until its lease is
    over, and then no longer trusts its cache: its next open revalidates and
    sees the change."""
    writer = await open_fs(ClientOptions(local_reads=False))
    reader = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    watch = reader.cache_watch
    assert watch is not None
    ino = await put(writer, b"quiet", DATA)
    assert await read(reader, ino) == DATA
    watch._scope.cancel()  # silent from now on, as far as the server knows
    with trio.fail_after(30):  # generous: at most a lease, a poll and a margin
        await put(writer, b"quiet", DATA.upper())
    assert not watch.trusts(ino, reader.open_cache.entries[ino].attr["change"], watch.stamp())
    before = await calls(reader)
    assert await read(reader, ino) == DATA.upper()
    assert delta(before, await calls(reader), "getattr")[0] == 1  # revalidated


async def test_a_new_watcher_drops_every_cached_open(open_fs: OpenFs) -> None:
    """A reply with a token the client does not know (its watcher was
    dropped, the server restarted or another was promoted) means the server
    does not know what this client caches: every entry goes."""
    writer = await open_fs(ClientOptions(local_reads=False))
    reader = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    watch = reader.cache_watch
    assert watch is not None
    inos = [await put(writer, b"t%d" % i, DATA) for i in range(3)]
    for ino in inos:
        assert await read(reader, ino) == DATA
    generation = watch.generation
    watch.token ^= 1  # as if the server had never seen ours
    with trio.fail_after(10):
        while watch.generation == generation:
            await trio.sleep(0.05)
    assert reader.open_cache.entries == {}
    for ino in inos:
        assert await read(reader, ino) == DATA
    before = await calls(reader)
    assert await read(reader, inos[0]) == DATA
    assert delta(before, await calls(reader), "getattr", "open")[0:2] == (0, 0)


async def test_a_watched_listing_is_told_of_each_change_once(open_fs: OpenFs) -> None:
    """A first page read with `watch` makes the server tell the reader's
    watch of the directory's next change before that change is acknowledged
    (the mount then drops the kernel's listing): a create, an unlink, a
    rename in it, a mkdir. Told once: the next listing watches again. Bad
    requests get a clear error and watch nothing."""
    writer = await open_fs(ClientOptions(local_reads=False))
    reader = await open_fs(ClientOptions(local_reads=False, open_linger=30.0))
    watch = reader.cache_watch
    assert watch is not None
    told: list[int] = []
    watch.dir_changed = told.append
    d = (await writer.mkdir(ROOT_INODE, b"listed", 0o755, 0, 0))["ino"]
    f, _ = await writer.create(d, b"a", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
    await writer.release(f.fh)

    async def listed() -> list[bytes]:
        page = await reader.readdir(d, None, 256, watch=True)
        return [name for name, _ in page["entries"]]

    changes: list[Callable[[], Awaitable[object]]] = [
        lambda: writer.create(d, b"b", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0),
        lambda: writer.unlink(d, b"a"),
        lambda: writer.rename(d, b"b", d, b"c"),
        lambda: writer.mkdir(d, b"sub", 0o755, 0, 0),
    ]
    want = [[b"a", b"b"], [b"b"], [b"c"], [b"c", b"sub"]]
    assert await listed() == [b"a"]
    for n, (change, names) in enumerate(zip(changes, want, strict=True)):
        attr = watch.dir_attr(d)
        assert attr is not None and attr["ino"] == d
        result = await change()
        if isinstance(result, tuple):  # a create: close it
            await writer.release(result[0].fh)
        assert watch.dir_attr(d) is None  # dropped before the change returned
        assert told == [d] * (n + 1)
        assert await listed() == names  # and watched again
    # bad requests: a file, no such inode, a session the server never gave
    session = reader.session.id
    for ino, sess, code in ((d + 10_000, session, errno.ENOENT), (d, 1 << 60, None)):
        with pytest.raises(FsError) as err:
            await reader.meta.call_idempotent(
                "watch_dir",
                lambda m, i=ino, s=sess: m.watch_dir(s, i, 10),  # type: ignore[misc]
            )
        assert code is None or err.value.code == code
    f, attr = await writer.create(d, b"file", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
    await writer.release(f.fh)
    with pytest.raises(FsError) as err:
        await reader.meta.call_idempotent("watch_dir", lambda m: m.watch_dir(session, f.ino, 10))
    assert err.value.code == errno.ENOTDIR
