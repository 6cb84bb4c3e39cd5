"""`Closes` against a metadata server of before `close_files` took `attrs`
(its schema refuses the field: EINVAL): the attributes a writeback mount set
behind go by `setattr` first, then the close, from then on for every close.
The server here is a stand-in for that old server's answers only: its
refusal is the text the rpc schema gives (rpc/schema.py)."""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from shufflefs.client.length_reports import Closes
from shufflefs.client.write_behind import InodeState
from shufflefs.rpc.errors import FsError


class OldServer:
    """`close_files` without `attrs`, and `setattr`: what each call got."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def close_files(self, files: list[dict[str, Any]], session: int) -> list[dict[str, Any]]:
        for k, f in enumerate(files):
            if "attrs" in f:
                raise FsError(
                    errno.EINVAL, f"close_files: argument 'files'[{k}]: unexpected field 'attrs'"
                )
        self.calls.append(("close_files", [f["ino"] for f in files]))
        return [{"attr": None, "error": None} for _ in files]

    async def setattr(self, ino: int, **attrs: int) -> dict[str, Any]:
        self.calls.append(("setattr", (ino, attrs)))
        return {"ino": ino, "change": 1, "size": 0}


class Meta:
    def __init__(self, server: OldServer) -> None:
        self.server = server

    async def call_at_most_once(self, name: str, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        return await fn(self.server)

    async def call_idempotent(self, name: str, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        return await fn(self.server)


async def _release(ino: int, handle: int) -> None:
    raise AssertionError("close_files is there: no release on its own")


async def test_attributes_go_by_setattr_first_to_a_server_of_before_them() -> None:
    server = OldServer()
    closes = Closes(Meta(server), SimpleNamespace(id=7), _release)  # type: ignore[arg-type]
    st = InodeState(size=0)
    st.owed.update({"mode": 0o600, "uid": 5})
    await closes.close(11, 100, st)
    assert server.calls == [("setattr", (11, {"mode": 0o600, "uid": 5})), ("close_files", [11])]
    assert st.owed == {}
    # from then on, attributes first without trying the field again
    st2 = InodeState(size=0)
    st2.owed.update({"gid": 9})
    await closes.close(12, 101, st2)
    await closes.close(13, 102, None)
    assert server.calls[2:] == [
        ("setattr", (12, {"gid": 9})),
        ("close_files", [12]),
        ("close_files", [13]),
    ]
