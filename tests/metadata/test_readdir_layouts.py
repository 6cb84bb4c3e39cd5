"""`readdir_layouts`: a directory's entries with every regular file's layout,
paged like readdir, read-only (no LMDB write transaction), bad input refused."""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

import pytest

from shufflefs.metadata.protocol import ROOT_INODE
from shufflefs.rpc import FsError

if TYPE_CHECKING:
    from metaservice import Env


async def test_listing_with_layouts_equals_readdir_and_open_and_writes_nothing(env: Env) -> None:
    meta = env.meta
    d = await meta.mkdir(ROOT_INODE, b"d", 0o755, 0, 0)
    files = {}
    for i in range(7):
        ino, handle = await env.create(d["ino"], b"f%d" % i)
        await meta.update_length(ino, 1000 * i)
        await meta.release(ino, handle, env.session)
        files[b"f%d" % i] = ino
    await meta.mkdir(d["ino"], b"sub", 0o755, 0, 0)
    await meta.symlink(d["ino"], b"ln", b"f0", 0, 0)
    expected = {}
    for name, ino in files.items():
        opened = await meta.open(ino, os.O_RDONLY, env.session)
        expected[name] = (opened["attr"], opened["layout"])
        await meta.release(ino, opened["handle"], env.session)
    before = (env.store.txns.write_count, env.store.txns.commit_count)

    entries, after = [], None
    pages = 0
    while True:  # pages of 3: the cursor is a name, as for readdir
        page = await meta.readdir_layouts(d["ino"], after, 3)
        pages += 1
        entries += page["entries"]
        if not page["more"]:
            break
        after = page["entries"][-1][0]
    assert pages == 3  # 9 entries
    plain = (await meta.readdir(d["ino"], None, 100))["entries"]
    assert [[n, a] for n, a, _ in entries] == [list(e) for e in plain]
    for name, attr, layout in entries:
        if name in expected:
            assert (attr, layout) == expected[name]
        else:
            assert layout is None  # a directory, a symlink
    assert (env.store.txns.write_count, env.store.txns.commit_count) == before


async def test_bad_listing_requests_are_refused(env: Env) -> None:
    ino, handle = await env.create(ROOT_INODE, b"file")
    await env.meta.release(ino, handle, env.session)
    for args, code in (
        ((ino, None, 10), errno.ENOTDIR),
        ((ROOT_INODE, None, 0), errno.EINVAL),
        ((ROOT_INODE, b"x" * 300, 10), errno.EINVAL),
        ((987654, None, 10), errno.ENOENT),
    ):
        with pytest.raises(FsError) as info:
            await env.meta.readdir_layouts(*args)
        assert info.value.code == code
    assert (await env.meta.statfs())["files"] >= 1  # the server still answers
