"""Open-file handles, kept in the metadata server's memory, never in LMDB.

A read-only open must cost no durable commit, and a create or an open for
writing none beyond the one its change needs (the new inode, the O_TRUNC),
nor its release any (small-file ingestion is create, write, close), yet an
unlinked file must keep its data while anyone still has it open (POSIX). So
every handle lives in this table, per session (`open` for read-only opens,
`hold` inside the write transaction of the others; "read-only" in the names
here is historical: they are the handles held in memory); when an inode
loses its last name, `lifetime` keeps it (nlink 0) if a handle here (or a
durable one in LMDB, which stores of earlier versions may hold) holds it, and
the release of the last one frees it in one write transaction. Handle ids
carry `RO_HANDLE_BIT`, so `release` knows which kind it was given without a
lookup.

The table is lost when the server stops. At startup every session in LMDB
enters a *grace* state: until each has renewed once (reporting the read-only
handles its client still holds, which are put back here) or has expired, no
inode is freed at all; frees are deferred and `sweep_due` tells the server to
sweep the nlink-0 inodes nothing holds once the grace is over.

Who touches it: read-only open/release run on the event loop, frees and
session closes in the writer thread, so every access takes one lock, held
only for in-memory work and one read snapshot. A free being committed marks
its inode `freeing` until its transaction ends; a read-only open that meets
the mark raises `FreeInProgress` and is retried after the writer's current
transaction (it then sees the inode gone, or alive if the free aborted).
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from shufflefs.metadata.protocol import RO_HANDLE_BIT, SESSION_EXPIRED, is_read_only_handle
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.metadata.txn import Tx


class FreeInProgress(Exception):
    """The inode is being freed by a transaction not yet committed: retry
    the open once the writer's current transaction is done."""


class ReadOnlyHandles:
    """{session: {handle: ino}}, with per-inode counts, in memory only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[int, dict[int, int]] = {}
        self._holders: Counter[int] = Counter()
        # {ino: {session: handles}} of the handles `open` gave (a client's
        # cached opens among them): whom a change of the inode concerns
        # (cache_watch.py); `hold`'s handles are a writer's own
        self._readers: dict[int, Counter[int]] = {}
        self._opened: set[int] = set()  # the handles in `_readers`
        self._freeing: set[int] = set()
        # unnamed inodes a free left alive for their read-only handles: the
        # release of the last of those frees them
        self._kept: set[int] = set()
        self._closing: set[int] = set()
        self._grace: set[int] = set()  # sessions live at startup that have not re-reported
        self.started_with: set[int] = set()  # every session live at startup
        # sessions opened since this server last became the primary: their
        # handles were all taken here, so no grace waits for them
        self._opened_here: set[int] = set()
        self.sweep_due = False
        # a follower's namespace: the handles are in the primary's memory, so
        # an unnamed inode may be held by any live session (until promotion
        # starts a grace like a restart's)
        self.following = False
        # microseconds since the epoch: ids of a restarted server do not meet old ones
        self._ids = itertools.count(time.time_ns() // 1000)

    # ---- the event-loop side -------------------------------------------------

    def open(self, session: int, ino: int, check: Callable[[], None]) -> int:
        """A new read-only handle on *ino*; *check* (one read snapshot: the
        session is live, the inode may be opened) runs under the lock, so no
        free can slip between it and the handle being counted."""
        with self._lock:
            if session in self._closing:
                raise FsError(SESSION_EXPIRED, f"session {session} is closing")
            if ino in self._freeing:
                raise FreeInProgress(ino)
            check()
            handle = RO_HANDLE_BIT | next(self._ids)
            self._sessions.setdefault(session, {})[handle] = ino
            self._holders[ino] += 1
            self._add_reader(ino, session, handle)
            return handle

    def hold(self, tx: Tx, session: int, ino: int) -> int:
        """A handle taken inside write transaction *tx* (`create`, an open
        for writing or truncating): held here too, so neither it nor its
        release costs a commit of its own; dropped again if *tx* aborts. The
        transaction's own commit carries what the open changed (a new inode,
        an O_TRUNC)."""
        with self._lock:
            if session in self._closing:
                raise FsError(SESSION_EXPIRED, f"session {session} is closing")
            handle = RO_HANDLE_BIT | next(self._ids)
            self._sessions.setdefault(session, {})[handle] = ino
            self._holders[ino] += 1
        tx.after(lambda committed: self._unhold(session, handle, committed))
        return handle

    def release(self, session: int, handle: int) -> int | None:
        """Give a handle back; returns its inode if this was the last
        read-only handle of an inode a free kept alive (it needs freeing
        now), else None. A handle already gone (its session closed) is not
        an error."""
        with self._lock:
            ino = self._sessions.get(session, {}).pop(handle, None)
            if ino is None:
                if any(handle in held for held in self._sessions.values()):
                    raise FsError(errno.EBADF, f"handle {handle} belongs to another session")
                return None
            self._drop_reader(ino, session, handle)
            if self._drop(ino) and ino in self._kept:
                self._kept.discard(ino)
                return ino
            return None

    def renewed(self, session: int, open_ro: Iterable[tuple[int, int]]) -> None:
        """A renewal. The first one from a session live at startup puts
        back the (ino, handle) pairs its client still holds open read-only
        and ends that session's grace; later reports change nothing (the
        table is already exact)."""
        with self._lock:
            if session not in self._grace:
                return
            held = self._sessions.setdefault(session, {})
            for ino, handle in open_ro:
                if is_read_only_handle(handle) and handle not in held:
                    held[handle] = ino
                    self._holders[ino] += 1
                    self._add_reader(ino, session, handle)  # which kind is not known
            self._end_grace(session)

    # ---- the writer side (inside a write transaction) --------------------------

    def claim_free(self, tx: Tx, ino: int) -> bool:
        """May *ino* (no name, no durable handle) be freed in *tx*? Not
        while a read-only handle holds it or a restart's grace lasts; if it
        may, it is marked `freeing` until *tx* ends."""
        with self._lock:
            if self._holders[ino]:
                self._kept.add(ino)
                return False
            if self._grace:
                return False
            self._kept.discard(ino)
            self._freeing.add(ino)
        tx.after(lambda committed: self._unmark_free(ino))
        return True

    def close_session(self, tx: Tx, session: int) -> list[int]:
        """*session* is being closed in *tx*: drop its handles (put back if
        *tx* aborts) and return the inode of each."""
        with self._lock:
            held = self._sessions.pop(session, {})
            for handle, ino in held.items():
                self._drop(ino)
                self._drop_reader(ino, session, handle)
            self._closing.add(session)
            in_grace = session in self._grace
            self._end_grace(session)
        tx.after(lambda committed: self._session_closed(session, held, in_grace, committed))
        return list(held.values())

    # ---- startup and inspection ----------------------------------------------------

    def promoted(self) -> None:
        """This server is the primary from now on (before its first commit
        as such): sessions opened from here on are its own."""
        with self._lock:
            self._opened_here = set()

    def opened(self, session: int) -> None:
        """A session opened (committed) on this server as the primary."""
        with self._lock:
            self._opened_here.add(session)
            self._end_grace(session)  # if its commit came with `begin_grace`'s

    def begin_grace(self, sessions: Iterable[int]) -> None:
        """The sessions live when this server became the primary; those
        opened on it since (a client may open one before this runs) took
        every handle they hold here."""
        with self._lock:
            self._grace = set(sessions) - self._opened_here
            self.started_with = set(self._grace)
            self.following = False
            self.sweep_due = not self._grace

    def swept(self) -> None:
        with self._lock:
            self.sweep_due = False

    def in_grace(self) -> bool:
        return bool(self._grace) or self.following

    def readers(self, ino: int) -> list[int]:
        """The sessions holding a handle `open` gave on *ino*."""
        with self._lock:
            return list(self._readers.get(ino, ()))

    def held(self) -> set[int]:
        """Inodes held by a read-only handle now."""
        with self._lock:
            return {ino for ino, n in self._holders.items() if n}

    def per_session(self) -> dict[int, int]:
        """How many read-only handles each session holds now."""
        with self._lock:
            return {session: len(held) for session, held in self._sessions.items() if held}

    def count(self) -> int:
        with self._lock:
            return sum(self._holders.values())

    # ---- internals (under the lock) -------------------------------------------------

    def _drop(self, ino: int) -> bool:
        """One handle on *ino* less; returns whether it was the last."""
        self._holders[ino] -= 1
        if self._holders[ino] > 0:
            return False
        del self._holders[ino]
        return True

    def _add_reader(self, ino: int, session: int, handle: int) -> None:
        self._readers.setdefault(ino, Counter())[session] += 1
        self._opened.add(handle)

    def _drop_reader(self, ino: int, session: int, handle: int) -> None:
        if handle not in self._opened:
            return
        self._opened.discard(handle)
        sessions = self._readers[ino]
        sessions[session] -= 1
        if sessions[session] <= 0:
            del sessions[session]
            if not sessions:
                del self._readers[ino]

    def _unhold(self, session: int, handle: int, committed: bool) -> None:
        """After `hold`'s transaction: the handle stays if it committed."""
        if committed:
            return
        with self._lock:
            ino = self._sessions.get(session, {}).pop(handle, None)
            if ino is not None:
                self._drop(ino)

    def _end_grace(self, session: int) -> None:
        if session in self._grace:
            self._grace.discard(session)
            if not self._grace:
                self.sweep_due = True

    def _unmark_free(self, ino: int) -> None:
        with self._lock:
            self._freeing.discard(ino)

    def _session_closed(
        self, session: int, held: dict[int, int], in_grace: bool, committed: bool
    ) -> None:
        with self._lock:
            self._closing.discard(session)
            if committed:
                return
            self._sessions.setdefault(session, {}).update(held)
            for handle, ino in held.items():
                self._holders[ino] += 1
                self._add_reader(ino, session, handle)  # which kind is not known
            if in_grace:
                self._grace.add(session)
                self.sweep_due = False
