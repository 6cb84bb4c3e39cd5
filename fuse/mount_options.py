"""`shufflefs mount -o ...`: the options, their defaults per mode, and their checks.

Two modes (docs/operations.md, "Mount modes and caches" states what a reader
sees when):

* ``rw`` (the default): close-to-open. An open of a file cached here makes
  no round trip while the mount's cache watch holds (the metadata server
  tells it of every change first: client/cache_watch.py), else one read-only
  call (``no_cache_watch``: always); kernel timeouts default to 1 s,
  negative entries are not cached.
* ``ro`` (a dataset mode for data nobody changes): every mutation answers
  EROFS, opens and closes make no round trip once a file was opened, and
  kernel timeouts default to `DATASET_TIMEOUT`.
* ``cache=immutable`` (implies ``ro``): as ``ro``, and the kernel serves
  warm reads alone: no OPEN, FLUSH or RELEASE reaches the mount
  (fuse/inode_reads.py), at the price of POSIX's keep-while-open for files
  removed elsewhere.

``writeback`` (closes finish behind) and ``writeback_cache`` (the kernel's
writeback cache, which trusts its own sizes and times of the files it holds)
refine ``rw`` for ingestion.

Every kernel cache timeout is an option (``attr_timeout=``, ``entry_timeout=``,
``negative_timeout=``, seconds, as in JuiceFS and 3FS); what was given and what
it defaulted to are reported with the mount's metadata session, so
``shufflefs status`` can list them for every mount.
"""

from __future__ import annotations

import errno
import math
from dataclasses import dataclass

from shufflefs.cluster.node import listen_address
from shufflefs.cluster.preflight import parse_size
from shufflefs.fuse.dir_ahead import DEFAULT_ENTRIES as DIR_AHEAD
from shufflefs.fuse.dir_ahead import MAX_ENTRIES as MAX_DIR_AHEAD
from shufflefs.fuse.kept_listings import DEFAULT_ENTRIES as KEEP_LISTINGS
from shufflefs.fuse.kept_listings import MAX_ENTRIES as MAX_KEEP_LISTINGS
from shufflefs.fuse.libfuse import SPIN
from shufflefs.fuse.list_ahead import DEFAULT_DIRS as LIST_AHEAD
from shufflefs.fuse.list_ahead import MAX_DIRS as MAX_LIST_AHEAD
from shufflefs.fuse.prefetch import DEFAULT_MEMORY
from shufflefs.metadata.protocol import MountInfo
from shufflefs.rpc.errors import FsError

RW_TIMEOUT = 1.0  # s: attr/entry cache of a read-write mount
DATASET_TIMEOUT = 300.0  # s: every kernel cache timeout of an -o ro mount
MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: the kernel keeps timeouts as jiffies; beyond is a typo
RW_LINGER = 5.0  # s a read-write mount keeps an idle read-only handle for the next open
# ... with its cache watch: the server tells the mount when a cached file
# changes or loses its name (the handle is then given back at once), so
# keeping it longer only costs memory (bounded by the open cache's limit) and
# saves a loader an open, or a lookup, per sample in epochs under this long
WATCHED_LINGER = 30.0
DATASET_LINGER = DATASET_TIMEOUT
MAX_TASKS = 1024

TIMEOUTS = ("attr_timeout", "entry_timeout", "negative_timeout")
FLAGS = (
    "ro",
    "rw",
    "no_local_reads",
    "no_fast_reads",
    "no_fast_answers",
    "no_cache_watch",
    "writeback",
    "writeback_cache",
    "debug",
)
VALUED = (
    *TIMEOUTS,
    "handle_linger",
    "max_tasks",
    "prefetch_memory",
    "metrics",
    "cache",
    "spin_us",
    "dir_ahead",
    "list_ahead",
    "keep_listings",
)
MAX_SPIN_US = 10_000


@dataclass
class MountOptions:
    """What the FUSE layer and the client need to know of the mount's options."""

    read_only: bool = False
    immutable: bool = False  # cache=immutable: no opens (fuse/inode_reads.py)
    attr_timeout: float = RW_TIMEOUT
    entry_timeout: float = RW_TIMEOUT
    negative_timeout: float = 0.0
    # s an idle read-only handle is kept (with its layout) for the next open;
    # also the bound on how long a file removed elsewhere keeps its space
    # for this mount after its last close here
    handle_linger: float = RW_LINGER
    max_tasks: int = 64
    local_reads: bool = True
    fast_reads: bool = True  # READs answered off the event loop (fuse/fast_reads.py)
    fast_answers: bool = True  # what the caches answer, in libfuse's callback (fast_answers.py)
    cache_watch: bool = True  # rw: cached opens kept fresh by the server (client/cache_watch.py)
    writeback: bool = False  # closes of written files finish in the background (fuse/writeback.py)
    # the kernel's writeback cache: write(2)s gather in its page cache, sent
    # as page-sized WRITEs at close (and it trusts its own sizes and times of
    # the files it holds: docs/operations.md)
    writeback_cache: bool = False
    prefetch_memory: int = DEFAULT_MEMORY  # bytes read ahead on hints (fuse/prefetch.py)
    spin: float = SPIN  # s the FUSE thread polls its empty queue before sleeping (libfuse.py)
    dir_ahead: int = DIR_AHEAD  # entries of a directory opened ahead on a lookup miss (0: off)
    list_ahead: int = LIST_AHEAD  # subdirectories listed ahead of a walk (0: off)
    keep_listings: int = KEEP_LISTINGS  # entries of whole listings kept (ro, immutable; 0: off)
    metrics: str | None = None  # host:port of the Prometheus endpoint (default: client.toml's)
    debug: bool = False

    def fuse_options(self) -> set[str]:
        """The options handed to the kernel/libfuse (beside ours)."""
        out = {"ro"} if self.read_only else set()
        if self.debug:
            out.add("debug")
        return out

    def info(self, mountpoint: str) -> MountInfo:
        """What the mount reports with its metadata session (`shufflefs status`)."""
        return {
            "mountpoint": mountpoint,
            "mode": "immutable"
            if self.immutable
            else "ro"
            if self.read_only
            else "writeback"
            if self.writeback
            else "rw",
            "attr_timeout": self.attr_timeout,
            "entry_timeout": self.entry_timeout,
            "negative_timeout": self.negative_timeout,
            "handle_linger": self.handle_linger,
        }


def parse_options(items: list[str]) -> MountOptions:
    """``-o`` values (each comma separated, repeatable) into MountOptions.
    Unknown options and bad values are EINVAL naming the option."""
    given: dict[str, str] = {}
    for item in ",".join(items).split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        if key in FLAGS and not eq:
            given[key] = ""
        elif key in VALUED and eq:
            given[key] = value
        elif key in FLAGS or key in VALUED:
            raise FsError(errno.EINVAL, f"mount option {item!r}: " + _usage(key))
        else:
            raise FsError(errno.EINVAL, f"unknown mount option {item!r}")
    if "ro" in given and "rw" in given:
        raise FsError(errno.EINVAL, "mount options 'ro' and 'rw' contradict each other")
    cache = given.get("cache")
    if cache is not None and cache != "immutable":
        raise FsError(errno.EINVAL, f"mount option 'cache={cache}': the one mode is immutable")
    if cache == "immutable" and "rw" in given:
        raise FsError(errno.EINVAL, "mount option 'cache=immutable' needs a read-only mount")
    read_only = "ro" in given or cache == "immutable"
    for key in ("writeback", "writeback_cache"):
        if read_only and key in given:
            raise FsError(errno.EINVAL, f"mount option {key!r} needs a read-write mount")
    default = DATASET_TIMEOUT if read_only else RW_TIMEOUT
    options = MountOptions(
        read_only=read_only,
        immutable=cache == "immutable",
        attr_timeout=_seconds(given, "attr_timeout", default),
        entry_timeout=_seconds(given, "entry_timeout", default),
        negative_timeout=_seconds(given, "negative_timeout", default if read_only else 0.0),
        handle_linger=_seconds(
            given, "handle_linger", _linger(read_only, "no_cache_watch" in given)
        ),
        local_reads="no_local_reads" not in given,
        fast_reads="no_fast_reads" not in given,
        fast_answers="no_fast_answers" not in given,
        cache_watch="no_cache_watch" not in given,
        writeback="writeback" in given,
        writeback_cache="writeback_cache" in given,
        debug="debug" in given,
    )
    if "max_tasks" in given:
        options.max_tasks = _whole("max_tasks", given["max_tasks"], 1, MAX_TASKS)
    if "metrics" in given:
        try:
            listen_address(given["metrics"])
        except (FsError, ValueError):
            raise FsError(
                errno.EINVAL, f"mount option 'metrics={given['metrics']}': HOST:PORT expected"
            ) from None
        options.metrics = given["metrics"]
    if "prefetch_memory" in given:
        options.prefetch_memory = _size(given["prefetch_memory"])
    if "dir_ahead" in given:
        options.dir_ahead = _whole("dir_ahead", given["dir_ahead"], 0, MAX_DIR_AHEAD)
    if "list_ahead" in given:
        options.list_ahead = _whole("list_ahead", given["list_ahead"], 0, MAX_LIST_AHEAD)
    if "keep_listings" in given:
        options.keep_listings = _whole(
            "keep_listings", given["keep_listings"], 0, MAX_KEEP_LISTINGS
        )
    if "spin_us" in given:
        options.spin = _whole("spin_us", given["spin_us"], 0, MAX_SPIN_US, "microseconds") / 1e6
    return options


def _usage(key: str) -> str:
    if key in FLAGS:
        return "takes no value"
    if key == "cache":
        return "needs a value: cache=immutable"
    if key == "metrics":
        return "needs a value: metrics=HOST:PORT"
    if key == "prefetch_memory":
        return "needs a value: prefetch_memory=SIZE (0 turns hints off)"
    if key == "spin_us":
        return f"needs a value: spin_us=MICROSECONDS (0..{MAX_SPIN_US}, 0: off)"
    if key == "dir_ahead":
        return f"needs a value: dir_ahead=ENTRIES (0..{MAX_DIR_AHEAD}, 0: off)"
    if key == "list_ahead":
        return f"needs a value: list_ahead=DIRECTORIES (0..{MAX_LIST_AHEAD}, 0: off)"
    if key == "keep_listings":
        return f"needs a value: keep_listings=ENTRIES (0..{MAX_KEEP_LISTINGS}, 0: off)"
    if key == "max_tasks":
        return f"needs a value: max_tasks=N (1..{MAX_TASKS})"
    return f"needs a value: {key}=SECONDS"


def _seconds(given: dict[str, str], key: str, default: float) -> float:
    if key not in given:
        return default
    text = given[key]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_TIMEOUT:  # also NaN
        raise FsError(
            errno.EINVAL,
            f"mount option '{key}={text}': seconds from 0 to {MAX_TIMEOUT:.0f} expected",
        )
    return value


def _whole(key: str, text: str, low: int, high: int, what: str = "a whole number") -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise FsError(errno.EINVAL, f"mount option '{key}={text}': {what} from {low} to {high}")
    return value


def _size(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return parse_size(text)
    except FsError:
        raise FsError(
            errno.EINVAL, f"mount option 'prefetch_memory={text}': a size such as 256M expected"
        ) from None


def _linger(read_only: bool, unwatched: bool) -> float:
    """The default `handle_linger` of a mount mode."""
    if read_only:
        return DATASET_LINGER
    return RW_LINGER if unwatched else WATCHED_LINGER
