"""`ReadHandlers.read_fast`: what it may do depends on the thread it runs on."""

from __future__ import annotations

import threading
from pathlib import Path

from shufflefs.storage.context import NodeContext
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.read_service import ReadHandlers
from shufflefs.storage.store import ChunkStore


def test_records_not_cached_are_read_only_off_the_event_loop(tmp_path: Path) -> None:
    """On the loop a record not cached sends the request to `read` (the
    records' pages may wait for the disk); a thread channel's thread reads
    it and answers at once."""
    with ChunkStore(tmp_path / "t", fsync=False, reserve_bytes=0) as store:
        store.set_identity(7, "c")
        cid = chunk_id(3, 0)
        store.write(cid, 0, 1 << 16, b"sample bytes")
        node = NodeContext([store])  # (no routing: a lone target serves)
        handlers = ReadHandlers(node, None, 1 << 20)  # type: ignore[arg-type]
        items = [(7, cid, 0, 12)]
        store._records.invalidate(cid)
        node.loop_thread = threading.get_ident()  # as if this thread ran the loop
        assert handlers.read_fast(items) is None
        node.loop_thread = None
        reply = handlers.read_fast(items)
        if reply is None:  # (a filesystem without RWF_NOWAIT reads: `read` serves all)
            assert not store._nowait
            return
        assert reply.result == {"lengths": [12]}
        assert b"".join(bytes(p) for p in reply.payload) == b"sample bytes"
