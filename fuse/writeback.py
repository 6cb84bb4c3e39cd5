"""``-o writeback``: close(2) of a written file returns before its bytes are
on the storage daemons (docs/operations.md, "Mount modes and caches").

For ingestion by one process at a time (``cp -r``, a Python loop writing
samples), where each file's close would otherwise wait for its chain
write (every replica's flushes) and its length report before the next file
starts. With the option, FLUSH answers at once and the RELEASE of a written
handle is carried out here, in the background: the writes still in flight
are waited for, the length is reported and the handle given back, exactly
what a close does on the default mount, only later. The kernel has the
bytes in its page cache and the mount its own size of the file meanwhile, so
this mount reads and stats what was written; another mount sees the file
once its close here is done (normally milliseconds: the chain write, up to
3 ms waiting for other closes to share the length report's call,
`length_reports.BEHIND_LINGER`, and the call; at most as long as the chain
takes to serve again when a replica dies). JuiceFS's ``--writeback``
makes the same trade.

What is given up, and only on this mount: a failed write is no longer the
close's error (it is logged with the file's inode and counted: the
``shufflefs_client_writeback`` metric's ``failed``), and the files closed but
not yet done are lost if the mount process dies (kill -9, a crash of the
machine). ``fsync`` still waits for the file, as on every mount. An unmount
(`shufflefs umount`, which waits for the mount process) or a SIGTERM finishes
every close first.

Bounded: at most MAX_CLOSES closes and MAX_BYTES of their unwritten bytes
wait here; a RELEASE beyond either waits for room (the writer slows to what
the cluster takes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import trio
from prometheus_client.registry import Metric

from shufflefs.client.fs import FileSystem
from shufflefs.cluster.metrics_client import counts_family
from shufflefs.cluster.metrics_scrape import counter_samples
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.fuse.writeback")

MAX_CLOSES = 256  # closes carried out in the background at once
MAX_BYTES = 256 << 20  # their bytes still on the way to storage
DRAIN_SECONDS = 300.0  # the most an unmount waits for them


def closes_behind(metrics_url: str) -> int:
    """Closes a writeback mount has started and not finished, from its
    metrics (what a benchmark or a test waits for)."""
    c = counter_samples(metrics_url, "shufflefs_client_writeback_total", "outcome")
    if not c:
        raise ValueError(f"{metrics_url}: not the metrics of a -o writeback mount")
    return int(c["started"] - c["done"] - c["failed"])


@dataclass
class WritebackCounts:
    """Closes carried out in the background (exported when scraped)."""

    started: int = 0
    done: int = 0
    failed: int = 0  # logged with the inode: the writer was not told
    waited: int = 0  # opens and truncates that waited for their file's close behind

    def collect(self) -> Iterable[Metric]:
        yield counts_family(
            "shufflefs_client_writeback",
            "Closes of written files a -o writeback mount carried out in the background",
            "outcome",
            self,
        )


class WritebackCloses:
    def __init__(self, fs: FileSystem) -> None:
        self.fs = fs
        self.nursery: trio.Nursery | None = None  # the mount's (`start`)
        self.counts = WritebackCounts()
        self.pending: dict[int, int] = {}  # fh -> ino, closes not done yet
        self._changed = trio.Event()  # set when a close finishes

    def start(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    def _bytes(self) -> int:
        inodes = self.fs.inodes
        return sum(
            st.pending_bytes
            for ino in set(self.pending.values())
            if (st := inodes.get(ino)) is not None
        )

    async def close(self, fh: int, ino: int) -> None:
        """Carry out the release of written handle *fh* in the background,
        once there is room."""
        while not self.room():
            await self._changed.wait()
        self.begin(fh, ino)

    def room(self) -> bool:
        """May a close go behind now?"""
        return not self.pending or (len(self.pending) < MAX_CLOSES and self._bytes() < MAX_BYTES)

    def begin(self, fh: int, ino: int) -> None:
        """Carry out the release of *fh* in the background (there is room)."""
        assert self.nursery is not None, "start() first"
        self.pending[fh] = ino
        self.counts.started += 1
        self.nursery.start_soon(self._close, fh, ino)

    async def _close(self, fh: int, ino: int) -> None:
        try:
            await self.fs.release(fh, behind=True)
            self.counts.done += 1
        except FsError as exc:
            self.counts.failed += 1
            log.error(
                "writeback: the close of a written file failed after it returned: "
                "ino=%d errno=%d %s",
                ino,
                exc.code,
                exc.message,
            )
        except Exception:  # never the mount's end: logged, counted
            self.counts.failed += 1
            log.exception("writeback: the close of written ino=%d failed after it returned", ino)
        finally:
            del self.pending[fh]
            self._changed.set()
            self._changed = trio.Event()

    async def done_with(self, ino: int) -> None:
        """Wait until no close of *ino* is behind (an open that writes or
        truncates comes after the close, as on the default mount: else the
        earlier close's writes and length could land on the new content)."""
        if ino in self.pending.values():
            self.counts.waited += 1
            while ino in self.pending.values():
                await self._changed.wait()

    async def drain(self, seconds: float = DRAIN_SECONDS) -> bool:
        """Wait (at most *seconds*) until every close is done; whether they are."""
        with trio.move_on_after(seconds):
            while self.pending:
                await self._changed.wait()
        if self.pending:
            log.error(
                "writeback: %d closes not done after %gs: those files may lack data "
                "elsewhere (inodes %s)",
                len(self.pending),
                seconds,
                sorted(set(self.pending.values()))[:20],
            )
            return False
        return True
