"""A written file's length, as this client owes it to the metadata server:
reported (with the time of its writes) once its writes have landed, and in
order with the file's setattrs, so that no reply older than a report hands
the kernel a size from before it (`InodeState.meta_lock`; `FileSystem.getattr`
takes it too). Any other reply (a lookup, a listing) that was answered before
a report but is handled after it gives way to the report's attributes
(`InodeState.newest`, by the `change` counter), also when it is handled
after the file's last close (`LastAttrs`).

An explicit mtime set after writes not reported yet (``cp -p`` on the open
file, ``tar x`` after its close) is kept: the reports still to come leave the
mtime (`InodeState.mtime_set`), and the setattr need not wait for the
writes."""

from __future__ import annotations

import errno
import logging
import stat
import time
from collections.abc import Awaitable, Callable

from shufflefs.client.meta_client import MetaClient
from shufflefs.client.open_batch import Batcher
from shufflefs.client.session import Session
from shufflefs.client.write_behind import InodeState
from shufflefs.metadata.checks import check_setattr
from shufflefs.metadata.protocol import Attr, ClosedFile, OwedAttrs, WrittenClose
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.client.length_reports")

# a close carried out behind waits this long for others to share its call
BEHIND_LINGER = 0.003
# a release nobody waits for that owes nothing (the kernel's RELEASE after a
# FLUSH that reported): this long, for the writer's next flush to carry it
RELEASE_LINGER = 0.05


async def report_length(meta: MetaClient, ino: int, st: InodeState) -> None:
    """Report how far this client wrote *ino* (and when, unless an explicit
    mtime came since)."""
    generation = st.generation
    async with st.meta_lock:
        mtime = None if st.mtime_set else st.mtime
        attr = await meta.call_idempotent(
            "update_length", lambda m: m.update_length(ino, st.size, mtime)
        )
    _reported(st, generation, attr)


def _reported(st: InodeState, generation: int, attr: Attr) -> None:
    attr = st.newest(attr)
    if st.generation == generation:  # (no write since the report left)
        st.dirty = False
        st.size = attr["size"]


class Closes:
    """The closes of this client's handles open for writing: a file's length
    report (if it has writes unreported) and its handle given back in one
    metadata call, and closes that overlap (a writeback mount's closes
    behind, several writers' releases) in one call together (`close_files`,
    batched as client/open_batch.py batches opens): one round trip and one
    share of a group commit for many files. A metadata server of before
    `close_files` gets `update_length` and `release` (ENOSYS)."""

    def __init__(
        self, meta: MetaClient, session: Session, release: Callable[[int, int], Awaitable[None]]
    ) -> None:
        self.meta = meta
        self.session = session
        self.release = release  # one handle given back (`ReadOnlyCalls.release`)
        self.batch: Batcher[WrittenClose, ClosedFile] = Batcher(self._one, self._many, "close")
        self._close_files_supported = True  # until a metadata server answers ENOSYS
        self._attrs_in_close = True  # until one refuses `attrs` (a server of before them)
        self.reports_in_close = True  # until one refuses handle 0 (`report`)

    async def close(
        self, ino: int, handle: int, st: InodeState | None, linger: float = 0.0
    ) -> None:
        """Report *ino*'s length if *st* has writes unreported, and give
        *handle* back (also if the report failed); raise that file's error.
        A close nobody waits for (a writeback mount's, carried out behind;
        the kernel's RELEASE) waits up to *linger* seconds for others to
        share its call (`BEHIND_LINGER`, `RELEASE_LINGER`)."""
        if st is None or not (st.dirty or st.owed):
            closed = await self.batch.get(
                {"ino": ino, "handle": handle, "length": None, "mtime": None}, linger
            )
        else:
            generation = st.generation
            async with st.meta_lock:  # in order with the file's setattrs
                f: WrittenClose = {"ino": ino, "handle": handle, "length": None, "mtime": None}
                if st.dirty:
                    f["length"] = st.size
                    f["mtime"] = None if st.mtime_set else st.mtime
                owed = owed_now(st)
                if owed:
                    f["attrs"] = owed
                try:
                    closed = await self.batch.get(f, linger)
                finally:
                    sent_owed(st, owed)  # (the handle is gone whatever happened)
            if closed["attr"] is not None:
                _reported(st, generation, closed["attr"])
        if closed["error"] is not None:
            error = FsError.from_wire(closed["error"])
            if handle == 0 and error.code == errno.EINVAL and "handle number 0" in error.message:
                # a server of before reports in `close_files` took the
                # report, then refused to give handle 0 back
                self.reports_in_close = False
                return
            raise error

    async def report(self, ino: int, st: InodeState) -> bool:
        """A flush of a file with writes unreported (or attributes set
        behind): its report as a close that gives no handle back (handle 0),
        in one call with the closes that overlap it (a previous file's
        release waiting out `RELEASE_LINGER`), so a writer's flush and the
        release before it share a call and a group commit. False, and
        nothing done, for a server of before such reports: the caller
        reports alone."""
        if not self.reports_in_close:
            return False
        await self.close(ino, 0, st)
        return True

    async def _many(self, files: list[WrittenClose]) -> list[ClosedFile | None]:
        if not self._attrs_in_close:
            files = await self._attrs_first(files)
        try:
            return await self._close_files(files)
        except FsError as exc:
            if not (exc.code == errno.EINVAL and "unexpected field 'attrs'" in exc.message):
                raise
        self._attrs_in_close = False
        log.info("the metadata server takes no attributes with a close: setattr first")
        return await self._close_files(await self._attrs_first(files))

    async def _close_files(self, files: list[WrittenClose]) -> list[ClosedFile | None]:
        closed: list[ClosedFile] = await self.meta.call_at_most_once(
            "close_files", lambda m: m.close_files(files, self.session.id)
        )
        return list(closed)

    async def _attrs_first(self, files: list[WrittenClose]) -> list[WrittenClose]:
        """(A metadata server of before `close_files` took `attrs`.) Each
        file's attributes set behind, sent by `setattr` before its close;
        one it refuses is logged (the close still goes: a writeback close's
        failure is logged the same way)."""
        out: list[WrittenClose] = []
        for f in files:
            attrs = f.get("attrs")
            if attrs:
                f = WrittenClose(
                    ino=f["ino"], handle=f["handle"], length=f["length"], mtime=f["mtime"]
                )
                try:
                    await self.meta.call_idempotent("setattr", _setattr_call(f["ino"], attrs))
                except FsError as exc:
                    log.error(
                        "the attributes set on ino=%d were refused: errno=%d %s",
                        f["ino"],
                        exc.code,
                        exc.message,
                    )
            out.append(f)
        return out

    async def _one(self, f: WrittenClose) -> ClosedFile:
        """One close alone (nothing else in flight), or one whose batch failed."""
        if self._close_files_supported:
            try:
                closed = await self._many([f])
                if len(closed) == 1 and closed[0] is not None:
                    return closed[0]
                raise FsError(errno.EPROTO, f"close_files: {len(closed)} answers for 1")
            except FsError as exc:
                if exc.code != errno.ENOSYS:
                    raise
                self._close_files_supported = False
        attr: Attr | None = None
        try:
            if f["length"] is not None:
                length = f["length"]
                attr = await self.meta.call_idempotent(
                    "update_length", lambda m: m.update_length(f["ino"], length, f["mtime"])
                )
            if f.get("attrs"):
                attr = await self.meta.call_idempotent(
                    "setattr", _setattr_call(f["ino"], f["attrs"])
                )
        finally:
            if f["handle"]:
                await self.release(f["ino"], f["handle"])
        return {"attr": attr, "error": None}


def _setattr_call(ino: int, attrs: OwedAttrs) -> Callable[[MetaStub], Awaitable[Attr]]:
    return lambda m: m.setattr(ino, **attrs)


def owe_attrs(st: InodeState, attrs: OwedAttrs) -> None:
    """Set *attrs* of a file this client has open for writing, to be sent
    with its close (or the next setattr or fsync) instead of now: a
    writeback mount's (``tar x`` and ``cp -a`` set each file's owner, mode
    and times while it is open, each a commit the writer would wait for).
    Checked as the metadata server checks them, so what it later refuses is
    what it refuses of anyone (a file removed meanwhile: the close's error,
    logged as a writeback close's)."""
    check_setattr(**attrs)
    st.owed.update(attrs)
    st.owed_ctime = time.time_ns()
    if "mtime" in attrs:
        st.mtime_set = True  # a report before the close leaves it (as a setattr's)


def lay_owed(st: InodeState, attr: Attr) -> Attr:
    """*attr* with the attributes owed of its file laid over it."""
    owed = st.owed
    laid: Attr = {**attr, **owed, "ctime": max(attr["ctime"], st.owed_ctime)}
    if "mode" in owed:
        laid["mode"] = stat.S_IFMT(attr["mode"]) | (owed["mode"] & 0o7777)
    return laid


def owed_now(st: InodeState | None) -> OwedAttrs:
    """The attributes owed of a file, to be sent now: still laid over its
    replies until `sent_owed` (a reply from before they landed must not
    show the old ones)."""
    return OwedAttrs() if st is None else OwedAttrs(**st.owed)


def sent_owed(st: InodeState | None, sent: OwedAttrs) -> None:
    """*sent* (from `owed_now`) landed, or its call failed for good: no
    longer owed, but what was set again since."""
    if st is not None:
        for key, value in sent.items():
            if st.owed.get(key) == value:
                del st.owed[key]  # type: ignore[misc]


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
