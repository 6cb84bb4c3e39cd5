"""`NamespaceStore`: the namespace of one metadata server, in one LMDB
environment (inodes, directory entries, xattrs, sessions, handles, the jobs
owed to storage).

The API is synchronous on purpose: the server runs each mutation in one
worker-thread call (`writer.Writer`), so its transaction begins and commits
in the same thread and an fsync never stalls the event loop. Nothing here
touches the network.

Where things are (docs/metadata.md has the whole map):

* `records`: sub-databases, keys and record formats; `checks`: argument checks;
* `txn`: `Transactions` (the one place transactions are opened and committed)
  and `Tx` (a transaction's view of the records);
* the operations, one mixin per concern: `namespace.NameOps` (names and
  directories), `files.FileOps` (open files, sizes, attributes),
  `xattrs.XattrOps`, `sessions.SessionOps`, `jobs.JobQueue`;
* `lifetime`: when an inode is freed; `fsck`: the consistency check.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from shufflefs.metadata.files import FileOps
from shufflefs.metadata.fsck import Fsck
from shufflefs.metadata.jobs import JobQueue
from shufflefs.metadata.namespace import NameOps
from shufflefs.metadata.protocol import ROOT_INODE, FsStats
from shufflefs.metadata.readonly import ReadOnlyHandles
from shufflefs.metadata.records import (
    ALL_DBS,
    C_INO,
    DB_COUNTERS,
    DB_INFO,
    DB_INODES,
    FORMAT_VERSION,
    INFO_CREATED,
    INFO_FORMAT,
    INODE_COST,
    read_u64,
    root_inode,
    u64,
)
from shufflefs.metadata.replog import REPL_DBS
from shufflefs.metadata.sessions import SessionOps
from shufflefs.metadata.txn import Transactions, Tx
from shufflefs.metadata.xattrs import XattrOps
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.metadata.store")


class NamespaceStore(NameOps, FileOps, XattrOps, SessionOps, JobQueue):
    """The namespace of one metadata server, in one LMDB environment."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 64 << 30,
        sync: bool = True,
        session_timeout: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.session_timeout = session_timeout
        self.clock = clock  # wall clock: session leases outlive a restart
        self.map_size, self.sync = map_size, sync
        self.env: Any = None
        self.open_env()
        if self.txns.write(self._format):
            log.info("created a new namespace at %s", self.path)
        self.txns.logging = True

    def open_env(self) -> None:
        """Open the LMDB environment (again, after a snapshot replaced its
        file: the same `Transactions` then works on the new one)."""
        self.env = lmdb.open(
            str(self.path),
            subdir=True,
            map_size=self.map_size,
            max_dbs=len(ALL_DBS) + len(REPL_DBS) + 2,
            sync=self.sync,
            metasync=self.sync,
            max_readers=256,
        )
        self.dbs: dict[bytes, Any] = {
            name: self.env.open_db(name) for name in (*ALL_DBS, *REPL_DBS)
        }
        if getattr(self, "txns", None) is None:
            self.txns = Transactions(self.env, self.dbs)
        else:
            self.txns.reopen(self.env, self.dbs)

    def close(self) -> None:
        self.env.close()

    def __enter__(self) -> NamespaceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _format(self, tx: Tx) -> bool:
        """Create the root on first open; refuse a namespace of another
        format. Returns whether the namespace is new."""
        raw = tx.get_raw(DB_INFO, INFO_FORMAT)
        if raw is not None:
            version = read_u64(raw)
            if version != FORMAT_VERSION:
                raise FsError(
                    errno.EINVAL,
                    f"namespace at {self.path} has format {version}, "
                    f"this server reads {FORMAT_VERSION}",
                )
            return False
        tx.add_inode(ROOT_INODE, root_inode(tx.now))
        tx.put(DB_COUNTERS, C_INO, u64(ROOT_INODE + 1))
        tx.put(DB_INFO, INFO_FORMAT, u64(FORMAT_VERSION))
        tx.put(DB_INFO, INFO_CREATED, u64(tx.now))
        return True

    def statfs(self) -> FsStats:
        """Inodes in use, and an estimate of how many more fit in map_size."""
        files = self.txns.read(lambda tx: tx.entries(DB_INODES))
        info = self.env.info()
        used = (info["last_pgno"] + 1) * self.env.stat()["psize"]
        free = max(0, info["map_size"] - used)
        return {"files": files, "max_files": files + free // INODE_COST}

    def counts(self) -> dict[str, int]:
        """Entries per sub-database (for startup logs and tests)."""
        return self.txns.read(
            lambda tx: {name.decode(): tx.entries(name) for name in ALL_DBS if name != DB_INFO}
        )

    def fsck(self) -> list[str]:
        """Check every invariant of the namespace; returns the problems found
        (empty when consistent). Reads one snapshot, so it may run while the
        server serves."""
        held = self.read_only.held()
        grace = self.read_only.in_grace()
        return self.txns.read(lambda tx: Fsck(tx, held, grace).run())

    @property
    def read_only(self) -> ReadOnlyHandles:
        """The in-memory read-only handles (`readonly.py`)."""
        return self.txns.read_only
