"""A flush's length report as a close that gives no handle back (handle 0,
`Closes.report`): it carries, in one `close_files` call, the release that
lingers before it (the kernel's RELEASE of the writer's previous file,
`RELEASE_LINGER`); a server of before such reports takes the length and
refuses handle 0 (EINVAL, the text `check_ino` gives), and the client reports
alone from then on. The server here is a stand-in that records each call's
files; the real one is tests/metadata/test_close_files.py's."""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from shufflefs.client.length_reports import RELEASE_LINGER, Closes
from shufflefs.client.write_behind import InodeState


class Server:
    """`close_files`: the (ino, handle, length) of each call's files."""

    def __init__(self, takes_handle_0: bool = True) -> None:
        self.takes_handle_0 = takes_handle_0
        self.calls: list[list[tuple[int, int, int | None]]] = []

    async def close_files(self, files: list[dict[str, Any]], session: int) -> list[dict[str, Any]]:
        self.calls.append([(f["ino"], f["handle"], f["length"]) for f in files])
        out: list[dict[str, Any]] = []
        for f in files:
            attr = None
            if f["length"] is not None:
                attr = {"ino": f["ino"], "change": 1, "size": f["length"]}
            error = None
            if not f["handle"] and not self.takes_handle_0:
                error = [errno.EINVAL, "invalid handle number 0"]
            out.append({"attr": attr, "error": error})
        return out


class Meta:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def call_at_most_once(self, name: str, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        return await fn(self.server)


async def _release(ino: int, handle: int) -> None:
    raise AssertionError("close_files is there: no release on its own")


def written(size: int) -> InodeState:
    st = InodeState(size=size)
    st.dirty = True
    return st


async def test_a_flush_report_carries_the_release_lingering_before_it(
    mock_clock: trio.testing.MockClock,
) -> None:
    server = Server()
    closes = Closes(Meta(server), SimpleNamespace(id=7), _release)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(closes.close, 11, 100, None, RELEASE_LINGER)
        await trio.testing.wait_all_tasks_blocked()
        assert server.calls == []  # lingering (the clock stands still)
        st = written(500)
        assert await closes.report(12, st)
    assert server.calls == [[(11, 100, None), (12, 0, 500)]]
    assert not st.dirty  # reported
    # nothing to carry it: a release goes alone once its linger is over
    async with trio.open_nursery() as nursery:
        nursery.start_soon(closes.close, 12, 101, None, RELEASE_LINGER)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(RELEASE_LINGER)
    assert server.calls[1:] == [[(12, 101, None)]]


async def test_a_server_of_before_reports_in_close_gets_them_alone() -> None:
    server = Server(takes_handle_0=False)
    closes = Closes(Meta(server), SimpleNamespace(id=7), _release)  # type: ignore[arg-type]
    st = written(300)
    assert await closes.report(12, st)  # the length landed; handle 0 refused
    assert server.calls == [[(12, 0, 300)]] and not st.dirty
    assert not await closes.report(13, written(10))  # from then on: the caller reports alone
    assert server.calls == [[(12, 0, 300)]]
