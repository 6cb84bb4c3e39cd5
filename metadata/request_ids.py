"""Request ids: a retried mutation is answered, not applied again.

A client gives each mutation a request id (`[client nonce, counter]`,
`client/meta_client.py`) that stays the same through its retries. The
result of the first run is stored under the id *in the same transaction*
as the mutation, and so replicated with it: a retry that reaches the same
server after a lost reply, or a new primary after a failover, finds the
result and returns it (a retried create does not answer EEXIST, a retried
rename not ENOENT). A mutation that failed stored nothing: its retry runs
again. Results are kept `KEEP` seconds, far longer than a client retries.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from shufflefs.metadata.records import DB_REQUESTS, pack, u64, unpack
from shufflefs.metadata.txn import Transactions, Tx
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.metadata.requests")

T = TypeVar("T")

KEEP = 600.0  # seconds a result is kept for retries
TRIM_INTERVAL = 60.0


def request_key(request: list[int]) -> bytes:
    if len(request) != 2 or not all(isinstance(x, int) and 0 <= x < 1 << 64 for x in request):
        raise FsError(errno.EINVAL, f"bad request id {request!r}")
    return u64(request[0]) + u64(request[1])


def run_once(txns: Transactions, request: list[int], fn: Callable[[], T]) -> T:
    """Run mutation *fn* unless *request* already ran; inside a group, all
    three steps are nested in the group's one transaction."""
    key = request_key(request)
    cached = txns.write(lambda tx: tx.get_raw(DB_REQUESTS, key))
    if cached is not None:
        log.debug("request %s answered from its stored result", request)
        result: T = unpack(cached)["r"]
        return result
    result = fn()

    def remember(tx: Tx) -> None:
        tx.put(DB_REQUESTS, key, pack({"t": time.time(), "r": result}))

    txns.write(remember)
    return result


def trim(txns: Transactions, now: float | None = None) -> int:
    """Forget results older than KEEP; returns how many."""
    cutoff = (time.time() if now is None else now) - KEEP

    def body(tx: Tx) -> int:
        old = [k for k, v in tx.prefix_items(DB_REQUESTS, b"") if unpack(v)["t"] < cutoff]
        for key in old:
            tx.delete(DB_REQUESTS, key)
        return len(old)

    return txns.write(body)
