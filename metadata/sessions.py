"""Client sessions: a lease each client renews, and the handles it holds.

A handle belongs to a session, so a client that dies without closing its
files does not keep unlinked files alive forever: when its lease runs out
the session is closed with all its handles. Leases are wall-clock times, so
they outlive a server restart (and every lease is renewed once at startup:
clients could not renew while the server was down).
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from shufflefs.metadata.checks import U64_MAX, check_session_fields
from shufflefs.metadata.lifetime import free_if_orphan
from shufflefs.metadata.protocol import SESSION_EXPIRED, MountInfo, Session, SessionInfo
from shufflefs.metadata.records import (
    C_SESSION,
    DB_HANDLES,
    DB_INODES,
    DB_SESSION_HANDLES,
    DB_SESSIONS,
    ExpiredSession,
    Rec,
    pack,
    read_u64,
    u64,
    unpack,
)
from shufflefs.metadata.txn import Transactions, Tx
from shufflefs.rpc.errors import FsError


def session_record(tx: Tx, session: int) -> Rec | None:
    if not 0 < session <= U64_MAX:
        return None
    raw = tx.get_raw(DB_SESSIONS, u64(session))
    return None if raw is None else dict(unpack(raw))


def live_session(tx: Tx, session: int, now: float) -> Rec:
    """The session a handle is taken for; SESSION_EXPIRED tells the client
    to open a new session and retry."""
    rec = session_record(tx, session)
    if rec is None or rec["expires"] < now:
        raise FsError(
            SESSION_EXPIRED, f"session {session} is unknown or expired; open a new session"
        )
    return rec


def close_session(tx: Tx, session: int) -> tuple[int, int]:
    """Drop a session and its handles; returns (handles, inodes freed)."""
    handles = list(tx.prefix_items(DB_SESSION_HANDLES, u64(session)))
    inos = set()
    for key, value in handles:
        handle = key[8:]
        tx.delete(DB_SESSION_HANDLES, key)
        tx.delete(DB_HANDLES, value + handle)
        inos.add(read_u64(value))
    in_memory = tx.read_only.close_session(tx, session)
    inos.update(in_memory)
    tx.delete(DB_SESSIONS, u64(session))
    freed = sum(free_if_orphan(tx, ino) for ino in sorted(inos))
    return len(handles) + len(in_memory), freed


class SessionOps:
    """The session operations of `NamespaceStore`."""

    txns: Transactions
    clock: Callable[[], float]  # wall clock: leases outlive a restart
    session_timeout: float

    def session_open(
        self, client: str, host: str, pid: int, mount: MountInfo | None = None
    ) -> Session:
        check_session_fields(client, host, pid, mount)

        def body(tx: Tx) -> Session:
            session = tx.next_id(C_SESSION)
            now = self.clock()
            rec = {
                "client": client,
                "host": host,
                "pid": pid,
                "created": now,
                "expires": now + self.session_timeout,
                "mount": mount,
            }
            tx.put(DB_SESSIONS, u64(session), pack(rec))

            def opened(committed: bool) -> None:
                if committed:
                    tx.read_only.opened(session)

            tx.after(opened)
            return {"session": session, "lease": self.session_timeout}

        return self.txns.write(body)

    def session_renew(self, session: int) -> None:
        def body(tx: Tx) -> None:
            rec = session_record(tx, session)
            if rec is None or rec["expires"] < self.clock():
                raise FsError(errno.ENOENT, f"session {session} is unknown or expired")
            rec["expires"] = self.clock() + self.session_timeout
            tx.put(DB_SESSIONS, u64(session), pack(rec))

        self.txns.write(body)

    def sessions(self) -> list[SessionInfo]:
        """Every live session (one read snapshot), with its mount's report."""

        def body(tx: Tx) -> list[SessionInfo]:
            now = self.clock()
            held = tx.read_only.per_session()
            out: list[SessionInfo] = []
            for key, raw in tx.prefix_items(DB_SESSIONS, b""):
                rec = unpack(raw)
                if rec["expires"] < now:
                    continue
                session = read_u64(key)
                out.append(
                    {
                        "session": session,
                        "client": rec["client"],
                        "host": rec["host"],
                        "pid": rec["pid"],
                        "created": rec["created"],
                        "expires": rec["expires"],
                        "mount": rec.get("mount"),
                        "open_ro": held.get(session, 0),
                    }
                )
            return out

        return self.txns.read(body)

    def session_close(self, session: int) -> tuple[int, int]:
        """Close a session (unknown: nothing to do). Returns (handles, freed)."""

        def body(tx: Tx) -> tuple[int, int]:
            if session_record(tx, session) is None:
                return 0, 0
            return close_session(tx, session)

        return self.txns.write(body)

    def _expired_sessions(self, tx: Tx) -> list[tuple[int, Rec]]:
        now = self.clock()
        expired = []
        for key, raw in tx.prefix_items(DB_SESSIONS, b""):
            rec = unpack(raw)
            if rec["expires"] < now:
                expired.append((read_u64(key), rec))
        return expired

    def reap_sessions(self) -> list[ExpiredSession]:
        """Close every session whose lease ran out. Looks in a read
        transaction first: the reaper runs often, and a write transaction
        that changes nothing is not worth its lock."""
        if not self.txns.read(self._expired_sessions):
            return []

        def body(tx: Tx) -> list[ExpiredSession]:
            out: list[ExpiredSession] = []
            for session, rec in self._expired_sessions(tx):
                handles, freed = close_session(tx, session)
                out.append(
                    {
                        "session": session,
                        "client": rec["client"],
                        "host": rec["host"],
                        "pid": rec["pid"],
                        "handles": handles,
                        "freed": freed,
                    }
                )
            return out

        return self.txns.write(body)

    def restart_leases(self) -> int:
        """Give every session a full lease again: after the server was down,
        clients could not renew, and that is no reason to close their files."""

        def body(tx: Tx) -> int:
            expires = self.clock() + self.session_timeout
            items = list(tx.prefix_items(DB_SESSIONS, b""))
            for key, raw in items:
                rec = unpack(raw)
                rec["expires"] = expires
                tx.put(DB_SESSIONS, key, pack(rec))
            # their read-only handles were in the old process's memory: until
            # each has re-reported them (or expired), nothing is freed
            sessions = [read_u64(key) for key, _ in items]

            def ended(committed: bool) -> None:
                if committed:
                    tx.read_only.begin_grace(sessions)

            tx.after(ended)
            return len(items)

        return self.txns.write(body)

    def sweep_orphans(self) -> int:
        """After a restart's grace: free every inode with no name that no
        handle holds (its unlink or last close came while frees were
        deferred, or before the restart). One scan of the inodes."""

        def body(tx: Tx) -> int:
            orphans = [
                read_u64(key)
                for key, raw in tx.prefix_items(DB_INODES, b"")
                if unpack(raw)["nlink"] == 0
            ]

            def ended(committed: bool) -> None:
                if committed:
                    tx.read_only.swept()

            tx.after(ended)
            return sum(free_if_orphan(tx, ino) for ino in orphans)

        return self.txns.write(body)
