"""Argument checks: everything a peer sends is checked before it is used.

The checks run before any transaction is opened, so a malformed request
costs nothing and never takes the writer's lock. The errnos are Linux's for
the same mistake on a local filesystem.
"""

from __future__ import annotations

import errno

from shufflefs.metadata.protocol import NAME_MAX, SYMLINK_MAX, XATTR_NAME_MAX, MountInfo
from shufflefs.rpc.errors import FsError

U64_MAX = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
ID32_MAX = (1 << 32) - 1  # uid, gid, pid
PATH_MAX = 4096
SESSION_FIELD_MAX = 256
MOUNTPOINT_MAX = 4096
TIMEOUT_MAX = 1e9  # seconds: a mount's reported timeouts (NaN fails the range check too)
DOTS = (b".", b"..")
XATTR_PREFIXES = (b"user.", b"trusted.", b"security.", b"system.")
ACL_PREFIX = b"system.posix_acl_"


def check_ino(ino: int, what: str = "inode") -> None:
    if not 0 < ino <= U64_MAX:
        raise FsError(errno.EINVAL, f"invalid {what} number {ino}")


def check_name(name: bytes) -> None:
    if not name or b"/" in name or b"\0" in name:
        raise FsError(errno.EINVAL, f"invalid name {name[:64]!r}")
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG, f"name of {len(name)} bytes is longer than {NAME_MAX}")


def check_new_name(name: bytes) -> None:
    """A name to create: '.' and '..' always exist."""
    check_name(name)
    if name in DOTS:
        raise FsError(errno.EEXIST, f"{name!r} always exists")


def check_id(value: int, what: str) -> None:
    if not 0 <= value <= ID32_MAX:
        raise FsError(errno.EINVAL, f"invalid {what} {value}")


def check_owner(uid: int, gid: int) -> None:
    check_id(uid, "uid")
    check_id(gid, "gid")


def check_time(value: int, what: str) -> None:
    if not I64_MIN <= value <= I64_MAX:
        raise FsError(errno.EINVAL, f"{what} {value} out of range")


def check_mode(mode: int) -> None:
    if not 0 <= mode <= 0xFFFFFFFF:
        raise FsError(errno.EINVAL, f"invalid mode {mode}")


def check_setattr(
    mode: int | None = None,
    uid: int | None = None,
    gid: int | None = None,
    size: int | None = None,
    atime: int | None = None,
    mtime: int | None = None,
) -> None:
    """The values of a setattr (the server's, and a writeback mount's that
    sends them with the file's close: client/fs.py `setattr_behind`)."""
    if mode is not None:
        check_mode(mode)
    for what, owner in (("uid", uid), ("gid", gid)):
        if owner is not None:
            check_id(owner, what)
    if size is not None:
        check_size(size)
    for what, when in (("atime", atime), ("mtime", mtime)):
        if when is not None:
            check_time(when, what)


def check_rdev(rdev: int) -> None:
    if not 0 <= rdev <= U64_MAX:
        raise FsError(errno.EINVAL, f"invalid rdev {rdev}")


def check_size(size: int, what: str = "size") -> None:
    if size < 0:
        raise FsError(errno.EINVAL, f"negative {what} {size}")


def check_path(path: bytes) -> None:
    """An absolute path for `resolve`."""
    if not path:
        raise FsError(errno.ENOENT, "empty path")
    if not path.startswith(b"/"):
        raise FsError(errno.EINVAL, f"path {path[:64]!r} is not absolute")
    if len(path) >= PATH_MAX:
        raise FsError(errno.ENAMETOOLONG, f"path of {len(path)} bytes")
    if b"\0" in path:
        raise FsError(errno.EINVAL, "path contains NUL")


def check_symlink_target(target: bytes) -> None:
    if not target:
        raise FsError(errno.ENOENT, "empty symlink target")
    if len(target) > SYMLINK_MAX:
        raise FsError(errno.ENAMETOOLONG, f"symlink target of {len(target)} bytes")
    if b"\0" in target:
        raise FsError(errno.EINVAL, "symlink target contains NUL")


def check_session_fields(client: str, host: str, pid: int, mount: MountInfo | None = None) -> None:
    for what, value in (("client", client), ("host", host)):
        if len(value) > SESSION_FIELD_MAX:
            raise FsError(errno.EINVAL, f"session {what} longer than {SESSION_FIELD_MAX}")
    if not 0 <= pid <= ID32_MAX:
        raise FsError(errno.EINVAL, f"invalid pid {pid}")
    if mount is not None:
        if len(mount["mountpoint"]) > MOUNTPOINT_MAX:
            raise FsError(errno.EINVAL, f"mountpoint longer than {MOUNTPOINT_MAX}")
        times = (mount["attr_timeout"], mount["entry_timeout"], mount["negative_timeout"])
        for seconds in (*times, mount["handle_linger"]):
            if not 0 <= seconds <= TIMEOUT_MAX:
                raise FsError(errno.EINVAL, f"mount timeout {seconds!r} out of range")


def check_xattr_name(name: bytes) -> None:
    """Linux's order: length (ERANGE), then the namespace (EOPNOTSUPP)."""
    if not name or len(name) > XATTR_NAME_MAX:
        raise FsError(errno.ERANGE, f"xattr name of {len(name)} bytes (1..{XATTR_NAME_MAX})")
    if b"\0" in name:
        raise FsError(errno.EINVAL, "xattr name contains NUL")
    prefix = next((p for p in XATTR_PREFIXES if name.startswith(p)), None)
    if prefix is None:
        raise FsError(errno.EOPNOTSUPP, f"xattr namespace of {name[:64]!r} not supported")
    if name == prefix:
        raise FsError(errno.EINVAL, f"xattr name {name!r} is only a namespace")
    if name.startswith(ACL_PREFIX):
        raise FsError(errno.EOPNOTSUPP, "POSIX ACLs are not supported")
