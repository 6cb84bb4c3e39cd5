"""The metadata server's wire protocol: message shapes and constants (the
typed client stub is `metadata/stub.py`).

Inodes are 64-bit ids (root = 1). Times are integer nanoseconds since the
epoch. Names are bytes (any byte but ``/`` and NUL, 1..255 bytes long).
Errors are POSIX errnos, exactly those Linux gives for the same operation on a
local filesystem (ENOENT, ENOTDIR, EEXIST, ENOTEMPTY, ENAMETOOLONG, EISDIR,
EINVAL, EPERM, ENODATA, ERANGE, E2BIG, ...).

Permission checks are not made here: the kernel makes them on the mount
(``default_permissions``), and a native client holding the cluster secret is
trusted like root. uid/gid of new inodes come from the caller.
"""

from __future__ import annotations

import errno
from typing import Any, Literal, NotRequired, TypedDict

ROOT_INODE = 1
NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
SYMLINK_MAX = 4095

READDIR_MAX = 1024  # a readdir page holds at most this many entries, whatever the limit asked
# open/create naming a session the server does not hold (expired, closed, or
# lost) fail with this errno: open a new session and call again. Distinct from
# ENOENT so it cannot be mistaken for a missing file, and not a transient code
# so a retry loop does not repeat the call with the same dead session.
SESSION_EXPIRED = errno.EKEYEXPIRED

# setxattr flags (as in <sys/xattr.h>)
XATTR_CREATE = 1
XATTR_REPLACE = 2
# rename flags (as in <linux/fs.h>)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


RO_HANDLE_BIT = 1 << 62  # set in every read-only handle id (held in the server's memory only)


def is_read_only_handle(handle: int) -> bool:
    return handle > 0 and bool(handle & RO_HANDLE_BIT)


class Layout(TypedDict):
    chunk_size: int  # power of two
    chains: list[int]  # chunk k of the file lives on chains[k % len(chains)]


class Attr(TypedDict):
    ino: int
    mode: int  # file type and permission bits, as st_mode
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    atime: int  # ns
    mtime: int  # ns
    ctime: int  # ns
    parent: int  # for directories, the parent's inode ('..'); 0 otherwise
    # raised by every committed change of the inode (its data's length
    # report included): equal counters mean an unchanged file
    change: int


class OpenResult(TypedDict):
    attr: Attr
    layout: Layout | None  # None for anything but a regular file
    handle: int  # pass to release(); keeps an unlinked file alive until then
    created: NotRequired[bool]  # create made the file (it has no xattrs yet)
    # create made the file: the parent directory's attributes after it (the
    # kernel drops its cached ones on a create and would ask for them next)
    parent_attr: NotRequired[Attr]


class Unlinked(TypedDict):
    """What an unlink did (the store's answer; the RPC answers *parent_attr*)."""

    freed: bool  # the last name of an inode nobody holds: freed (a GC job now)
    parent_attr: Attr  # the directory after it (the kernel asks for it next)


class ReaddirPage(TypedDict):
    entries: list[tuple[bytes, Attr]]  # in name order, '.' and '..' not included
    more: bool  # another page follows: call again with after = the last name


class ReaddirLayoutsPage(TypedDict):
    entries: list[tuple[bytes, Attr, Layout | None]]  # as ReaddirPage, with regular files' layouts
    more: bool


class FilesPage(TypedDict):
    files: list[tuple[int, int, Layout]]  # (inode, size, layout) of regular files, by inode
    more: bool  # another page follows: call again with after = the last inode


class PendingJob(TypedDict):
    """A GC or truncate job the metadata server still owes storage
    (metadata/jobs.py): its chunks past *size* on *layout* are about to go
    (a GC job's size is 0: every chunk)."""

    ino: int
    size: int
    layout: Layout


class Session(TypedDict):
    session: int
    lease: float  # seconds: renew well before; an expired session's handles are closed


class MountInfo(TypedDict):
    """What a FUSE mount tells the metadata server of itself at session open,
    so `shufflefs status` can list every mount (fuse/mount_options.py)."""

    mountpoint: str
    mode: Literal["rw", "writeback", "ro", "immutable"]  # writeback: rw, closes behind
    attr_timeout: float  # seconds, as handed to the kernel
    entry_timeout: float
    negative_timeout: float
    handle_linger: float  # seconds an idle read-only handle is kept for the next open


class SessionInfo(TypedDict):
    session: int
    client: str
    host: str
    pid: int
    created: float  # wall-clock seconds
    expires: float
    mount: MountInfo | None  # None: not a mount (the native client, a tool)
    open_ro: int  # read-only handles it holds now (in the server's memory)


class OwedAttrs(TypedDict, total=False):
    """Attributes a writeback mount set on a file it has open for writing
    and sends with the file's close (`setattr`'s fields but the size)."""

    mode: int
    uid: int
    gid: int
    atime: int
    mtime: int


class WrittenClose(TypedDict):
    """One close of a handle open for writing, in `close_files`."""

    ino: int
    handle: int  # given back last (0: none, a flush's report of a handle still open)
    length: int | None  # reported first, as `update_length` does (None: no report)
    mtime: int | None  # with the length: the time of the writes (ns), or None to keep it
    attrs: NotRequired[OwedAttrs]  # then set, as `setattr` does (absent: none)


class ClosedFile(TypedDict):
    """How one close of `close_files` went (each on its own)."""

    attr: Attr | None  # after the length report and the attrs (None: neither asked, or failed)
    error: list[Any] | None  # [errno, message] if this close failed


class NewFile(TypedDict):
    """One file of `create_files`: `create`'s arguments but the session."""

    parent: int
    name: bytes
    mode: int
    flags: int
    uid: int
    gid: int


class CreatedFile(TypedDict):
    """How one create of `create_files` went (each on its own)."""

    opened: OpenResult | None  # what `create` answers (None: it failed)
    error: list[Any] | None  # [errno, message] if this create failed


class FsStats(TypedDict):
    files: int  # inodes in use
    max_files: int


# the methods that change the namespace: they take a `request` id, the same
# through every retry, so that a retried one is answered, not applied again
MUTATIONS = frozenset(
    {
        "session_open",
        "session_renew",
        "session_close",
        "setattr",
        "update_length",
        "mknod",
        "mkdir",
        "create",
        "create_files",
        "open",
        "release",
        "release_read_only",
        "close_files",
        "unlink",
        "rmdir",
        "rename",
        "link",
        "symlink",
        "setxattr",
        "removexattr",
    }
)


class WatchedDirPage(TypedDict):
    entries: list[tuple[bytes, Attr]]  # the first page, as ReaddirPage's
    more: bool
    attr: Attr  # the directory's own, read before the page: its change counter
    # the change counter the session's watch of it runs from: the client may
    # trust the page only when it is attr's (None: not watched, too many)
    since: int | None


class CacheWatchReply(TypedDict):
    token: int  # the watcher's: a new one means trust nothing cached before
    seq: int  # acknowledge with this once `changed` is applied
    changed: list[list[int]]  # [ino, change counter now] of files this client caches
    lease: float  # seconds from the request's sending that the cache may be trusted
