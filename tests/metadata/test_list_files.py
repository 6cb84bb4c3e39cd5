"""`list_files` and `pending_jobs`, what `shufflefs fsck` checks storage
against: every regular file by inode (named or only held open), paged,
read-only (no LMDB write transaction), bad input refused."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

import pytest

from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.rpc import FsError

if TYPE_CHECKING:
    from metaservice import Env


async def test_every_regular_file_is_listed_by_inode_without_writing(env: Env) -> None:
    meta = env.meta
    d = await meta.mkdir(ROOT_INODE, b"d", 0o755, 0, 0)
    sizes = {}
    for i in range(5):
        ino, handle = await env.create(d["ino"], b"f%d" % i)
        await meta.update_length(ino, 1000 * i)
        await meta.release(ino, handle, env.session)
        sizes[ino] = 1000 * i
    held, handle = await env.create(d["ino"], b"held")
    await meta.update_length(held, 7)
    await meta.unlink(d["ino"], b"held")  # no name, still open: its chunks must stay
    sizes[held] = 7
    await meta.symlink(d["ino"], b"ln", b"f0", 0, 0)
    before = (env.store.txns.write_count, env.store.txns.commit_count)
    listed, after, pages = [], 0, 0
    while pages < 10:
        page = await meta.list_files(after, 2)
        pages += 1
        listed += page["files"]
        if not page["more"]:
            break
        after = page["files"][-1][0]
    assert [f[0] for f in listed] == sorted(sizes)
    assert {ino: size for ino, size, _ in listed} == sizes
    assert all(layout["chains"] and layout["chunk_size"] > 0 for _, _, layout in listed)
    assert isinstance(await meta.pending_jobs("truncate", 0, 10), list)
    assert (env.store.txns.write_count, env.store.txns.commit_count) == before
    await meta.release(held, handle, env.session)


async def test_bad_listing_requests_are_refused(env: Env) -> None:
    for call, code in (
        (lambda: env.meta.list_files(0, 0), errno.EINVAL),
        (lambda: env.meta.pending_jobs("nope"), errno.EINVAL),  # type: ignore[arg-type]
    ):
        with pytest.raises(FsError) as info:
            await call()
        assert info.value.code == code
    assert (await env.meta.statfs())["files"] >= 1  # the server still answers
