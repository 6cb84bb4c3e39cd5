"""A written file's length, as this client owes it to the metadata server:
reported (with the time of its writes) once its writes have landed, and in
order with the file's setattrs, so that no reply older than a report hands
the kernel a size from before it (`InodeState.meta_lock`; `FileSystem.getattr`
takes it too). Any other reply (a lookup, a listing) that was answered before
a report but is handled after it gives way to the report's attributes
(`InodeState.newest`, by the `change` counter).

An explicit mtime set after writes not reported yet (``cp -p`` on the open
file, ``tar x`` after its close) is kept: the reports still to come leave the
mtime (`InodeState.mtime_set`), and the setattr need not wait for the
writes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from shufflefs.client.meta_client import MetaClient
from shufflefs.client.write_behind import InodeState
from shufflefs.metadata.protocol import Attr, MetaStub
from shufflefs.rpc.errors import FsError


async def report_length(meta: MetaClient, ino: int, st: InodeState) -> None:
    """Report how far this client wrote *ino* (and when, unless an explicit
    mtime came since)."""
    generation = st.generation
    async with st.meta_lock:
        mtime = None if st.mtime_set else st.mtime
        attr = await meta.call_idempotent(
            "update_length", lambda m: m.update_length(ino, st.size, mtime)
        )
    attr = st.newest(attr)
    if st.generation == generation:
        st.dirty = False
        st.size = attr["size"]


async def setattr_in_order(
    meta: MetaClient,
    st: InodeState | None,
    call: Callable[[MetaStub], Awaitable[Attr]],
    sets_mtime: bool,
) -> Attr:
    """The setattr *call*, never overlapping a length report of the file;
    an explicit mtime (*sets_mtime*) over unreported writes is kept by the
    reports to come, or taken back if the setattr is refused. Every field is
    an absolute value, so applying it twice is harmless: retried through any
    transient failure (a truncate whose reply was late because a storage
    replica died meanwhile must not fail)."""
    if st is None:
        return await meta.call_idempotent("setattr", call)
    marked = sets_mtime and st.dirty
    if marked:
        st.mtime_set = True
    try:
        async with st.meta_lock:
            return await meta.call_idempotent("setattr", call)
    except FsError:
        if marked:
            st.mtime_set = False  # refused (EPERM...): the writes' time is reported after all
        raise
