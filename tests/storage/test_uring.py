"""Disk reads through io_uring (storage/uring.py) and the storage daemon's
cold reads that use them (storage/read_service.py): exact bytes at every
offset and edge, errors per read, buffers the kernel owns until it is done,
and every block still verified before it is served; and writes through the
ring (what the mount stores in the kernel's page cache with)."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import flip

from shufflefs.storage import uring, uring_threads
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.service import StorageService
from shufflefs.storage.store import NOWAIT_MAX, ChunkStore

CS = 1 << 16

pytestmark = pytest.mark.skipif(not uring.available(), reason="no io_uring here")


@pytest.fixture
def blob(tmp_path: Path) -> tuple[int, bytes]:
    data = os.urandom(300_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    return fd, data


def as_reads(requests: list[tuple[int, int, int]]) -> list[uring.FileRead]:
    """(fd, length, offset) requests as `open_and_read` takes them (a fresh buffer each)."""
    return [(fd, bytearray(n), offset) for fd, n, offset in requests]


def bytes_read(
    reads: list[uring.FileRead], outcomes: list[uring.FileOutcome]
) -> list[bytes | OSError]:
    """Each read's bytes (short at the file's end) or its error."""
    return [
        n if isinstance(n, OSError) else bytes(buf[:n])
        for (_, buf, _), (_, n) in zip(reads, outcomes, strict=True)
    ]


async def pread(ring: uring.UringReads, fd: int, length: int, offset: int) -> bytes:
    """One read through the loop's ring, as `os.pread` (its error raised)."""
    reads = as_reads([(fd, length, offset)])
    (result,) = bytes_read(reads, await ring.open_and_read(reads))
    if isinstance(result, OSError):
        raise result
    return result


def requests_and_expected(fd: int, data: bytes) -> tuple[list[tuple[int, int, int]], list[bytes]]:
    reqs = [(fd, 4096, 0), (fd, 1000, 12345), (fd, 0, 10), (fd, 5000, len(data) - 100)]
    reqs += [(fd, 777, k * 997) for k in range(uring.ENTRIES + 40)]  # more than one ring's worth
    return reqs, [data[o : o + n] for _, n, o in reqs]


async def test_async_reads_give_exact_bytes_and_errors_per_read(blob: tuple[int, bytes]) -> None:
    fd, data = blob
    ring = uring.for_this_run()
    assert ring is not None and uring.for_this_run() is ring  # one per run
    reqs, expected = requests_and_expected(fd, data)
    reads = as_reads([*reqs, (999_999, 10, 0)])
    out = bytes_read(reads, await ring.open_and_read(reads))
    assert out[:-1] == expected  # short at the end, empty for 0 bytes
    last = out[-1]
    assert isinstance(last, OSError) and last.errno == errno.EBADF
    assert await pread(ring, fd, 10, 5) == data[5:15]
    with pytest.raises(OSError) as err:
        await pread(ring, 999_999, 10, 0)
    assert err.value.errno == errno.EBADF
    # concurrent callers, more than the ring holds at once
    results: dict[int, bytes] = {}

    async def one(k: int) -> None:
        results[k] = await pread(ring, fd, 333, k * 500)

    async with trio.open_nursery() as nursery:
        for k in range(2 * uring.ENTRIES):
            nursery.start_soon(one, k)
    assert all(results[k] == data[k * 500 : k * 500 + 333] for k in results)


async def test_a_cancelled_reader_waits_until_the_kernel_is_done(blob: tuple[int, bytes]) -> None:
    """Cancelling a reader cannot free a buffer the kernel still writes into:
    the read finishes first (shielded), and a cancelled caller leaves nothing
    in flight behind it."""
    fd, data = blob
    ring = uring.for_this_run()
    assert ring is not None
    with trio.CancelScope() as scope:
        scope.cancel()
        reads = as_reads([(fd, 100_000, 0)])
        outcomes = await ring.open_and_read(reads)
    assert bytes_read(reads, outcomes)[0] == data[:100_000]
    assert ring._in_flight == {}


def test_blocking_reads_give_exact_bytes_and_errors_per_read(blob: tuple[int, bytes]) -> None:
    fd, data = blob
    ring = uring_threads.for_this_thread()
    assert ring is not None and uring_threads.for_this_thread() is ring
    reqs, expected = requests_and_expected(fd, data)
    reads = as_reads([(999_999, 10, 0), *reqs])
    out = bytes_read(reads, ring.open_and_read(reads))
    first = out[0]
    assert isinstance(first, OSError) and first.errno == errno.EBADF
    assert out[1:] == expected
    other: list[object] = []
    thread = threading.Thread(target=lambda: other.append(uring_threads.for_this_thread()))
    thread.start()
    thread.join()
    assert other[0] is not ring  # one ring per thread


def test_off_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHUFFLEFS_NO_URING", "1")
    assert uring.UringReads.open() is None and not uring.available()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    s = ChunkStore(tmp_path / "t1", block_size=512, fsync=False, reserve_bytes=0)
    s.set_identity(1, "test")
    yield s
    s.close()


async def test_cold_reads_through_the_ring_are_verified(store: ChunkStore) -> None:
    """Cold items (record and file cached, bytes not in the page cache:
    read_nowait declines) are read through the ring, on the event loop and on
    a channel's thread, and give exactly what `read` gives; a byte flipped on
    disk fails its item with EIO and its block never leaves."""
    service = StorageService([store], io_threads=4)
    blobs = {i: os.urandom(3000 + 100 * i) for i in range(8)}
    for i, data in blobs.items():
        await service.write(1, 0, 0, chunk_id(8, i), 0, CS, data)
    store.read_nowait = lambda *args: None  # type: ignore[method-assign]
    items = [(1, chunk_id(8, i), 100, 2500) for i in blobs]
    items += [(1, chunk_id(8, 0), 2900, 500)]  # short: the chunk ends at 3000
    expected = [blobs[i][100:2600] for i in blobs] + [blobs[0][2900:]]

    ring = uring.for_this_run()
    assert ring is not None
    before = ring.reads
    reply = await service.read(items)
    assert reply.result["lengths"] == [len(e) for e in expected]
    assert b"".join(bytes(p) for p in reply.payload) == b"".join(expected)  # type: ignore[union-attr]
    assert ring.reads - before == len(items)  # every one through the ring

    big = os.urandom(NOWAIT_MAX + 512)  # its checksums are computed in a thread, off the loop
    await service.write(1, 0, 0, chunk_id(9, 0), 0, 1 << 20, big)
    before = ring.reads
    reply = await service.read([(1, chunk_id(9, 0), 0, len(big))])
    assert b"".join(bytes(p) for p in reply.payload) == big  # type: ignore[union-attr]
    assert ring.reads == before

    reply = await trio.to_thread.run_sync(service.read_sync, items)
    assert b"".join(bytes(p) for p in reply.payload) == b"".join(expected)  # type: ignore[union-attr]

    path = store.file_path(chunk_id(8, 2))
    assert path is not None
    flip(path, 700)  # block 1 of chunk 2
    bad = [(1, chunk_id(8, 2), 512, 512), (1, chunk_id(8, 2), 0, 512)]
    for read in (service.read, lambda i: trio.to_thread.run_sync(service.read_sync, i)):
        reply = await read(bad)
        assert reply.result["lengths"] == [-errno.EIO, 512]
        assert b"".join(bytes(p) for p in reply.payload) == blobs[2][:512]  # type: ignore[union-attr]


@pytest.fixture(params=["linked", "followed"])
async def ring(request: pytest.FixtureRequest) -> AsyncIterator[uring.UringReads]:
    """This run's ring, its opens linked to their reads (this kernel has
    direct descriptors), or followed by them as on a kernel without."""
    ring = uring.for_this_run()
    assert ring is not None and ring.opens_linked
    slots = ring._slots
    if request.param == "followed":
        ring._slots = []
    yield ring
    assert ring._in_flight == {} and ring._chains == {}
    ring._slots = slots
    assert sorted(slots) == list(range(uring.ENTRIES))  # every slot back, empty:
    info = Path(f"/proc/self/fdinfo/{ring._ring.ring_fd}").read_text()
    table = info.split("UserFiles:")[1].split("UserBufs:")[0]
    assert "/" not in table  # (no file is held there: a removed one's space is freed)


async def test_open_and_read_opens_each_path_then_reads_it(
    tmp_path: Path, ring: uring.UringReads
) -> None:
    """Paths are opened in the ring and each read follows its own open
    (linked to it, or submitted by the reaper once it is done); an fd is
    read as it is; a path that cannot be opened fails its request alone
    (the open's error for both); a read short of its buffer still gives its
    fd; more requests than the ring holds wait for room; the callback form
    answers on the loop with the same."""
    contents = {}
    for k in range(uring.ENTRIES + 30):
        contents[k] = os.urandom(1000 + k)
        (tmp_path / f"f{k}").write_bytes(contents[k])
    held = os.open(tmp_path / "f0", os.O_RDONLY)
    requests: list[uring.FileRead] = [
        (str(tmp_path / f"f{k}"), bytearray(2000), 7) for k in range(uring.ENTRIES + 30)
    ]
    requests += [(held, bytearray(50), 100), (str(tmp_path / "missing"), bytearray(10), 0)]
    opens = ring.opens
    outcomes = await ring.open_and_read(requests)
    assert ring.opens - opens == uring.ENTRIES + 31
    for k in range(uring.ENTRIES + 30):
        fd, got = outcomes[k]
        assert isinstance(fd, int) and isinstance(got, int), outcomes[k]
        assert bytes(requests[k][1][:got]) == contents[k][7:]
        assert os.pread(fd, 5, 0) == contents[k][:5]  # the caller's fd, open
        os.close(fd)
    assert outcomes[-2] == (held, 50) and bytes(requests[-2][1]) == contents[0][100:150]
    fd, got = outcomes[-1]
    assert isinstance(fd, OSError) and fd.errno == errno.ENOENT
    assert isinstance(got, OSError) and got.errno == errno.ENOENT
    assert ring._in_flight == {}

    done = trio.Event()
    seen: list[list[uring.FileOutcome]] = []

    def then(results: list[uring.FileOutcome]) -> None:
        seen.append(results)
        done.set()

    buf = bytearray(300)
    assert ring.submit([(str(tmp_path / "f3"), buf, 0), (held, bytearray(4), 0)], then)
    await done.wait()
    (fd, got), second = seen[0]
    assert isinstance(fd, int) and got == 300 and bytes(buf) == contents[3][:300]
    assert second == (held, 4)
    os.close(fd)
    os.close(held)


def test_blocking_open_and_read_opens_each_path_then_reads_it(tmp_path: Path) -> None:
    """A thread's ring (a channel's I/O thread): paths opened in the ring
    with the flags asked for, each read following its own open; an fd read
    as it is; a path that cannot be opened fails its request alone; more
    requests than the ring holds go in as others finish."""
    ring = uring_threads.for_this_thread()
    assert ring is not None
    contents = {k: os.urandom(1000 + k) for k in range(uring.ENTRIES + 30)}
    for k, data in contents.items():
        (tmp_path / f"f{k}").write_bytes(data)
    held = os.open(tmp_path / "f0", os.O_RDONLY)
    requests: list[uring.FileRead] = [
        (str(tmp_path / f"f{k}"), bytearray(2000), 7) for k in contents
    ]
    requests += [(held, bytearray(50), 100), (str(tmp_path / "missing"), bytearray(10), 0)]
    opens, reads = ring.opens, ring.reads
    outcomes = ring.open_and_read(requests, writable=True)
    assert ring.opens - opens == len(contents) + 1 and ring.reads - reads == len(contents) + 1
    for k in contents:
        fd, got = outcomes[k]
        assert isinstance(fd, int) and isinstance(got, int), outcomes[k]
        assert bytes(requests[k][1][:got]) == contents[k][7:]
        assert os.pwrite(fd, b"x", 0) == 1  # opened read-write, as asked
        os.close(fd)
    assert outcomes[-2] == (held, 50) and bytes(requests[-2][1]) == contents[0][100:150]
    fd, got = outcomes[-1]
    assert isinstance(fd, OSError) and fd.errno == errno.ENOENT
    assert isinstance(got, OSError) and got.errno == errno.ENOENT
    os.close(held)


async def test_a_channel_thread_opens_files_not_held_in_its_ring(store: ChunkStore) -> None:
    """`read_sync` (a channel's I/O thread) with nothing cached: no record,
    no open file, no page-cache hit. Every file is opened and read in the
    thread's ring, all together; the bytes are exactly `read`'s; the files
    opened are kept for the next reads (read-write: the writes share
    them); a byte flipped on disk still fails its item alone with EIO."""
    service = StorageService([store], io_threads=4)
    blobs = {i: os.urandom(5000 + 300 * i) for i in range(12)}
    for i, data in blobs.items():
        await service.write(1, 0, 0, chunk_id(10, i), 0, CS, data)
    store.read_nowait = lambda *args: None  # type: ignore[method-assign]
    path = store.file_path(chunk_id(10, 4))
    assert path is not None
    flip(path, 1000)  # block 1 of chunk 4
    store._fds.close_all()
    store._records.clear()
    items = [(1, chunk_id(10, i), 200, 4000) for i in blobs]
    items += [(1, chunk_id(10, 0), 4900, 999), (1, chunk_id(10, 99), 0, 10)]  # short; absent

    def read_twice() -> tuple[Any, Any, int, int]:
        ring = uring_threads.for_this_thread()
        assert ring is not None
        opens = ring.opens
        first = service.read_sync(items)
        opened = ring.opens - opens
        return first, service.read_sync(items), opened, ring.opens - opens - opened

    before = store._fds.opened
    first, second, opened, reopened = await trio.to_thread.run_sync(read_twice)
    expected = [b"" if i == 4 else blobs[i][200:4200] for i in blobs] + [blobs[0][4900:], b""]
    for reply in (first, second):
        lengths = reply.result["lengths"]
        assert lengths[4] == -errno.EIO
        assert [n for k, n in enumerate(lengths) if k != 4] == [
            len(e) for k, e in enumerate(expected) if k != 4
        ]
        assert b"".join(bytes(p) for p in reply.payload) == b"".join(expected)
    # the first read opens each file in the ring, for each item (chunk 0's
    # twice: the cache keeps one fd); the second opens none (the damaged
    # chunk's file too: its bytes are bad, not its fd)
    assert (opened, reopened) == (len(blobs) + 1, 0)
    assert store._fds.opened - before >= len(blobs)
    assert_kept_read_write(store, chunk_id(10, 1))

    # the event loop's ring does the same for files not held (records it
    # does not read: these are cached now)
    store._fds.close_all()
    ring = uring.for_this_run()
    assert ring is not None
    opens = ring.opens
    reply = await service.read(items)
    assert reply.result["lengths"] == first.result["lengths"]
    assert b"".join(bytes(p) for p in reply.payload) == b"".join(expected)  # type: ignore[union-attr]
    assert ring.opens - opens == len(blobs) + 1
    assert_kept_read_write(store, chunk_id(10, 1))


def assert_kept_read_write(store: ChunkStore, cid: bytes) -> None:
    """*cid*'s file is in the fd cache, open read-write (the writes use it too)."""
    rec = store._record(cid)
    assert rec is not None
    handle = store._fds.get((cid, rec.generation))
    assert handle is not None
    assert fcntl.fcntl(handle.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    store._fds.release(handle)


async def test_a_cancelled_open_and_read_finishes_before_returning(tmp_path: Path) -> None:
    ring = uring.for_this_run()
    assert ring is not None
    data = os.urandom(50_000)
    (tmp_path / "f").write_bytes(data)
    buf = bytearray(50_000)
    with trio.CancelScope() as scope:
        scope.cancel()
        ((fd, got),) = await ring.open_and_read([(str(tmp_path / "f"), buf, 0)])
    assert isinstance(fd, int) and got == 50_000 and bytes(buf) == data
    os.close(fd)
    assert ring._in_flight == {}


async def test_writes_through_the_ring_land_whole_with_errors_per_write(tmp_path: Path) -> None:
    ring = uring.for_this_run()
    assert ring is not None
    r, w = os.pipe()  # (a pipe keeps each write's bytes together, in order of completion)
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        pieces = [[b"head:", bytearray(os.urandom(5000))] for _ in range(uring.ENTRIES + 10)]
        got = await ring.write_many([(fd, p) for p in pieces] + [(999_999, [b"x"])])
        assert got[:-1] == [5005] * len(pieces)  # more than the ring holds at once
        assert isinstance(got[-1], OSError) and got[-1].errno == errno.EBADF
        written = (tmp_path / "out").read_bytes()
        assert len(written) == 5005 * len(pieces)
        records = {written[k : k + 5005] for k in range(0, len(written), 5005)}
        assert records == {b"head:" + bytes(p[1]) for p in pieces}  # each write whole
        # the buffers are given back once written (no export kept on them)
        buf = bytearray(b"abc")
        assert await ring.write_many([(w, [buf])]) == [3]
        buf.extend(b"d")  # (BufferError if the ring's iovec still held it)
        assert os.read(r, 10) == b"abc"
    finally:
        for f in (fd, r, w):
            os.close(f)


async def test_offloaded_reads_give_the_same_bytes_and_errors(
    tmp_path: Path, ring: uring.UringReads
) -> None:
    """Reads handed to the kernel's io-wq workers (*offload*: the mount's
    loop, waiting on many cold reads, no longer copies their bytes itself)
    read exactly what the others do, from files not in the page cache,
    through an open in the ring or an open fd, with errors per read; and
    are counted."""
    contents = [os.urandom(110_000 + k) for k in range(6)]
    fds = []
    for k, data in enumerate(contents):
        (tmp_path / f"c{k}").write_bytes(data)
        fd = os.open(tmp_path / f"c{k}", os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: the disk's to read
        fds.append(fd)
    requests: list[uring.FileRead] = [(str(tmp_path / "c0"), bytearray(120_000), 0)]
    requests += [(fds[k], bytearray(60_000), 4096 * k) for k in range(1, 6)]
    requests += [(str(tmp_path / "missing"), bytearray(10), 0), (-1, bytearray(10), 0)]
    offloaded = ring.offloaded
    outcomes = await ring.open_and_read(requests, offload=True)
    # every read submitted: a linked one with its open, a followed one
    # after it (so none for the failed open)
    linked = bool(ring._slots)
    assert ring.offloaded - offloaded == (8 if linked else 7)
    fd, got = outcomes[0]
    assert isinstance(fd, int) and got == len(contents[0])
    assert bytes(requests[0][1][:got]) == contents[0]
    os.close(fd)
    for k in range(1, 6):
        assert outcomes[k] == (fds[k], 60_000)
        assert bytes(requests[k][1]) == contents[k][4096 * k : 4096 * k + 60_000]
    missing, bad = outcomes[-2], outcomes[-1]
    assert isinstance(missing[1], OSError) and missing[1].errno == errno.ENOENT
    assert isinstance(bad[1], OSError) and bad[1].errno == errno.EBADF

    done = trio.Event()
    seen: list[list[uring.FileOutcome]] = []

    def then(results: list[uring.FileOutcome]) -> None:
        seen.append(results)
        done.set()

    os.posix_fadvise(fds[1], 0, 0, os.POSIX_FADV_DONTNEED)
    buf = bytearray(100_000)
    assert ring.submit([(fds[1], buf, 5)], then, offload=True)
    await done.wait()
    assert seen == [[(fds[1], 100_000)]] and bytes(buf) == contents[1][5:100_005]
    assert ring.offloaded - offloaded == (9 if linked else 8) and ring._in_flight == {}
    for fd in fds[1:]:
        os.close(fd)
