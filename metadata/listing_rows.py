"""Listings as rows: `readdir` and `watch_dir` with rows=True send each
entry as one flat list, the name then the attributes in `ATTR_ROW`'s order,
instead of a name and a map (docs/metadata.md). Here: the row's shape, the
pages that carry rows, and the client's side of it (`entry_of_row`, and a
server of before rows, which refuses the argument)."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, TypedDict

from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.metadata.protocol import Attr

# A listing's entry as one flat row (`readdir`/`watch_dir` with rows=True):
# [name, *the Attr's values in this order]. A row is a third the size of a
# name and an Attr map on the wire, and packed and unpacked three times as
# fast; `entry_of_row` makes the pair callers use.
ATTR_ROW = (
    "ino",
    "mode",
    "nlink",
    "uid",
    "gid",
    "rdev",
    "size",
    "atime",
    "mtime",
    "ctime",
    "parent",
    "change",
)
EntryRow = list[Any]  # [name: bytes, ino, mode, ... change: int], ATTR_ROW's order


class ReaddirRowsPage(TypedDict):
    entries: list[EntryRow]  # as ReaddirPage's, each as a row
    more: bool


class WatchedDirRowsPage(TypedDict):
    entries: list[EntryRow]  # as WatchedDirPage's, each as a row
    more: bool
    attr: Attr
    since: int | None


def entry_of_row(row: EntryRow) -> tuple[bytes, Attr]:
    """A listing row as (name, attributes)."""
    name, ino, mode, nlink, uid, gid, rdev, size, atime, mtime, ctime, parent, change = row
    return name, {
        "ino": ino,
        "mode": mode,
        "nlink": nlink,
        "uid": uid,
        "gid": gid,
        "rdev": rdev,
        "size": size,
        "atime": atime,
        "mtime": mtime,
        "ctime": ctime,
        "parent": parent,
        "change": change,
    }


def rows_refused(exc: FsError) -> bool:
    """A server of before rows refuses the argument (then: ask for maps)."""
    return exc.code == errno.EINVAL and "'rows'" in exc.message


# addresses of metadata servers that refused rows (a server of before them,
# in a rolling upgrade): listings from them come as maps
ROWS_REFUSED: set[str] = set()
