"""Short-circuit reads: a client on the same host reads chunk files directly
and gets exactly what the daemon would return (committed bytes, verified),
or None where the daemon must answer.

LMDB lets one process open an environment once, so the daemon's side
(`ChunkStore`) and the client's (`LocalTarget`) take turns here; concurrency
between the two is exercised end to end through the mount."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
from procfs import deleted_open_files

from shufflefs.rpc.errors import FsError
from shufflefs.storage import uring
from shufflefs.storage.cached_open import open_cached
from shufflefs.storage.layout import parse_chunk_file_name
from shufflefs.storage.local_read import LocalPlan, LocalTarget
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.store import ChunkStore

CS = 1 << 16


def open_store(path: Path) -> ChunkStore:
    s = ChunkStore(path, block_size=512, fsync=False, reserve_bytes=0)
    s.set_identity(7, "cluster-a")
    return s


def chunk_file(path: Path, cid: bytes) -> Path:
    (found,) = [
        p
        for p in (path / "chunks").rglob("*")
        if p.is_file() and (parsed := parse_chunk_file_name(p.name)) and parsed[0] == cid
    ]
    return found


def test_reads_the_committed_bytes(tmp_path: Path) -> None:
    rng = random.Random(3)
    store = open_store(tmp_path / "t")
    model: dict[bytes, bytearray] = {}
    for index in range(5):
        cid = chunk_id(42, index)
        data = bytearray(rng.randbytes(rng.randrange(1, CS)))
        store.write(cid, 0, CS, data)
        if index % 2:  # an overwrite makes a new generation (copy-on-write)
            store.write(cid, 10, CS, b"overwritten")
            data[10:21] = b"overwritten"
        model[cid] = data
    store.close()
    local = LocalTarget(tmp_path / "t", 7, "cluster-a")
    for cid, data in model.items():
        for _ in range(50):
            off = rng.randrange(0, CS)
            n = min(rng.randrange(1, 9000), CS - off)
            got = local.read(cid, off, n, nowait=False)
            assert got is not None and bytes(got) == bytes(data[off : off + n])
            fast = local.read(cid, off, n, nowait=True)  # None only if not cached
            assert fast is None or bytes(fast) == bytes(data[off : off + n])
    assert local.read(chunk_id(42, 99), 0, 100, False) == b""  # absent: a hole
    local.close()


@pytest.mark.usefixtures("kernel_caches")
def test_a_file_closed_here_is_read_without_waiting_from_the_dentry_cache(
    tmp_path: Path,
) -> None:
    """A reader of one file per sample has each chunk file closed with its
    file (`close_file`): the next read without waiting still answers when
    the chunk file's path and bytes are in the kernel's caches."""
    store = open_store(tmp_path / "t")
    cid = chunk_id(8, 0)
    data = os.urandom(5000)
    store.write(cid, 0, CS, data)
    store.close()
    local = LocalTarget(tmp_path / "t", 7, "cluster-a")
    got = local.read(cid, 0, 5000, nowait=False)
    assert got is not None and bytes(got) == data
    fd = open_cached(str(chunk_file(tmp_path / "t", cid)), os.O_RDONLY)
    if fd is None:
        pytest.skip("no openat2 with RESOLVE_CACHED here")
    os.close(fd)
    local.close_file(8)
    fast = local.read(cid, 100, 4000, nowait=True)
    assert fast is not None and bytes(fast) == data[100:4100]
    local.close()


def test_corrupt_block_is_never_returned(tmp_path: Path) -> None:
    store = open_store(tmp_path / "t")
    cid = chunk_id(5, 0)
    store.write(cid, 0, CS, os.urandom(4096))
    store.close()
    with open(chunk_file(tmp_path / "t", cid), "r+b") as f:
        f.seek(600)
        b = f.read(1)
        f.seek(600)
        f.write(bytes([b[0] ^ 1]))
    local = LocalTarget(tmp_path / "t", 7, "cluster-a")
    assert local.read(cid, 512, 100, False) is None  # the bad block: the daemon answers
    assert local.read(cid, 0, 100, False) is not None  # the others are fine
    local.close()


def test_whole_blocks_are_read_in_place(tmp_path: Path) -> None:
    """With *into*, a range that starts and ends on the checksummed blocks
    (a whole chunk, the committed end) lands straight in the caller's buffer
    and comes back as a view of it; any other range is read apart; a damaged
    block in place is still None (and the buffer's bytes are never returned)."""
    store = open_store(tmp_path / "t")
    cid = chunk_id(6, 0)
    data = os.urandom(3 * 512 + 77)  # three whole blocks and a partial one
    store.write(cid, 0, CS, data)
    store.close()
    local = LocalTarget(tmp_path / "t", 7, "cluster-a")
    out = bytearray(4096)
    view = memoryview(out)
    for off, n, in_place in [
        (0, len(data), True),  # the whole chunk: to its committed end
        (512, 1024, True),  # two whole blocks
        (0, 8192, True),  # past the end: short, in place
        (100, 600, False),  # starts inside a block
        (512, 100, False),  # ends inside a block
    ]:
        into = view[1000 : 1000 + n] if n <= 3000 else view[: len(data)]
        got = local.read(cid, off, n, nowait=False, into=into)
        assert got is not None and bytes(got) == data[off : off + n]
        assert (got.obj is out) == in_place, (off, n)
    with open(chunk_file(tmp_path / "t", cid), "r+b") as f:
        f.seek(700)
        b = f.read(1)
        f.seek(700)
        f.write(bytes([b[0] ^ 1]))
    local.forget()
    assert local.read(cid, 0, len(data), nowait=False, into=view[: len(data)]) is None
    local.close()


def test_follows_truncation_and_removal(tmp_path: Path) -> None:
    store = open_store(tmp_path / "t")
    cid = chunk_id(8, 0)
    store.write(cid, 0, CS, b"x" * 5000)
    store.truncate_file(8, 100, CS)
    other = chunk_id(9, 0)
    store.write(other, 0, CS, b"y" * 10)
    store.remove_file(9)
    store.close()
    local = LocalTarget(tmp_path / "t", 7, "cluster-a")
    assert bytes(local.read(cid, 0, 5000, False) or b"-") == b"x" * 100
    assert local.read(other, 0, 10, False) == b""
    local.close()


def test_refuses_another_target(tmp_path: Path) -> None:
    open_store(tmp_path / "t").close()
    with pytest.raises(FsError) as info:
        LocalTarget(tmp_path / "t", 8, "cluster-a")
    assert info.value.errno == errno.ESTALE
    with pytest.raises(FsError):
        LocalTarget(tmp_path / "t", 7, "cluster-b")


def test_forgetting_a_file_closes_its_chunk_files(tmp_path: Path) -> None:
    """A cached fd would keep a chunk the daemon removed on disk (its space
    never freed): forgetting the file closes them, also for a read in flight."""
    store = open_store(tmp_path / "t")
    for ino in (42, 43):
        for index in range(3):
            store.write(chunk_id(ino, index), 0, CS, b"x" * 1000)
    store.close()
    local = LocalTarget(tmp_path / "t", 7, "cluster-a")
    for ino in (42, 43):
        for index in range(3):
            assert local.read(chunk_id(ino, index), 0, 10, nowait=False) is not None
    for index in range(3):  # what the daemon's remove_file does to the files
        chunk_file(tmp_path / "t", chunk_id(42, index)).unlink()
    assert len(deleted_open_files("self", tmp_path)) == 3
    local.forget_file(43)
    assert len(deleted_open_files("self", tmp_path)) == 3
    local.forget_file(42)
    assert deleted_open_files("self", tmp_path) == []
    # the other file's chunks are read (and cached) again as before
    assert local.read(chunk_id(43, 1), 0, 3, nowait=False) == b"xxx"
    local.forget()
    local.close()


def test_a_busy_fd_is_closed_by_its_last_user(tmp_path: Path) -> None:
    store = open_store(tmp_path / "t")
    cid = chunk_id(9, 0)
    store.write(cid, 0, CS, b"y" * 100)
    rec = store._record(cid)
    assert rec is not None
    store.close()
    local = LocalTarget(tmp_path / "t", 7, "cluster-a")
    assert local.read(cid, 0, 3, nowait=False) == b"yyy"
    handle = local._fds.get((cid, rec.generation))  # as a read in flight holds it
    assert handle is not None
    chunk_file(tmp_path / "t", cid).unlink()
    local.forget([cid])
    # still in use: not closed under the reader
    assert len(deleted_open_files("self", tmp_path)) == 1
    assert os.pread(handle.fd, 3, 0) == b"yyy"
    local._fds.release(handle)
    assert deleted_open_files("self", tmp_path) == []
    local.close()


@pytest.mark.skipif(not uring.available(), reason="no io_uring here")
async def test_cold_plans_open_their_chunk_files_elsewhere(tmp_path: Path) -> None:
    """`plan_cold` opens nothing: a chunk file not open here is named by its
    path, opened in the ring (`open_and_read`) and adopted (`opened`, then
    cached: the next plan has its fd); the bytes are the committed ones,
    verified; a chunk file gone between the plan and the open, or a damaged
    block, is None (the daemon answers), never wrong bytes."""
    store = open_store(tmp_path / "t")
    data = {k: os.urandom(3000 + k) for k in range(3)}
    for k, blob in data.items():
        store.write(chunk_id(20 + k, 0), 0, CS, blob)
    store.close()
    ring = uring.for_this_run()
    assert ring is not None
    local = LocalTarget(tmp_path / "t", 7, "cluster-a")

    async def cold_read(k: int, off: int, n: int) -> memoryview | None:
        plan = local.plan_cold(chunk_id(20 + k, 0), off, n)
        assert isinstance(plan, LocalPlan) and isinstance(plan.buf, bytearray)
        what = plan.path if plan.handle is None else plan.handle.fd
        ((fd, got),) = await ring.open_and_read([(what, plan.buf, plan.start)])
        if plan.handle is None and not local.opened(plan, fd):
            return None
        return local.finish(plan, got)

    first = local.plan_cold(chunk_id(20, 0), 0, 10)
    assert isinstance(first, LocalPlan) and first.handle is None and first.path
    local.finish(first, OSError(errno.ECANCELED, "not read"))
    got = await cold_read(0, 100, 2000)
    assert got is not None and bytes(got) == data[0][100:2100]
    again = local.plan_cold(chunk_id(20, 0), 0, 10)
    assert isinstance(again, LocalPlan) and again.handle is not None  # cached now
    local.finish(again, 10)
    # gone between the plan and the open (a new generation replaced it)
    plan = local.plan_cold(chunk_id(21, 0), 0, 100)
    assert isinstance(plan, LocalPlan) and plan.handle is None
    os.rename(plan.path, plan.path + ".moved")
    ((fd, _),) = await ring.open_and_read([(plan.path, plan.buf, plan.start)])
    assert isinstance(fd, OSError) and not local.opened(plan, fd)
    os.rename(plan.path + ".moved", plan.path)
    got = await cold_read(1, 0, 100)  # looked up afresh: fine again
    assert got is not None and bytes(got) == data[1][:100]
    # a damaged block is never returned
    with open(chunk_file(tmp_path / "t", chunk_id(22, 0)), "r+b") as f:
        f.seek(600)
        b = f.read(1)
        f.seek(600)
        f.write(bytes([b[0] ^ 1]))
    assert await cold_read(2, 512, 100) is None
    assert await cold_read(2, 0, 100) is not None
    assert local.plan_cold(chunk_id(99, 0), 0, 10) == b""  # absent: a hole
    local.close()


def test_a_hosts_targets_together_keep_within_half_the_open_file_limit(tmp_path: Path) -> None:
    """Every local target's reader keeps chunk files open (`FdCache`), all in
    one process: their budgets are shares of its open-file limit for the
    host's number of targets, together at most half of it. Each used to
    take a quarter's share whatever the count, so a host of 16 targets could
    fill its caches past the limit, after which the process could open no
    socket either (EMFILE)."""
    import resource

    open_store(tmp_path / "t").close()
    for targets in (1, 3, 4, 16, 64):
        local = LocalTarget(tmp_path / "t", 7, "cluster-a", host_targets=targets)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert local._fds.capacity * targets <= soft // 2
        local.close()
