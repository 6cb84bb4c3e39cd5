"""ChunkStore's two-step updates: a staged update is durable but invisible
until committed; an abort (or a crash: test_crash.py) leaves no trace."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import NEED_FULL, chunk_id
from shufflefs.storage.store import ChunkStore

CS = 1 << 16
BS = 512


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    with ChunkStore(tmp_path / "t", block_size=BS, fsync=True, reserve_bytes=0) as s:
        yield s


def chunk_files(store: ChunkStore, cid: bytes) -> list[str]:
    folder = store.path / "chunks" / f"{cid[7] ^ cid[11]:02x}"
    return sorted(n for n in os.listdir(folder) if n.startswith(cid.hex()))


def test_staged_append_is_invisible_until_commit(store: ChunkStore) -> None:
    cid = chunk_id(1, 0)
    store.write(cid, 0, CS, b"a" * 1000)
    staged = store.stage_write(cid, 1000, b"b" * 700, CS)
    assert staged.version == 2 and staged.base_version == 1
    assert os.path.getsize(store.file_path(cid) or "") == 1700  # durable on disk already
    assert bytes(store.read(cid, 0, CS)) == b"a" * 1000
    assert store.chunk_info(cid)["version"] == 1 and store.stats()["used"] == 1000
    assert store.staged_content(staged) == b"a" * 1000 + b"b" * 700
    assert store.commit(staged) == {"version": 2, "length": 1700}
    assert bytes(store.read(cid, 0, CS)) == b"a" * 1000 + b"b" * 700
    assert store.stats()["used"] == 1700
    with pytest.raises(FsError) as info:  # a staged update is committed once
        store.commit(staged)
    assert info.value.errno == errno.EINVAL
    store.abort(staged)  # and an abort after it changes nothing
    assert bytes(store.read(cid, 0, CS))[-3:] == b"bbb"


def counters(store: ChunkStore) -> dict[str, int]:
    """The target's own figures; not ``free``, which belongs to the whole
    filesystem (/tmp here, shared with every other process on the machine)."""
    return {k: v for k, v in store.stats().items() if k != "free"}


@pytest.mark.parametrize("kind", ["append", "overwrite", "new", "replace"])
def test_abort_leaves_no_trace(store: ChunkStore, kind: str) -> None:
    cid = chunk_id(2, 0)
    if kind != "new":
        store.write(cid, 0, CS, b"x" * 1500)
    before_files = chunk_files(store, cid)
    before = bytes(store.read(cid, 0, CS))
    stats = counters(store)
    if kind == "append":
        staged = store.stage_write(cid, 1500, b"y" * 100, CS)
    elif kind == "overwrite":
        staged = store.stage_write(cid, 10, b"y" * 100, CS)
        assert len(chunk_files(store, cid)) == 2  # a new generation beside the committed one
    elif kind == "new":
        staged = store.stage_write(cid, 0, b"y" * 100, CS)
        assert len(chunk_files(store, cid)) == 1
    else:
        staged = store.stage_replace(cid, b"z" * 4000, CS, 9)
    assert bytes(store.read(cid, 0, CS)) == before
    store.abort(staged)
    assert chunk_files(store, cid) == before_files
    assert bytes(store.read(cid, 0, CS)) == before
    assert counters(store) == stats
    if kind != "new":
        assert os.path.getsize(store.file_path(cid) or "") == 1500  # the staged tail is cut
        assert store.chunk_info(cid)["version"] == 1
    else:
        assert store.file_path(cid) is None
    # and the chunk takes updates as before
    assert store.write(cid, len(before), CS, b"next")["version"] == (1 if kind == "new" else 2)


def test_versions_decide_delta_or_whole_chunk(store: ChunkStore) -> None:
    cid = chunk_id(3, 0)
    store.write(cid, 0, CS, b"v1")
    with pytest.raises(FsError) as info:  # built on a base we do not hold
        store.stage_write(cid, 2, b"v5", CS, version=5)
    assert info.value.errno == NEED_FULL
    with pytest.raises(FsError) as info:
        store.stage_write(chunk_id(3, 1), 0, b"v2", CS, version=2)  # we lack the chunk
    assert info.value.errno == NEED_FULL
    assert store.commit(store.stage_write(cid, 2, b"v2", CS, version=2))["version"] == 2
    old_files = chunk_files(store, cid)
    # a whole chunk replaces whatever was there, at the version given
    assert store.commit(store.stage_replace(cid, b"R" * 3000, CS, 7)) == {
        "version": 7,
        "length": 3000,
    }
    assert bytes(store.read(cid, 0, CS)) == b"R" * 3000
    assert chunk_files(store, cid) != old_files and len(chunk_files(store, cid)) == 1
    assert store.chunk_info(cid)["crcs"] == store.list_chunks()["chunks"][0]["crcs"]
    noop = store.stage_write(cid, 0, b"", CS)
    assert store.commit(noop) == {"version": 7, "length": 3000}  # zero length: nothing
    with pytest.raises(FsError) as info:
        store.stage_replace(cid, b"x" * (CS + 1), CS, 8)
    assert info.value.errno == errno.EINVAL


def test_commit_refuses_a_changed_base(store: ChunkStore) -> None:
    cid = chunk_id(4, 0)
    store.write(cid, 0, CS, b"base")
    staged = store.stage_write(cid, 0, b"mine", CS)  # copy-on-write
    store.write(cid, 4, CS, b"+other")  # someone else changed the chunk meanwhile
    with pytest.raises(FsError) as info:
        store.commit(staged)
    assert info.value.errno == errno.EAGAIN
    assert bytes(store.read(cid, 0, CS)) == b"base+other"
    assert len(chunk_files(store, cid)) == 1  # the refused update's file is gone


def test_staged_content_refuses_carried_over_damage(store: ChunkStore) -> None:
    cid = chunk_id(5, 0)
    store.write(cid, 0, CS, bytes(range(256)) * 8)  # 4 blocks
    path = store.file_path(cid) or ""
    with open(path, "r+b") as f:  # damage block 3
        f.seek(3 * BS + 5)
        f.write(b"\xff")
    staged = store.stage_write(cid, 0, b"head", CS)  # touches block 0 only: copies block 3
    with pytest.raises(FsError) as info:
        store.staged_content(staged)
    assert info.value.errno == errno.EIO
    store.abort(staged)


def test_reopen_drops_staged_updates(tmp_path: Path) -> None:
    root = tmp_path / "t"
    with ChunkStore(root, block_size=BS, fsync=True, reserve_bytes=0) as store:
        a, b, c = chunk_id(6, 0), chunk_id(6, 1), chunk_id(6, 2)
        store.write(a, 0, CS, b"a" * 600)
        store.write(b, 0, CS, b"b" * 600)
        store.stage_write(a, 600, b"A" * 600, CS)  # never committed nor aborted
        store.stage_write(b, 0, b"B" * 100, CS)
        store.stage_write(c, 0, b"C" * 100, CS)
        store.stage_replace(b, b"R" * 50, CS, 9)
    with ChunkStore(root, block_size=BS, fsync=True, reserve_bytes=0) as store:
        assert bytes(store.read(a, 0, CS)) == b"a" * 600
        assert bytes(store.read(b, 0, CS)) == b"b" * 600
        assert store.file_path(c) is None and chunk_files(store, c) == []
        assert len(chunk_files(store, b)) == 1
        assert store.write(a, 600, CS, b"!")["length"] == 601  # the untrusted tail is cut
        assert bytes(store.read(a, 0, CS)) == b"a" * 600 + b"!"
