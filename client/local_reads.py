"""Short-circuit reads: pieces whose chain has a replica on this host are read
from its chunk files directly (`storage.local_read.LocalTarget`, checksums
still verified), without a message to the daemon.

This module keeps the table of such targets (opened on first use, `None` for a
target that cannot be read here), copies what they return into the caller's
buffer, and forgets cached chunk records when a file may have changed
(close-to-open). Anything a local target cannot answer goes back to the
caller, which reads it through the daemon.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Collection, Sequence

from shufflefs.client.layout import Piece
from shufflefs.client.replicas import Placed, Replicas
from shufflefs.cluster.routing import Routing
from shufflefs.storage.local_read import LocalPlan, LocalTarget
from shufflefs.storage.uring import OFFLOAD_AT, FileOutcome, FileRead, UringReads

log = logging.getLogger("shufflefs.client.local_reads")

# a piece planned for a read elsewhere: its reader, and its plan or its answer already
Planned = tuple[Piece, LocalTarget, LocalPlan | memoryview]


def place(out: memoryview, piece: Piece, data: memoryview) -> None:
    """Put a piece's bytes where they go (zeros past the chunk's end, as a hole
    reads); bytes read in place already (`destination`) are not copied again."""
    n = len(data)
    dst = piece[4]
    if data.obj is not out.obj:  # (a chunk file's bytes read in place are a view of *out*)
        out[dst : dst + n] = data
    if n < piece[3]:
        out[dst + n : dst + piece[3]] = bytes(piece[3] - n)


def destination(out: memoryview, piece: Piece) -> memoryview:
    """Where a piece's bytes go in *out* (a chunk file may read them there)."""
    return out[piece[4] : piece[4] + piece[3]]


# The reader of each target directory this process opened, shared by every
# client made in it (`shared_target`).
_SHARED: dict[tuple[str, int, str], LocalTarget] = {}
_SHARED_LOCK = threading.Lock()
_shared_pid = -1


def shared_target(path: str, target_id: int, cluster_id: str, host_targets: int) -> LocalTarget:
    """This process's reader of a target directory, opened on first use.
    LMDB refuses to open one environment twice in a process, so a second
    client made here (a second `Client`, or a dataset's beside the user's
    own) used to get no short circuit from the targets the first had opened,
    and read everything through the daemons. A forked child opens its own
    (an environment is not to be used across a fork). *host_targets*: this
    host's targets, which share the process's open-file limit."""
    global _shared_pid
    key = (os.fspath(path), target_id, cluster_id)
    with _SHARED_LOCK:
        if _shared_pid != os.getpid():
            _SHARED.clear()
            _shared_pid = os.getpid()
        reader = _SHARED.get(key)
        if reader is None:
            reader = _SHARED[key] = LocalTarget(path, target_id, cluster_id, host_targets)
        return reader


class LocalReads:
    def __init__(self, replicas: Replicas, enabled: bool = True) -> None:
        self.replicas = replicas
        self.enabled = enabled
        self._targets: dict[int, LocalTarget | None] = {}  # None: not readable here
        # Readers come from the trio thread, its worker threads and the native
        # client's calling threads: one opens a target (LMDB refuses a second
        # open of one environment in a process, which would disable it here).
        self._opening = threading.Lock()

    def target(self, routing: Routing, target_id: int) -> LocalTarget | None:
        """A short-circuit reader for a target on this host, if it can be used."""
        if not self.enabled:
            return None
        local = self.replicas.local_targets(routing)
        if target_id not in local:
            return None
        if target_id not in self._targets:
            with self._opening:
                if target_id not in self._targets:
                    self._targets[target_id] = self._open(routing, target_id, len(local))
        return self._targets[target_id]

    @staticmethod
    def _open(routing: Routing, target_id: int, host_targets: int) -> LocalTarget | None:
        info = routing.targets[target_id]
        try:
            reader = shared_target(info["path"], target_id, routing.cluster_id, host_targets)
        except Exception as exc:  # unreadable here: always through the daemon
            log.info("no short-circuit reads from target %d: %s", target_id, exc)
            return None
        log.info("short-circuit reads from target %d at %s", target_id, info["path"])
        return reader

    def read_pieces(self, pieces: list[Piece], out: memoryview, wait: bool) -> list[Piece]:
        """The fast path, before any replica choice or task: serve the pieces
        whose chain has a serving replica on this host from its chunk files,
        from the page cache (and, with *wait*, whatever it takes: opening
        chunk files not open yet and reading from the disk, right here, in
        one attempt). Returns the pieces left for the read engine."""
        if not self.enabled:
            return pieces
        routing = self.replicas.routing.current
        local = self.replicas.local_targets(routing)
        if not local:
            return pieces
        rest: list[Piece] = []
        for p in pieces:
            data = None
            reader = self._reader(routing, local, p)
            if reader is not None:
                into = destination(out, p)
                data = reader.read(p[1], p[2], p[3], nowait=not wait, into=into)
            if data is None:
                rest.append(p)
            else:
                place(out, p, data)
        return rest

    def _reader(self, routing: Routing, local: Collection[int], p: Piece) -> LocalTarget | None:
        """The reader of the first serving replica of *p*'s chain on this
        host (None: there is none, or it cannot be read here)."""
        for t in routing.serving_targets(p[0]):
            if t["id"] in local:
                return self.target(routing, t["id"])
        return None

    def plan_pieces(self, pieces: list[Piece], open_there: bool = False) -> list[Planned] | None:
        """What `read_pieces` with *wait* reads from the disk, planned to be
        read elsewhere (the mount's io_uring, fuse/fast_reads.py): per piece
        its reader and plan (or its answer already); None, and nothing
        held, if any piece cannot be read here. A chunk file not open yet is
        opened here, waiting for the disk (its directory entry, its inode),
        unless *open_there*: then in the ring with its read
        (`plan_cold`; the ring links the open to the read,
        `UringReads.opens_linked`; where it cannot, an open followed by its
        read cost a trip through the ring's reaper, and four readers of
        cold samples read 5-12% fewer per second)."""
        routing = self.replicas.routing.current
        local = self.replicas.local_targets(routing)
        planned: list[Planned] = []
        for p in pieces:
            reader = self._reader(routing, local, p)
            plan = None
            if reader is not None:
                cid, offset, length = p[1], p[2], p[3]
                if open_there:
                    plan = reader.plan_cold(cid, offset, length)
                else:
                    plan = reader.plan(cid, offset, length, nowait=False)
            if reader is None or plan is None:
                self.discard(planned)
                return None
            planned.append((p, reader, plan))
        return planned

    @staticmethod
    def disk_reads(planned: list[Planned]) -> list[FileRead]:
        """The reads the plans make, in order: (the chunk file's fd, or its
        path to open; buffer; offset) each (`UringReads.open_and_read`)."""
        reads: list[FileRead] = []
        for _, _, plan in planned:
            if isinstance(plan, LocalPlan):
                assert isinstance(plan.buf, bytearray)  # (planned with no *into*)
                what = plan.path if plan.handle is None else plan.handle.fd
                reads.append((what, plan.buf, plan.start))
        return reads

    @staticmethod
    def discard(planned: list[Planned]) -> None:
        """Give back the chunk files of plans that will not be read."""
        for _, reader, plan in planned:
            if isinstance(plan, LocalPlan) and plan.handle is not None:
                reader.finish(plan, OSError(errno.ECANCELED, "not read"))

    @staticmethod
    def finished(reader: LocalTarget, plan: LocalPlan, outcome: FileOutcome) -> memoryview | None:
        """A plan's bytes once `open_and_read` is done with it (*outcome*:
        its file's fd or the open's error, and what the read got): checked,
        or None (the daemon's to answer)."""
        fd, got = outcome
        if plan.handle is None and not reader.opened(plan, fd):
            return None
        return reader.finish(plan, got)

    def finish_pieces(
        self, out: memoryview, planned: list[Planned], outcomes: list[FileOutcome]
    ) -> bool:
        """The planned pieces, read (*outcomes*: per plan, in order, as
        `open_and_read` gives them), checked and put in place; False if any
        failed."""
        ok = True
        got = iter(outcomes)
        for p, reader, plan in planned:
            data = self.finished(reader, plan, next(got)) if isinstance(plan, LocalPlan) else plan
            if data is None:
                ok = False
            elif ok:
                place(out, p, data)
        return ok

    def read_placed(
        self,
        routing: Routing,
        items: list[Placed],
        out: memoryview,
        nowait: bool,
        ahead: bool = False,
    ) -> list[Placed]:
        """Serve what can be served from the chosen targets' local chunk
        files; returns the rest (for the daemons). With *ahead* (a thread's
        cold read of many) every item's readahead starts first, so that the
        disk works on all of them while the first is waited for."""
        if ahead and len(items) > 1:
            for p, tid in items:
                reader = self.target(routing, tid)
                if reader is not None:
                    reader.read_ahead(p[1], p[2], p[3])
        rest: list[Placed] = []
        for item in items:
            p, tid = item
            reader = self.target(routing, tid)
            data = (
                None
                if reader is None
                else reader.read(p[1], p[2], p[3], nowait, into=destination(out, p))
            )
            if data is None:
                rest.append(item)
            else:
                place(out, p, data)
        return rest

    async def read_cold(
        self, routing: Routing, items: list[Placed], out: memoryview, ring: UringReads
    ) -> list[Placed]:
        """`read_placed` of a cold read (a prefetch's: many files, none in
        the page cache) through this trio run's io_uring: every item's chunk
        file opened (unless open here already) and read in the ring, all at
        once, each read as soon as its open is done. No thread: one thread
        per batch opened its files one after another, keeping the disk at
        one lookup at a time, and threads of several batches handed the GIL
        back and forth about 20 times per file (measured); and, three files
        or more, their bytes copied by the kernel's io-wq workers, not this
        loop (`UringReads.submit`'s *offload*). Returns the items left for
        the daemons."""
        rest: list[Placed] = []
        planned: list[tuple[Placed, LocalTarget, LocalPlan]] = []
        for item in items:
            p, tid = item
            reader = self.target(routing, tid)
            plan = None if reader is None else reader.plan_cold(p[1], p[2], p[3])
            if plan is None:
                rest.append(item)
            elif isinstance(plan, LocalPlan):
                assert reader is not None
                planned.append((item, reader, plan))
            else:
                place(out, p, plan)
        if not planned:
            return rest
        reads = self.disk_reads([(item[0], reader, plan) for item, reader, plan in planned])
        outcomes = await ring.open_and_read(reads, offload=len(reads) >= OFFLOAD_AT)
        for (item, reader, plan), outcome in zip(planned, outcomes, strict=True):
            data = self.finished(reader, plan, outcome)
            if data is None:
                rest.append(item)
            else:
                place(out, item[0], data)
        return rest

    def forget(self, ino: int, cids: Sequence[bytes] | None = None) -> None:
        """Cached chunk records of a file may be stale (it was opened again,
        written or cut): the next local read looks them up afresh."""
        for reader in list(self._targets.values()):  # other threads may add one
            if reader is not None:
                if cids is None:
                    reader.forget_file(ino)
                else:
                    reader.forget(cids)

    def close_file(self, ino: int) -> None:
        """A file's last handle here closed: its chunk files are closed
        (`LocalTarget.close_file`); no record is forgotten, no fill refused
        (a third of `forget`'s cost, which every warm sample's close paid on
        the mount's loop)."""
        for reader in list(self._targets.values()):  # other threads may add one
            if reader is not None:
                reader.close_file(ino)

    @property
    def in_use(self) -> bool:
        """Whether any local target was opened (else there is nothing to forget)."""
        return bool(self._targets)
