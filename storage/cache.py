"""Thread-safe LRU caches of decoded chunk records and open chunk files.

Both caches are filled by readers that run without the chunk's lock, so a
reader can look a record up (or open a file) just before a writer replaces it
and insert the stale value just after the writer invalidated it. Each cache
therefore has an *epoch* that every invalidation bumps: a reader notes the
epoch before it goes to disk and its fill is dropped if the epoch moved.
Coarse (any update anywhere discards fills in flight) but cheap and obviously
correct; updates are rare next to reads. An fd cache with groups (a client's
short-circuit reader: the chunks of one file) compares per group instead: its
opens may wait long in io_uring while other files are forgotten at every
close-to-open, and a global epoch would then cache none of them.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Final, Generic, TypeVar

from shufflefs.storage.cache_counts import LookupCounts

K = TypeVar("K")
V = TypeVar("V")

MAX_STALE_GROUPS = 4096  # groups whose last invalidation an fd cache remembers


class Missing:
    """Cached knowledge that a chunk does not exist (sparse regions are read
    often and must not cost an LMDB lookup each time)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = Missing()


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's open-file soft limit towards *wanted* (never
    down), and the hard limit with it where this process may (root: up to
    ``fs.nr_open``), for the fd caches; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return wanted if soft == resource.RLIM_INFINITY else soft
    if hard != resource.RLIM_INFINITY and hard < wanted:
        top = min(wanted, _nr_open())
        with contextlib.suppress(ValueError, OSError):  # unprivileged: the hard limit stays
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, top))
            return top
    new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        return soft
    return new


def _nr_open() -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20  # the kernel's default


def fd_share(per_target: int, targets: int, kept: float, at_least: int) -> int:
    """How many chunk files each of *targets* fd caches may keep open:
    *per_target*, or what the open-file limit (raised first) leaves once a
    *kept* fraction of it, and at least *at_least* fds, stay for everything
    else the process opens (sockets, logs, LMDB, files opened by writes).
    A low limit makes the caches smaller, never an open fail with EMFILE."""
    targets = max(1, targets)
    wanted = max(math.ceil(per_target * targets / (1 - kept)), per_target * targets + at_least)
    return share_of_limit(raise_fd_limit(wanted), per_target, targets, kept, at_least)


def share_of_limit(limit: int, per_target: int, targets: int, kept: float, at_least: int) -> int:
    """`fd_share` for an open-file *limit* already known (at least 16 each;
    of a limit below twice *at_least*, half is kept)."""
    spare = limit - max(min(at_least, limit // 2), math.ceil(limit * kept))
    return max(16, min(per_target, spare // max(1, targets)))


class _Groups(Generic[K]):
    """The keys of a cache per group (the chunks of one file), so that a
    group is dropped in time proportional to its size, not the cache's."""

    def __init__(self, group: Callable[[K], Hashable] | None) -> None:
        self.group = group
        self._keys: dict[Hashable, set[K]] = {}

    def add(self, key: K) -> None:
        if self.group is not None:
            self._keys.setdefault(self.group(key), set()).add(key)

    def discard(self, key: K) -> None:
        if self.group is not None:
            g = self.group(key)
            members = self._keys.get(g)
            if members is not None:
                members.discard(key)
                if not members:
                    del self._keys[g]

    def pop(self, group: Hashable) -> set[K]:
        if self.group is None:
            raise ValueError("this cache was built without groups")
        return self._keys.pop(group, set())

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)


class RecordCache(Generic[K, V]):
    """With *group*, the keys of one group (the chunks of one file) can be
    invalidated together in time proportional to the group, not the cache."""

    def __init__(self, capacity: int, group: Callable[[K], Hashable] | None = None) -> None:
        self.capacity = max(1, capacity)
        self._data: OrderedDict[K, V | Missing] = OrderedDict()
        self._groups: _Groups[K] = _Groups(group)
        self._lock = threading.Lock()
        self.epoch = 0
        self.lookups = LookupCounts.of(self, "record")

    def get(self, key: K) -> V | Missing | None:
        """The cached value, MISSING if known absent, None if not cached."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.lookups.misses += 1
            else:
                self.lookups.hits += 1
                self._data.move_to_end(key)
        return value

    def fill(self, key: K, value: V | Missing, epoch: int) -> None:
        """Insert what a reader loaded, unless an update happened since *epoch*."""
        with self._lock:
            if epoch != self.epoch:
                return
            self._insert(key, value)

    def set(self, key: K, value: V | Missing) -> None:
        """A writer's committed value (under the chunk's lock)."""
        with self._lock:
            self.epoch += 1
            self._insert(key, value)

    def _insert(self, key: K, value: V | Missing) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        self._groups.add(key)
        while len(self._data) > self.capacity:
            old, _ = self._data.popitem(last=False)
            self._groups.discard(old)

    def invalidate(self, key: K) -> None:
        """Forget *key* (a fill in flight is dropped too)."""
        with self._lock:
            self.epoch += 1
            if self._data.pop(key, None) is not None:
                self._groups.discard(key)

    def invalidate_group(self, group: Hashable) -> None:
        """`invalidate` every key of *group* (needs *group* at construction)."""
        with self._lock:
            self.epoch += 1
            for key in self._groups.pop(group):
                del self._data[key]

    def clear(self) -> None:
        with self._lock:
            self.epoch += 1
            self._data.clear()
            self._groups.clear()

    def __len__(self) -> int:
        return len(self._data)


class FdHandle:
    """A reference to an open file descriptor; the fd stays open until every
    holder released it, even if the cache evicted or invalidated it meanwhile
    (closing it under a reader would let the number be reused for another
    file and the reader pread the wrong chunk)."""

    __slots__ = ("closed", "evicted", "fd", "refs")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.refs = 1
        self.evicted = False
        self.closed = False


class FdCache(Generic[K]):
    """With *group*, the keys of one group (the chunks of one file) can be
    invalidated together in time proportional to the group, not the cache."""

    def __init__(self, capacity: int, group: Callable[[K], Hashable] | None = None) -> None:
        self.capacity = max(1, capacity)
        self._data: OrderedDict[K, FdHandle] = OrderedDict()
        self._groups: _Groups[K] = _Groups(group)
        self._lock = threading.Lock()
        self.epoch = 0
        # A fill is refused if its key was invalidated after its epoch was
        # noted: with groups, the epoch of each group's last invalidation
        # (the most recent MAX_STALE_GROUPS; those dropped count as
        # invalidated at `_stale_floor`), so that an open that waited long
        # (in io_uring, while other files were forgotten) is still cached.
        self._stale: OrderedDict[Hashable, int] = OrderedDict()
        self._stale_floor = 0  # invalidations of no known group (all keys): at or before this
        self.opened = 0  # fds this cache has taken ownership of (for tests and stats)
        self.closed = 0
        self.lookups = LookupCounts.of(self, "fd")

    def get(self, key: K) -> FdHandle | None:
        """A referenced handle, or None if not cached. Release it after use."""
        with self._lock:
            handle = self._data.get(key)
            if handle is None:
                self.lookups.misses += 1
            else:
                self.lookups.hits += 1
                self._data.move_to_end(key)
                handle.refs += 1
        return handle

    def put(self, key: K, fd: int, epoch: int) -> FdHandle:
        """Take ownership of *fd* (opened by the caller after it noted *epoch*)
        and return a referenced handle for it. The fd is cached only if
        nothing was invalidated meanwhile; if another thread cached the same
        file first, that handle is returned and *fd* closed."""
        with self._lock:
            self.opened += 1
            existing = self._data.get(key)
            if existing is not None:
                existing.refs += 1
                self._data.move_to_end(key)
                self._close(fd)
                return existing
            handle = FdHandle(fd)
            if self._invalidated_since(key, epoch):
                handle.evicted = True  # used once, closed on release
                return handle
            self._data[key] = handle
            self._groups.add(key)
            while len(self._data) > self.capacity:
                old_key, old = self._data.popitem(last=False)
                self._groups.discard(old_key)
                self._retire(old)
            return handle

    def _invalidated_since(self, key: K, epoch: int) -> bool:
        """Was *key* (its group, or every key) invalidated after *epoch*?"""
        if self._groups.group is None:
            return epoch != self.epoch
        return self._stale.get(self._groups.group(key), self._stale_floor) > epoch

    def _mark_stale(self, key: K | None = None, group: Hashable = None) -> None:
        """An invalidation (of *key*'s group, of *group*, or of all keys):
        a new epoch, and fills noted before it refused."""
        self.epoch += 1
        if self._groups.group is None:
            return
        if key is None and group is None:
            self._stale.clear()
            self._stale_floor = self.epoch
            return
        g = self._groups.group(key) if key is not None else group
        self._stale[g] = self.epoch
        self._stale.move_to_end(g)
        while len(self._stale) > MAX_STALE_GROUPS:
            _, at = self._stale.popitem(last=False)
            self._stale_floor = max(self._stale_floor, at)

    def release(self, handle: FdHandle) -> None:
        with self._lock:
            handle.refs -= 1
            if handle.evicted and handle.refs == 0 and not handle.closed:
                handle.closed = True
                self._close(handle.fd)

    def invalidate(self, key: K) -> None:
        """The file is being replaced or removed: forget it (closing the fd
        once the last reader is done)."""
        with self._lock:
            self._mark_stale(key=key)
            handle = self._data.pop(key, None)
            if handle is not None:
                self._groups.discard(key)
                self._retire(handle)

    def invalidate_group(self, group: Hashable) -> None:
        """`invalidate` every key of *group* (needs *group* at construction)."""
        with self._lock:
            self._mark_stale(group=group)
            self._retire_group(group)

    def close_group(self, group: Hashable) -> None:
        """Close the fds of *group* (each once its last reader is done),
        without refusing the fills already under way as `invalidate_group`
        does: for files that did not change, only stopped being used (a
        file's last close; its removal elsewhere must then free the space of
        its chunks). A fill racing with it caches its fd again, to be closed
        by eviction or the file's next close."""
        with self._lock:
            self._retire_group(group)

    def _retire_group(self, group: Hashable) -> None:
        for key in self._groups.pop(group):
            self._retire(self._data.pop(key))

    def _retire(self, handle: FdHandle) -> None:
        handle.evicted = True
        if handle.refs == 0 and not handle.closed:
            handle.closed = True
            self._close(handle.fd)

    def _close(self, fd: int) -> None:
        self.closed += 1
        os.close(fd)

    def close_all(self) -> None:
        with self._lock:
            self._mark_stale()
            handles = list(self._data.values())
            self._data.clear()
            self._groups.clear()
            for handle in handles:
                self._retire(handle)

    def __len__(self) -> int:
        return len(self._data)
