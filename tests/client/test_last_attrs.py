"""`LastAttrs`: the newest attributes of closed files, by `change`, for a while."""

from __future__ import annotations

from typing import Any

from shufflefs.client.write_behind import LastAttrs


def attr(ino: int, change: int, size: int) -> Any:
    return {"ino": ino, "change": change, "size": size}


def test_an_older_reply_gives_way_and_a_newer_one_replaces_it() -> None:
    last = LastAttrs()
    last.keep(attr(1, 5, 26))
    assert last.newest(attr(1, 4, 0))["size"] == 26
    assert last.newest(attr(2, 1, 7))["size"] == 7  # never kept: as it is
    assert last.newest(attr(1, 9, 3))["size"] == 3  # another client's truncate
    assert last.newest(attr(1, 5, 26))["size"] == 3  # older than that now


def test_kept_for_a_while_and_at_most_limit_files() -> None:
    last = LastAttrs()
    last.LIMIT = 3
    for ino in range(5):
        last.keep(attr(ino, 5, 26))
    assert len(last) == 3 and last.newest(attr(0, 1, 0))["size"] == 0
    assert last.newest(attr(4, 1, 0))["size"] == 26
    last.REPLY_SECONDS = 0.0  # every reply handled now was sent after the close
    assert last.newest(attr(4, 1, 0))["size"] == 0
    last.keep(attr(9, 5, 26))
    assert len(last) == 0  # the expired ones pruned as a file is kept
