"""Telling a shufflefs mount the upcoming order (fuse/prefetch.py).

A dataset of local paths that are on a shufflefs mount sends, ahead of its
reads, the files (or byte ranges) of its next batches to the mount, which
reads them ahead from the storage daemons; cold samples then come from the
mount's memory. `MountHints.find` recognizes the mount by its xattr (a
directory answers ``user.shufflefs.prefetch`` with its cache state);
anything else (a local disk, NFS, a mount with prefetch off) gets None and
nothing is sent.

Hints are advice: they go out on one background thread per process (the
reader never waits for the mount to resolve them, at most MAX_OUTSTANDING
batches are queued), and a failure is logged and forgotten. On a read-only
mount, where the kernel refuses setxattr, files are hinted by getxattrs of
the mount root whose names carry their paths instead (whole files only;
`_get_named`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger("shufflefs.client.data")

XATTR = "user.shufflefs.prefetch"
MAX_VALUE = 60_000  # bytes per setxattr: under the kernel's XATTR_SIZE_MAX (64 KiB)
NAME_MAX = 255  # bytes of an xattr name (XATTR_NAME_MAX)
MAX_OUTSTANDING = 64  # hint batches queued on the sender thread (the reads never wait
# for them to be sent: only a loader that hints this many batches ahead of one send)
DEFAULT_AHEAD = 512  # samples hinted ahead of the reads
LIST_MAX = 100_000  # entries of a hinted file's directory listed (`_list_directories`)
NAMED_IN_FLIGHT = 8  # getxattrs of named hints sent at once (`_get_named`)
# a warm epoch: after this many getxattrs whose every file the mount said
# the kernel holds (HELD), only one in PROBE_EVERY goes (until one is not)
HELD_STREAK = 4
PROBE_EVERY = 8
HELD = b"held"  # fuse/prefetch.py

T = TypeVar("T")
# ("files" | "ranges", [(file, offset, length)], thinned already: a warm epoch's probe)
Job = tuple[str, list[tuple[int, int, int]], bool]


def mount_root(path: str) -> str:
    """The mount point *path* is under."""
    p = os.path.realpath(path)
    while not os.path.ismount(p):
        p = os.path.dirname(p)
    return p


def mount_state(root: str) -> dict[str, Any] | None:
    """The prefetch state of a shufflefs mount at *root*; None if it is not
    one or prefetch is off there."""
    try:
        state = json.loads(os.getxattr(root, XATTR))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not state.get("budget"):
        return None
    return state


class MountHints:
    """Sends hints for files of one shufflefs mount (paths given per file index)."""

    def __init__(
        self,
        root: str,
        paths: Sequence[str],
        ahead: int = DEFAULT_AHEAD,
        whole_files: bool = False,
        absolute: Sequence[str] | None = None,  # the paths made absolute (by `find`)
    ) -> None:
        self.root = root
        self.paths = list(paths)
        cut = len(root.rstrip("/")) + 1
        if absolute is None:
            absolute = [os.path.abspath(p) for p in paths]
        self.relative = [p[cut:] for p in absolute]
        self.ahead = ahead
        self.whole_files = whole_files  # the reads are whole files (else byte ranges)
        self.read_only = False
        self.named = True  # the mount takes paths in getxattr names (read-only mounts)
        self._pid = -1
        self._jobs: queue.Queue[Job | None] | None = None
        self._listed: set[str] = set()  # directories this process listed
        self._pool: ThreadPoolExecutor | None = None  # named getxattrs (`_get_all`)
        self._held = 0  # getxattrs in a row whose every file the kernel held
        self._passed = 0  # getxattrs left out or made since (`_thinned`)
        self._jobs_passed = 0  # batches the loader left out or handed over since (`_submit`)

    @classmethod
    def find(
        cls, paths: Sequence[str], ahead: int = DEFAULT_AHEAD, whole_files: bool = False
    ) -> MountHints | None:
        """Hints for *paths* if they are all on one shufflefs mount with
        prefetch on (by their absolute paths: a path reaching the mount
        through a symlink from elsewhere turns hints off)."""
        if ahead <= 0 or not paths:
            return None
        try:
            root = mount_root(paths[0])
        except OSError:
            return None
        if mount_state(root) is None:
            return None
        prefix = root.rstrip("/") + "/"
        absolute = [os.path.abspath(p) for p in paths]  # (once: 0.6 s for 1.28 M paths)
        if not all(p.startswith(prefix) for p in absolute):
            return None
        return cls(root, paths, ahead, whole_files, absolute)

    def plan(self, files: Any, offsets: Any, lengths: Any) -> None:
        """Hint one read plan's ranges (index arrays)."""
        if self.whole_files:
            self.files(files.tolist())
        else:
            self.ranges(files.tolist(), offsets.tolist(), lengths.tolist())

    # ---- sending -------------------------------------------------------------

    def files(self, items: Sequence[int]) -> None:
        """Hint whole files (indices into the paths)."""
        self._submit(("files", [(i, 0, 0) for i in items], False))

    def ranges(self, files: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
        """Hint byte ranges of files."""
        self._submit(("ranges", list(zip(files, offsets, lengths, strict=True)), False))

    def _submit(self, job: Job) -> None:
        if self._jobs is None or self._pid != os.getpid():  # a forked child: our own thread
            self._pid = os.getpid()
            self._listed = set()
            self._pool = None  # (a forked child's is its parent's, without threads)
            self._held = self._passed = self._jobs_passed = 0
            self._jobs = queue.Queue(MAX_OUTSTANDING)
            threading.Thread(
                target=self._run, args=(self._jobs,), name="shufflefs-hints", daemon=True
            ).start()
        if self._held >= HELD_STREAK:
            # a warm epoch: most batches are left out here, before the
            # hand-off, which wakes the hint thread (measured, four readers
            # of 4,000 warm files on loopback: 47,339-55,497 samples/s
            # thinned in the thread only, 54,511-61,944 so; unhinted
            # 85,769-94,251); the one in PROBE_EVERY let through goes whole
            self._jobs_passed += 1
            if self._jobs_passed % PROBE_EVERY:
                return
            job = (job[0], job[1], True)
        self._jobs.put(job)  # blocks while MAX_OUTSTANDING are waiting

    def _run(self, jobs: queue.Queue[Job | None]) -> None:
        """Send the batches as they come; those queued meanwhile go
        together (one listing pass, one round trip per value that fits)."""
        while True:
            taken = [jobs.get()]
            while taken[-1] is not None and len(taken) < MAX_OUTSTANDING:
                try:
                    taken.append(jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                for kind, items, probe in merged([job for job in taken if job is not None]):
                    self._send(kind, items, probe)
            except OSError as exc:
                log.debug("prefetch hint not taken: %s", exc)
            finally:
                for _ in taken:
                    jobs.task_done()
            if taken[-1] is None:
                return

    def _send(self, kind: str, items: list[tuple[int, int, int]], probe: bool = False) -> None:
        self._list_directories([i for i, _, _ in items])
        if kind == "files":
            self._send_files([i for i, _, _ in items], probe)
        else:
            self._send_ranges(items)

    def _set_all(self, values: Iterator[bytes]) -> bool:
        """setxattr each value on the mount root; False on a read-only mount."""
        try:
            for value in values:
                os.setxattr(self.root, XATTR, value)
        except OSError as exc:
            if exc.errno != errno.EROFS:
                raise
            self.read_only = True
        return not self.read_only

    def _list_directories(self, items: list[int]) -> None:
        """List the directories of *items* not listed by this process yet:
        the listing (readdirplus) tells the kernel every file in one pass,
        and the mount hands the bytes it fetches of a file the kernel knows
        straight to its page cache (fuse/page_store.py), where the reads
        find them with no round trip; it keeps other files' bytes itself
        (also those past the first LIST_MAX entries of a directory: a huge
        flat directory is not listed whole by every process)."""
        todo = []
        for i in items:
            directory = os.path.dirname(self.paths[i])
            if directory not in self._listed:
                self._listed.add(directory)
                todo.append(directory)
        if len(todo) > 1:  # each waits for the mount's loop: several at once
            list(self._threads().map(_list_directory, todo))
        elif todo:
            _list_directory(todo[0])

    def _send_files(self, items: list[int], probe: bool = False) -> None:
        lines = [os.fsencode(self.relative[i]) for i in items]
        if self.read_only or not self._set_all(pack(lines, b"\n", b"", b"")):
            self._get_named(items, lines, probe)

    def _get_named(self, items: list[int], lines: list[bytes], probe: bool = False) -> None:
        """What a read-only mount takes: the paths in the names of getxattrs
        of the mount root, as many as fit in one (XATTR_NAME_MAX); a path
        that does not fit (or on a mount of before that form) by a getxattr
        on the file itself, which costs the kernel's lookup of it too. In
        a warm epoch most are left out (`_thinned`)."""
        prefix = os.fsencode(XATTR) + b"/"
        alone = [i for i, line in zip(items, lines, strict=True) if not self._nameable(line)]
        fitting = [line for line in lines if self._nameable(line)]
        if self.named and fitting:
            names = [os.fsdecode(n) for n in pack(fitting, b"\n", prefix, b"", NAME_MAX)]
            try:
                # NAMED_IN_FLIGHT at a time, so that a streak learned from the
                # first answers thins the rest of a large send (a hint thread
                # behind its loader merges up to MAX_OUTSTANDING batches)
                for start in range(0, len(names), NAMED_IN_FLIGHT):
                    wave = self._thinned(names[start : start + NAMED_IN_FLIGHT], probe)
                    if wave:
                        self._answered(self._get_all(wave))
            except OSError as exc:
                if exc.errno not in (errno.ENODATA, errno.EOPNOTSUPP, errno.ERANGE):
                    raise
                self.named = False  # a mount of before the form
        if not self.named:
            alone = items
        for i in self._thinned(alone, probe):
            self._answered([os.getxattr(self.paths[i], XATTR)])

    def _thinned(self, sends: list[T], probe: bool = False) -> list[T]:
        """Those of *sends* (getxattrs) to make. In a warm epoch (the mount
        said the kernel held every file of the last HELD_STREAK) only one
        in PROBE_EVERY goes: each costs the mount a request and this
        process's hint thread the GIL, for nothing (measured: four hinted
        readers of a warm epoch 11,757-15,238 samples/s, unhinted
        15,973-21,923). A probe the mount answers otherwise (a file the
        kernel evicted, a new epoch's cold files) ends it. Counted per
        getxattr, not per send: four readers whose hint threads fell
        behind sent a whole warm epoch in their first four sends (330
        getxattrs each), at 18,437 samples/s against 49,195 after. A
        *probe* (a batch the loader let through in a warm epoch, `_submit`)
        goes whole."""
        if probe or self._held < HELD_STREAK:
            return sends
        kept = []
        for send in sends:
            self._passed += 1
            if self._passed % PROBE_EVERY == 0:
                kept.append(send)
        return kept

    def _answered(self, values: list[bytes]) -> None:
        for value in values:
            self._held = self._held + 1 if value == HELD else 0

    def _get_all(self, names: list[str]) -> list[bytes]:
        """getxattr of the root for each of *names*, NAMED_IN_FLIGHT at once:
        their values; the first error once all are done. At ~12 paths per name, one at a
        time paced a cold epoch's prefetch: each waits for the mount's event
        loop, busy with the fetches, to come round to it (measured: 2,000
        files hinted in 0.5-0.8 s, as long as their fetch took)."""
        if len(names) == 1:
            return [os.getxattr(self.root, names[0])]
        pool = self._threads()
        futures = [pool.submit(os.getxattr, self.root, name) for name in names]
        errors = [exc for exc in (f.exception() for f in futures) if exc is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(NAMED_IN_FLIGHT, thread_name_prefix="shufflefs-hint")
        return self._pool

    @staticmethod
    def _nameable(line: bytes) -> bool:
        return b"\n" not in line and len(XATTR) + 1 + len(line) <= NAME_MAX

    def _send_ranges(self, triples: list[tuple[int, int, int]]) -> None:
        if not self.read_only:
            items = [json.dumps([self.relative[f], o, n]).encode() for f, o, n in triples]
            self._set_all(pack(items, b",", b"[", b"]"))

    def flush(self) -> None:
        """Wait until every hint handed over was sent."""
        if self._jobs is not None and self._pid == os.getpid():
            self._jobs.join()

    def close(self) -> None:
        if self._jobs is not None and self._pid == os.getpid():
            self._jobs.put(None)
            self._jobs.join()
            if self._pool is not None:
                self._pool.shutdown(wait=False)
        self._jobs = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_jobs"] = None
        state["_pid"] = -1
        state["_listed"] = set()
        state["_pool"] = None
        state["_held"] = state["_passed"] = state["_jobs_passed"] = 0
        return state


def merged(jobs: list[Job]) -> list[Job]:
    """Consecutive jobs of one kind (and probes or not) as one."""
    out: list[Job] = []
    for kind, items, probe in jobs:
        if out and out[-1][0] == kind and out[-1][2] == probe:
            out[-1][1].extend(items)
        else:
            out.append((kind, list(items), probe))
    return out


def pack(
    items: list[bytes], sep: bytes, head: bytes, tail: bytes, limit: int = MAX_VALUE
) -> Iterator[bytes]:
    """*items* joined into values of at most *limit* bytes."""
    batch: list[bytes] = []
    size = len(head) + len(tail)
    for item in items:
        if batch and size + len(item) + len(sep) > limit:
            yield head + sep.join(batch) + tail
            batch, size = [], len(head) + len(tail)
        batch.append(item)
        size += len(item) + len(sep)
    if batch:
        yield head + sep.join(batch) + tail


def lookahead(
    chunks: Iterator[T], ahead: int, send: Callable[[T], None], size: Callable[[T], int]
) -> Iterator[T]:
    """*chunks* as they come, each passed to *send* when at least *ahead*
    samples (counted by *size*) before it is yielded: hints along the order."""
    waiting: deque[T] = deque()
    queued = 0
    for chunk in chunks:
        send(chunk)
        waiting.append(chunk)
        queued += size(chunk)
        while waiting and queued - size(waiting[0]) >= ahead:
            first = waiting.popleft()
            queued -= size(first)
            yield first
    yield from waiting


def _list_directory(directory: str) -> None:
    """List *directory* (its first LIST_MAX entries: a huge flat directory's
    rest stay with the mount) so that the kernel knows its files."""
    try:
        with os.scandir(directory) as entries:
            for n, _ in enumerate(entries, 1):
                if n >= LIST_MAX:
                    break
    except OSError as exc:  # the hints go anyway (the mount keeps those bytes itself)
        log.debug("listing %s for prefetch hints: %s", directory, exc)
