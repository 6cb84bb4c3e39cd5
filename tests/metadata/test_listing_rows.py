"""Listings as rows (`readdir` and `watch_dir` with rows=True): the same
entries as the maps, every attribute in ATTR_ROW's order; and a server of
before rows, which refuses the argument, still lists for a client of now."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, get_type_hints

import pytest
import trio
from metaservice import SECRET

from shufflefs.metadata import listing_rows
from shufflefs.metadata.listing_rows import ATTR_ROW, entry_of_row
from shufflefs.metadata.protocol import ROOT_INODE, Attr, ReaddirPage, WatchedDirPage
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc import FsError, RpcServer, rpc_method

if TYPE_CHECKING:
    from metaservice import Env


def test_a_row_holds_every_attribute_once() -> None:
    assert sorted(ATTR_ROW) == sorted(get_type_hints(Attr))
    row: list[Any] = [b"name", *range(100, 100 + len(ATTR_ROW))]
    name, attr = entry_of_row(row)
    assert name == b"name"
    assert [attr[k] for k in ATTR_ROW] == row[1:]  # type: ignore[literal-required]


async def _make_dir(env: Env) -> int:
    meta = env.meta
    d = (await meta.mkdir(ROOT_INODE, b"rows", 0o755, 0, 0))["ino"]
    for i in range(9):
        ino, handle = await env.create(d, b"f%d" % i)
        await meta.update_length(ino, 1000 * i + 1)
        await meta.release(ino, handle, env.session)
    await meta.mkdir(d, b"sub", 0o755, 0, 0)
    await meta.symlink(d, b"ln", b"f0", 0, 0)
    return d


async def _raw(env: Env, method: str, **args: Any) -> Any:
    return (await env.meta.rpc.request(env.meta.address, method, args, timeout=5.0)).result


async def test_rows_are_the_maps_entries_in_pages_and_watched(env: Env) -> None:
    d = await _make_dir(env)
    maps = (await _raw(env, "readdir", ino=d, after=None, limit=100))["entries"]
    rows = (await _raw(env, "readdir", ino=d, after=None, limit=100, rows=True))["entries"]
    assert len(rows) == len(maps) == 11
    assert all(len(r) == 1 + len(ATTR_ROW) for r in rows)
    assert [entry_of_row(r) for r in rows] == [(n, a) for n, a in maps]
    sub = next(a for n, a in maps if n == b"sub")
    assert sub["parent"] == d  # a directory's parent is in its row too
    # the stub asks for rows, pages by name as ever
    listed, after = [], None
    while True:
        page = await env.meta.readdir(d, after, 4)
        listed += page["entries"]
        if not page["more"]:
            break
        after = page["entries"][-1][0]
    assert listed == [(n, a) for n, a in maps]
    watched = await env.meta.watch_dir(env.session, d, 100)
    assert watched["entries"] == listed
    assert watched["attr"]["ino"] == d and watched["since"] == watched["attr"]["change"]
    with pytest.raises(FsError) as raised:
        await _raw(env, "readdir", ino=d, after=None, limit=100, rows="yes")
    assert raised.value.code == errno.EINVAL


class ServerOfBefore:
    """The metadata service's listing calls as they were before rows."""

    def __init__(self, env: Env) -> None:
        self.service = env.service

    @rpc_method(inline=True)
    async def readdir(self, ino: int, after: bytes | None = None, limit: int = 256) -> ReaddirPage:
        page: ReaddirPage = await self.service.readdir(ino, after, limit)
        return page

    @rpc_method
    async def watch_dir(
        self, session: int, ino: int, limit: int = 256, names: bool = False
    ) -> WatchedDirPage:
        page: WatchedDirPage = await self.service.watch_dir(session, ino, limit, names)
        return page


async def test_a_server_of_before_rows_still_lists(env: Env) -> None:
    d = await _make_dir(env)
    now = await env.meta.readdir(d, None, 100)

    def same(page: Any) -> bool:  # (maps come as lists, rows made into tuples)
        return [tuple(e) for e in page["entries"]] == now["entries"] and not page["more"]

    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            RpcServer(SECRET, [ServerOfBefore(env)], name="before").serve, "127.0.0.1", 0
        )
        address = f"127.0.0.1:{port}"
        before = MetaStub(env.meta.rpc, address)
        assert address not in listing_rows.ROWS_REFUSED
        assert same(await before.readdir(d, None, 100))
        assert address in listing_rows.ROWS_REFUSED  # asked once, remembered
        assert await before.readdir_rows(d, None, 100) is None  # (its callers ask for maps)
        assert same(await before.watch_dir(env.session, d, 100))
        assert same(await before.readdir(d, None, 100))
        nursery.cancel_scope.cancel()
    listing_rows.ROWS_REFUSED.discard(address)
