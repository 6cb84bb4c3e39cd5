"""The stage/commit protocol: every update of a target's chunks, crash safe.

An update is two steps, so that chain replication can make it durable on
every replica before any replica shows it (docs/storage.md, "Writes and why
they are crash safe"): `stage_write` (or `stage_replace`, whole-chunk content
from another replica) does all the disk work and returns a `Staged`;
`commit` is the one LMDB transaction that makes it visible; `abort` removes
it. A staged update is invisible to readers (they read committed records
only) and leaves no trace after an abort or a crash. `write` is stage +
commit.

* an **append** (a write at or past the committed length) goes in place:
  cut the file back to the committed length, pwrite, fdatasync. Until the
  commit the new bytes lie past the committed length, which is never trusted.
* a write that **changes committed bytes** is copy-on-write: the new chunk is
  built in a file of a new generation (old bytes + new) and fsynced; the
  commit switches the record to it, then the old file is unlinked.
* **truncate** commits the shorter record first, then cuts the file;
  **remove** deletes the record first, then the file (both file-wide, in
  batches: `storage/whole_files.py`, the base of `WritableTarget`).

So after a crash at any instant each chunk is, whole, either as before or as
after the update in flight, and its checksums match.

The flushes (of the bytes, then of the record commit) are group flushes
(`storage/group_sync.py`): concurrent updates of a target share them, and
each update still returns only once its own step is durable.
"""

from __future__ import annotations

import contextlib
import errno
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from shufflefs.rpc.errors import FsError
from shufflefs.storage.cache import FdHandle
from shufflefs.storage.crc import (
    CRC_TYPECODE,
    block_crcs,
    first_bad_block,
    zero_block_crc,
)
from shufflefs.storage.group_sync import FileFlush
from shufflefs.storage.layout import (
    ChunkRecord,
    block_count,
    check_chunk_id,
    check_chunk_size,
    same_record,
)
from shufflefs.storage.protocol import NEED_FULL, WriteResult
from shufflefs.storage.target import RecordChange
from shufflefs.storage.whole_files import WholeFiles

Data = bytes | bytearray | memoryview

COPY_PIECE = 8 << 20
_NOT_YET = FsError(errno.EIO, "not committed")  # an outcome slot before it is decided


def _pwrite_all(fd: int, data: Data, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Copy [offset, offset+length) between files at the same offsets, in
    the kernel where it can (copy_file_range may even share extents)."""
    end = offset + length
    pos = offset
    try:
        while pos < end:
            n = os.copy_file_range(src, dst, end - pos, pos, pos)
            if n == 0:
                raise FsError(errno.EIO, f"chunk file ends at {pos}, expected {end} bytes")
            pos += n
        return
    except OSError as exc:
        if isinstance(exc, FsError) or exc.errno not in (
            errno.EXDEV,
            errno.ENOSYS,
            errno.EOPNOTSUPP,
            errno.EINVAL,
        ):
            raise
    while pos < end:
        piece = os.pread(src, min(COPY_PIECE, end - pos), pos)
        if not piece:
            raise FsError(errno.EIO, f"chunk file ends at {pos}, expected {end} bytes")
        _pwrite_all(dst, piece, pos)
        pos += len(piece)


# What a staged update does on disk (and so how commit and abort finish it).
NOOP = "noop"  # a zero-length write: nothing at all
APPEND = "append"  # bytes written in place past the committed length of the chunk's file
CREATE = "create"  # a new chunk: a new file
COW = "cow"  # an overwrite: a new generation file holding the whole new chunk
REPLACE = "replace"  # whole-chunk content from another replica: a new generation file


def space_needed(rec: ChunkRecord | None, offset: int, length: int) -> int:
    """The bytes a write of *length* at *offset* takes on disk before its
    commit: an append (at or past the committed length) only its growth, in
    place; an overwrite a new generation of the whole chunk."""
    old_len = rec.length if rec is not None else 0
    if rec is None or offset >= old_len:
        return offset + length - old_len
    return max(old_len, offset + length)


@dataclass(eq=False)
class Staged:
    """An update that is durable on disk (once flushed: see `unflushed`) but
    not committed: readers see the committed record only, so they never see
    it. `ChunkStore.commit` makes it visible in one LMDB transaction (after
    the flush, if still owed); `ChunkStore.abort` removes it. The
    caller serializes updates of one chunk from stage to commit (the storage
    service holds the chunk's lock); commit refuses an update whose base is
    no longer the committed record."""

    cid: bytes
    kind: str
    base: ChunkRecord | None  # the committed record the update was built on
    new: ChunkRecord | None  # the record commit installs (None: a zero-length write)
    fd: int = -1  # the new file (CREATE, COW, REPLACE), owned until commit or abort
    handle: FdHandle | None = None  # the committed file appended to (APPEND)
    d_used: int = 0
    d_chunks: bool = False
    done: bool = False
    # the flush still owed before the commit (staged with flush=False)
    unflushed: FileFlush | None = None

    @property
    def version(self) -> int:
        """The version this update produces."""
        if self.new is not None:
            return self.new.version
        return self.base.version if self.base is not None else 0

    @property
    def base_version(self) -> int:
        return self.base.version if self.base is not None else 0


def _record_change(staged: Staged) -> RecordChange:
    assert staged.new is not None
    return RecordChange([(staged.cid, staged.new)], [], staged.d_used, int(staged.d_chunks))


class WritableTarget(WholeFiles):
    """A `Target` with the update protocol: every change of a chunk is
    staged, then committed or aborted, under the chunk's striped lock."""

    # ---- writes: stage, then commit or abort -------------------------------

    def write(self, cid: bytes, offset: int, chunk_size: int, data: Data) -> WriteResult:
        """Write *data* at *offset*; durable (if fsync) and committed on return.
        A gap between the chunk's end and *offset* reads as zeros. The same
        as `stage_write` + `commit`, under the chunk's lock throughout."""
        with self._lock(cid):
            staged = self._stage_write_locked(cid, offset, data, chunk_size, None)
            return self._commit_locked(staged)

    def stage_write(
        self,
        cid: bytes,
        offset: int,
        data: Data,
        chunk_size: int,
        version: int | None = None,
        flush: bool = True,
    ) -> Staged:
        """Make the chunk's next version (*data* at *offset*) durable on disk,
        invisible to readers until `commit`. *version* is the version the
        update produces: it must be the committed version + 1 (else
        `NEED_FULL`: this replica holds another base than the sender);
        None means exactly that. Appends go in place, past the committed
        length; overwrites into a new generation file. A zero-length write
        stages nothing (committing it changes nothing). With *flush* False
        the bytes are written but not yet durable: `flush` (or `commit`,
        which flushes first) makes them so; meanwhile the caller may forward
        the update, so that replicas flush at the same time."""
        with self._lock(cid):
            return self._stage_write_locked(cid, offset, data, chunk_size, version, flush)

    def stage_replace(
        self, cid: bytes, data: Data, chunk_size: int, version: int, flush: bool = True
    ) -> Staged:
        """Stage *data* as the chunk's whole content at *version* (a full
        resend along the chain, a resync or a repair copies a chunk from
        another replica), in a new generation file: whatever this target held
        before is replaced on commit, whatever its version was. *flush* as
        for `stage_write`."""
        check_chunk_id(cid)
        check_chunk_size(chunk_size)
        if len(data) > chunk_size:
            raise FsError(errno.EINVAL, f"{len(data)} bytes do not fit the chunk size {chunk_size}")
        if version < 1:
            raise FsError(errno.EINVAL, f"chunk version {version} must be positive")
        with self._lock(cid):
            rec = self._record(cid)
            self._check_space(len(data))
            generation = next(self._next_gen)
            path = self._path(cid, generation)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise self._os_error(exc, f"replace of chunk {cid.hex()}") from None
            try:
                _pwrite_all(fd, data, 0)
                unflushed = self._flush_now(FileFlush(fd, True, os.path.dirname(path)), flush)
            except BaseException as exc:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                if isinstance(exc, OSError) and not isinstance(exc, FsError):
                    raise self._os_error(exc, f"replace of chunk {cid.hex()}") from None
                raise
            crcs = block_crcs(data, self.block_size)
            new = ChunkRecord(version, generation, len(data), chunk_size, crcs)
            old_len = rec.length if rec is not None else 0
            return Staged(
                cid,
                REPLACE,
                rec,
                new,
                fd=fd,
                d_used=len(data) - old_len,
                d_chunks=rec is None,
                unflushed=unflushed,
            )

    def flush(self, staged: Staged) -> None:
        """Make the bytes of an update staged with ``flush=False`` durable
        (a group flush, shared with the other updates flushing on this
        target meanwhile). The caller still owns the update: on an error it
        aborts it."""
        (error,) = self.flush_many([staged])
        if error is not None:
            raise error

    def flush_many(self, updates: Sequence[Staged]) -> list[FsError | None]:
        """`flush` of several staged updates, in one group flush: per update
        None or its error (not raised: the caller aborts the ones that
        failed, and never flushes them again, as a second fsync after a
        failed one may report success for bytes that were lost)."""
        errors: list[FsError | None] = [None] * len(updates)
        owed = [i for i, u in enumerate(updates) if u.unflushed is not None and not u.done]
        if not owed:
            return errors
        outcomes = self._file_sync.flush_many([p for i in owed if (p := updates[i].unflushed)])
        for i, exc in zip(owed, outcomes, strict=True):
            if exc is None:
                updates[i].unflushed = None
            elif isinstance(exc, OSError):
                errors[i] = self._os_error(exc, f"flush of chunk {updates[i].cid.hex()}")
            else:
                raise exc
        return errors

    def _flush_now(self, pending: FileFlush, flush: bool) -> FileFlush | None:
        """Flush *pending* now if *flush*, else return it for `flush` later
        (nothing at all without fsync)."""
        if not self.fsync:
            return None
        if not flush:
            return pending
        self._file_sync.flush(pending)
        return None

    def commit(self, staged: Staged) -> WriteResult:
        """Make a staged update the chunk's committed state (one LMDB
        transaction, grouped with the commits of other chunks that arrive
        meanwhile), its bytes flushed first if they are not yet. If the
        commit fails the update is aborted."""
        with self._lock(staged.cid):
            return self._commit_locked(staged)

    def commit_many(self, updates: Sequence[Staged]) -> list[WriteResult | Exception]:
        """`commit` of staged updates of different chunks together: the bytes
        still owed in one group flush, the records in one transaction (each
        shared, as always, with the updates of other threads meanwhile). Per
        update its result or its error (that update is then aborted). Two
        updates of one chunk are refused (EINVAL, nothing done)."""
        with self._locks_for([u.cid for u in updates]):
            return self._commit_all_locked(updates)

    def abort(self, staged: Staged) -> None:
        """Drop a staged update without a trace: the bytes it appended past
        the committed length are cut, its new generation file is deleted.
        Aborting twice, or after a commit, does nothing."""
        with self._lock(staged.cid):
            self._abort_locked(staged)

    def staged_content(self, staged: Staged) -> bytes:
        """The whole chunk as the staged update makes it (for a full resend
        to a replica that lacks the base), verified against the new
        checksums: damage in blocks a copy-on-write carried over is refused
        with EIO rather than sent on."""
        if staged.done:
            raise FsError(errno.EINVAL, "the staged update is already committed or aborted")
        new = staged.new
        if new is None:
            raise FsError(errno.EINVAL, "a zero-length write has no content to send")
        fd = staged.fd if staged.handle is None else staged.handle.fd
        data = os.pread(fd, new.length, 0)
        if len(data) != new.length:
            raise self._corrupt(staged.cid, new, len(data) // self.block_size, "staged file short")
        bad = first_bad_block(data, 0, new.crcs, self.block_size)
        if bad >= 0:
            raise self._corrupt(staged.cid, new, bad, "checksum mismatch in staged update")
        return data

    def _stage_write_locked(
        self,
        cid: bytes,
        offset: int,
        data: Data,
        chunk_size: int,
        version: int | None,
        flush: bool = True,
    ) -> Staged:
        check_chunk_id(cid)
        check_chunk_size(chunk_size)
        n = len(data)
        if offset < 0 or offset + n > chunk_size:
            raise FsError(
                errno.EINVAL, f"write {offset}+{n} does not fit the chunk size {chunk_size}"
            )
        rec = self._record(cid)
        if rec is not None and rec.chunk_size != chunk_size:
            raise FsError(
                errno.EINVAL,
                f"chunk {cid.hex()} has chunk size {rec.chunk_size}, not {chunk_size}",
            )
        current = rec.version if rec is not None else 0
        if version is not None and version != current + 1:
            raise FsError(
                NEED_FULL,
                f"chunk {cid.hex()} is at version {current} on target {self.label}; "
                f"an update to version {version} needs the whole chunk",
            )
        if n == 0:
            return Staged(cid, NOOP, rec, None)
        try:
            if rec is None or offset >= rec.length:
                return self._stage_in_place(cid, rec, offset, chunk_size, data, current + 1, flush)
            return self._stage_cow(cid, rec, offset, data, current + 1, flush)
        except FsError:
            raise
        except OSError as exc:
            raise self._os_error(exc, f"write to chunk {cid.hex()}") from None

    def _stage_in_place(
        self,
        cid: bytes,
        rec: ChunkRecord | None,
        offset: int,
        chunk_size: int,
        data: Data,
        version: int,
        flush: bool,
    ) -> Staged:
        old_len = rec.length if rec is not None else 0
        new_len = offset + len(data)
        self._check_space(space_needed(rec, offset, len(data)))
        handle: FdHandle | None = None
        if rec is None:
            generation = next(self._next_gen)
            path = self._path(cid, generation)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        else:
            generation = rec.generation
            path = self._path(cid, generation)
            try:
                handle = self._acquire_fd(cid, generation)
            except FileNotFoundError:
                raise self._corrupt(cid, rec, 0, "chunk file missing") from None
            fd = handle.fd
        wrote = staged = False
        try:
            if rec is not None:
                size = os.fstat(fd).st_size
                if size < old_len:
                    raise self._corrupt(
                        cid, rec, size // self.block_size, "chunk file shorter than committed"
                    )
                if size > old_len:  # the untrusted remains of an update that did not commit
                    os.ftruncate(fd, old_len)
            crcs = self._updated_crcs(cid, rec, fd, offset, data, new_len)
            wrote = True
            _pwrite_all(fd, data, offset)
            directory = os.path.dirname(path) if rec is None else None
            unflushed = self._flush_now(FileFlush(fd, rec is None, directory), flush)
            new = ChunkRecord(version, generation, new_len, chunk_size, crcs)
            result = Staged(
                cid,
                APPEND if rec is not None else CREATE,
                rec,
                new,
                fd=fd if handle is None else -1,
                handle=handle,
                d_used=new_len - old_len,
                d_chunks=rec is None,
                unflushed=unflushed,
            )
            staged = True
            return result
        finally:
            if not staged:
                if handle is not None:
                    if wrote:  # drop what will never commit
                        with contextlib.suppress(OSError):
                            os.ftruncate(fd, old_len)
                    self._fds.release(handle)
                else:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    def _stage_cow(
        self, cid: bytes, rec: ChunkRecord, offset: int, data: Data, version: int, flush: bool
    ) -> Staged:
        end = offset + len(data)
        new_len = max(rec.length, end)
        self._check_space(space_needed(rec, offset, len(data)))
        try:
            old = self._acquire_fd(cid, rec.generation)
        except FileNotFoundError:
            raise self._corrupt(cid, rec, 0, "chunk file missing") from None
        generation = next(self._next_gen)
        path = self._path(cid, generation)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                crcs = self._updated_crcs(cid, rec, old.fd, offset, data, new_len)
                _copy_range(old.fd, fd, 0, offset)
                if end < rec.length:
                    _copy_range(old.fd, fd, end, rec.length - end)
                _pwrite_all(fd, data, offset)
                unflushed = self._flush_now(FileFlush(fd, True, os.path.dirname(path)), flush)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
        finally:
            self._fds.release(old)
        new = ChunkRecord(version, generation, new_len, rec.chunk_size, crcs)
        return Staged(cid, COW, rec, new, fd=fd, d_used=new_len - rec.length, unflushed=unflushed)

    def _commit_locked(self, staged: Staged) -> WriteResult:
        (outcome,) = self._commit_all_locked([staged])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _commit_all_locked(self, updates: Sequence[Staged]) -> list[WriteResult | Exception]:
        if len({u.cid for u in updates}) < len(updates):
            # each would be built on the same base: nothing done, the caller
            # still owns them all
            raise FsError(errno.EINVAL, "two updates of one chunk in one commit")
        outcomes: list[WriteResult | Exception] = [_NOT_YET] * len(updates)
        live: list[int] = []
        for i, staged in enumerate(updates):
            base = staged.base
            if staged.done:
                outcomes[i] = FsError(
                    errno.EINVAL, "the staged update is already committed or aborted"
                )
            elif staged.new is None:  # a zero-length write: nothing changes
                staged.done = True
                outcomes[i] = {
                    "version": base.version if base else 0,
                    "length": base.length if base else 0,
                }
            else:
                live.append(i)
        try:
            # never a record before its bytes are durable
            flushed = self.flush_many([updates[i] for i in live])
            committing: list[int] = []
            for i, error in zip(live, flushed, strict=True):
                staged = updates[i]
                if error is None and not same_record(self._record(staged.cid), staged.base):
                    error = FsError(
                        errno.EAGAIN,
                        f"chunk {staged.cid.hex()} changed on target {self.label} while an "
                        "update was staged",
                    )
                if error is not None:
                    self._abort_locked(staged)
                    outcomes[i] = error
                else:
                    committing.append(i)
            changes = [_record_change(updates[i]) for i in committing]
            for i, exc in zip(committing, self._commit_many(changes), strict=True):
                staged = updates[i]
                if exc is not None:
                    self._abort_locked(staged)
                    outcomes[i] = exc if isinstance(exc, Exception) else FsError(errno.EIO)
                else:
                    outcomes[i] = self._committed(staged)
        except BaseException:
            for i in live:
                self._abort_locked(updates[i])  # (nothing once committed: done)
            raise
        return outcomes

    def _committed(self, staged: Staged) -> WriteResult:
        """The bookkeeping after *staged*'s record committed."""
        new = staged.new
        assert new is not None
        staged.done = True
        if staged.handle is not None:  # an append: the file stays the same
            self._fds.release(staged.handle)
        else:
            self._fds.release(
                self._fds.put((staged.cid, new.generation), staged.fd, self._fds.epoch)
            )
            if staged.base is not None:
                self._discard_file(staged.cid, staged.base.generation)
        return {"version": new.version, "length": new.length}

    def _abort_locked(self, staged: Staged) -> None:
        if staged.done:
            return
        staged.done = True
        if staged.new is None:
            return
        if staged.handle is not None:
            base_len = staged.base.length if staged.base is not None else 0
            with contextlib.suppress(OSError):
                os.ftruncate(staged.handle.fd, base_len)
            self._fds.release(staged.handle)
            return
        os.close(staged.fd)
        with contextlib.suppress(OSError):
            os.unlink(self._path(staged.cid, staged.new.generation))

    def _updated_crcs(
        self,
        cid: bytes,
        rec: ChunkRecord | None,
        fd: int,
        offset: int,
        data: Data,
        new_len: int,
    ) -> array[int]:
        """The chunk's checksums after writing *data* at *offset*. Only the
        touched blocks are computed; old bytes that share a block with new
        ones are read back and verified first, so a corrupt block is never
        given a fresh, matching checksum."""
        bs = self.block_size
        old_len = rec.length if rec is not None else 0
        end = offset + len(data)
        b0 = min(offset, old_len) // bs
        b1 = block_count(end, bs)
        lo = b0 * bs
        hi = min(b1 * bs, new_len)
        span: Data
        if lo == offset and hi == end:
            span = data  # its blocks hold nothing else (a new sample file's chunk)
        else:
            span = bytearray(hi - lo)  # zeros: the gap of a sparse append
            for b in sorted({b0, b1 - 1}):
                blo = b * bs
                if rec is None or blo >= old_len:
                    continue
                if offset <= blo and end >= min(blo + bs, new_len):
                    continue  # wholly overwritten
                old = self._read_block_verified(cid, rec, fd, b)
                span[blo - lo : blo - lo + len(old)] = old
            span[offset - lo : end - lo] = data
        crcs = array(CRC_TYPECODE, rec.crcs[:b0]) if rec is not None else array(CRC_TYPECODE)
        view = memoryview(span)
        # the whole blocks of a sparse append's gap, [z0, z1), are zeros
        z0 = min(hi, max(lo, block_count(old_len, bs) * bs))
        z1 = max(z0, min(hi, offset // bs * bs))
        crcs.extend(block_crcs(view[: z0 - lo], bs))
        crcs.extend(array(CRC_TYPECODE, [zero_block_crc(bs)]) * ((z1 - z0) // bs))
        crcs.extend(block_crcs(view[z1 - lo :], bs))
        if rec is not None and b1 < len(rec.crcs):
            crcs.extend(rec.crcs[b1:])
        return crcs
