"""Reads on followers, with read-your-writes (docs/metadata.md, "Reads on
followers").

Every reply of a metadata server carries how far it has applied the
namespace log (the rpc reply's ``"s"``: `rpc.server.LogPosition`); a client
keeps the highest it has seen (its own mutations' included, since the
primary answers after committing them) and sends it with each read. A
follower answers that read only once it has applied the log that far, so a
client always sees its own changes and never goes back in time, whichever
server it asks. A follower that is behind by more than `READ_WAIT`, or has
not heard from its primary for `READ_FRESH` (cut off: it could be
arbitrarily stale), refuses with EAGAIN, and the client asks another server
(the primary answers every read at once).

Other clients' changes reach a follower's readers within the replication
lag, milliseconds normally and never more than `READ_FRESH`: within what the
kernel's own caches already allow a read-write mount (``entry_timeout`` and
``attr_timeout``, 1 s). Opens stay on the primary: a handle is held in the
memory of the server that gave it (metadata/readonly.py), and only the
primary decides when an unlinked file is freed.
"""

from __future__ import annotations

import errno

import trio

from shufflefs.metadata.replication import ReplicationService
from shufflefs.metadata.replication_role import MetaRole
from shufflefs.metadata.txn import Transactions
from shufflefs.rpc.errors import FsError

READ_WAIT = 1.0  # seconds a follower waits to apply what a reader has seen
READ_FRESH = 1.5  # a follower silent from its primary this long serves no reads


class ReadPosition:
    """This server's `rpc.server.LogPosition`."""

    def __init__(self, txns: Transactions, role: MetaRole, replication: ReplicationService) -> None:
        self.txns = txns
        self.role = role
        self.replication = replication

    def seq(self) -> int:
        return self.txns.last_seq

    async def reach(self, seq: int) -> None:
        if self.role.primary_now():
            return  # the primary is the log: it has everything anyone saw
        since = trio.current_time() - self.replication.last_contact
        if since > READ_FRESH:
            raise FsError(
                errno.EAGAIN,
                f"this metadata follower has not heard from its primary for {since:.1f}s: "
                "ask another server",
            )
        deadline = trio.current_time() + READ_WAIT
        while self.txns.last_seq < seq:
            left = deadline - trio.current_time()
            if left <= 0 or self.role.primary_now():
                if self.role.primary_now():
                    return
                raise FsError(
                    errno.EAGAIN,
                    f"this metadata follower has applied seq {self.txns.last_seq}, the reader "
                    f"has seen {seq}: ask another server",
                )
            await self.replication.applied.wait(left)
