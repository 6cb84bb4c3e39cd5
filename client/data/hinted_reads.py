"""Open+read+close of files in a given order, hinting the next files to the
shufflefs mount first: what a DataLoader's worker does over a
one-file-per-sample dataset with prefetch along the shuffle. The
``fuse-prefetch`` row of `shufflefs bench files` runs it in each worker
process (`bench_files_work.do_prefetch_read`). Caches are the caller's to
drop."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from shufflefs.client.data.mount_hints import (
    DEFAULT_AHEAD,
    MountHints,
    lookahead,
    mount_root,
    mount_state,
)

CHUNK = 16  # files hinted per setxattr


def read_files(
    paths: Sequence[str], hint_ahead: int = DEFAULT_AHEAD, buffering: int = -1
) -> Iterator[bytes]:
    """Each file's bytes, in order, as read (one at a time: a sample is
    used and let go, as a loader does); with *hint_ahead* > 0 and the paths
    on a shufflefs mount with prefetch on, the next *hint_ahead* files are
    hinted ahead of the reads (nothing is hinted elsewhere). Each is opened
    with *buffering*, as `open` takes it."""
    hints = MountHints.find(paths, hint_ahead, whole_files=True) if hint_ahead > 0 else None

    def chunks() -> Iterator[range]:
        for lo in range(0, len(paths), CHUNK):
            yield range(lo, min(lo + CHUNK, len(paths)))

    order: Iterator[range] = chunks()
    if hints is not None:
        order = lookahead(order, hint_ahead, lambda r: hints.files(list(r)), len)
    try:
        for r in order:
            for i in r:
                with open(paths[i], "rb", buffering=buffering) as f:
                    yield f.read()
    finally:
        if hints is not None:
            hints.close()


def prefetch_available(path: str) -> bool:
    """Whether *path* (a file or directory, the mount point too) is on a
    shufflefs mount that takes prefetch hints."""
    try:
        return mount_state(mount_root(path)) is not None
    except OSError:
        return False
