"""Reads from the native client's calling thread, without the trio thread.

The native client's async core lives on a trio loop in a background thread,
and handing a call to it and back costs two thread switches: most of the
latency of a small read. A read needs nothing that lives only there: the
layout and the routing map are plain data it can look at, and a read is
idempotent. So reads are made from the caller's own thread over blocking
connections that thread owns (`rpc.blocking`), all the requests of a batch
sent before any reply is awaited, so storage nodes work in parallel.

It uses the same parts as the async read (`FileSystem.read_into`): the one
planner, the inline short-circuit pass, the replica choice. This is the fast
path only: any failure (a dead replica, a checksum error, a stale map)
returns False and the caller repeats the read on the async path, which fails
over, retries and reports.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from shufflefs.client.layout import Extent, plan
from shufflefs.client.read_engine import landing_views, scatter, split_requests
from shufflefs.client.replicas import Placed
from shufflefs.client.storage_client import StorageClient
from shufflefs.rpc.blocking import BlockingPeers
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.client.blocking_read")

# Items at least this big on average are received straight into the caller's
# buffer, one receive each; smaller ones in one receive, then copied into place.
IN_PLACE_MIN = 32 << 10


class BlockingReader:
    def __init__(self, storage: StorageClient, secret: bytes) -> None:
        self.storage = storage
        self.peers = BlockingPeers(secret, timeout=storage.read_timeout, channel=True)

    def read_into(self, extents: Sequence[Extent], out: memoryview) -> bool:
        """Read *extents* into *out* end to end; False if the async path must."""
        storage = self.storage
        try:
            # whatever this host's chunk files hold, read here, waiting for
            # the disk if need be (this thread would wait for it below
            # anyway): one plan and one read a piece
            pieces = storage.local.read_pieces(plan(extents), out, wait=True)
            if not pieces:
                return True
            routing = storage.routing.current
            groups = storage.replicas.assign(routing, pieces)
        except FsError:
            return False
        sent = []
        ok = True
        for address, items in groups.items():
            items = storage.local.read_placed(routing, items, out, nowait=False)
            if not items:
                continue
            for request in split_requests(items):
                try:
                    conn = self.peers.connection(address)
                    call = conn.send_request(
                        "read", {"items": [[tid, p[1], p[2], p[3]] for p, tid in request]}
                    )
                except FsError as exc:
                    log.debug("blocking read to %s: %s", address, exc.message)
                    self.peers.drop(address)
                    ok = False
                    continue
                sent.append((address, conn, call, request))
        for address, conn, call, request in sent:  # receive every reply, even after a failure
            place = None
            if sum(p[3] for p, _ in request) >= IN_PLACE_MIN * len(request):
                place = functools.partial(_landing, request, out)
            try:
                result, payload = conn.receive_reply(call, place)
            except FsError as exc:
                log.debug("blocking read from %s: %s", address, exc.message)
                self.peers.drop(address)
                ok = False
                continue
            lengths = result["lengths"]
            if payload is None and place is not None:  # already in place
                if any(n < 0 for n in lengths):
                    ok = False
            elif scatter(request, lengths, payload or b"", out):
                ok = False
        return ok


def _landing(
    request: list[Placed], out: memoryview, result: Any, size: int
) -> list[memoryview] | None:
    lengths = result.get("lengths") if isinstance(result, dict) else None
    return None if not isinstance(lengths, list) else landing_views(request, lengths, size, out)
