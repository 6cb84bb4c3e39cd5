"""Many writes in one request: `write_many` at a chain's head and
`replicate_many` along the chain (docs/storage.md, "Batched writes").

Ingesting a dataset of small files sends one chunk write per file. Alone,
each pays a whole request at every replica (a frame decoded and answered, a
handler task, its locks and admission, a forward to the successor with its
own request and reply, two update steps): for a 110 KB file through three
replicas about four fifths of the daemons' CPU, the bytes themselves the
rest (measured: 4 KB files cost 1.6 ms of daemon CPU each, 110 KB ones 2.0).
A batch pays those once: its chunks' locks are taken together, its chain
admitted once, all its stages go to the target's update queue together (one
worker-thread call), the batch is forwarded as one `replicate_many`, and its
commits share one thread call and one record transaction.

Each item is still what its own `write` / `replicate` would be: staged and
flushed here while forwarded, committed here only once both are done, and
answered on its own. An item that fails (its stage, its forward, its commit,
a successor's `NEED_FULL` that its whole-chunk resend could not mend) fails
alone and is aborted here; a failure of the batch's chain as a whole (a
stale version, a successor unreachable, too few replicas) fails each item of
that chain with it. A request's items may span targets and chains (one
group each, run side by side); a chunk may appear only once per target.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import trio

from shufflefs.rpc import FsError
from shufflefs.rpc.errors import as_fs_error
from shufflefs.storage.chain import Place
from shufflefs.storage.context import NodeContext
from shufflefs.storage.forwarding import ForwardedUpdate, Forwarding
from shufflefs.storage.layout import check_chunk_id
from shufflefs.storage.protocol import (
    MAX_WRITE_ITEMS,
    ReplicateItem,
    WriteItem,
    WriteOutcome,
    WriteResult,
    write_outcome,
)
from shufflefs.storage.resync import ResyncWorker
from shufflefs.storage.staging import Staged
from shufflefs.storage.store import ChunkStore
from shufflefs.storage.update_queue import Step, Then
from shufflefs.storage.write_steps import head_update, stage_at_head, stage_forwarded

log = logging.getLogger("shufflefs.storage.batch_writes")

Result = WriteResult | FsError | None  # per item; None: not answered yet
GroupKey = tuple[int, int, int]  # (target, chain, chain_version)
ItemT = TypeVar("ItemT")


@dataclass(eq=False)
class Batch(Generic[ItemT]):
    """One request: its items, each item's bytes and each item's answer."""

    items: Sequence[ItemT]
    views: list[memoryview]
    results: list[Result]


@dataclass(eq=False)
class Entry:
    """One item of a group, ready to apply: *update* is what the successor
    is told (None: nothing to forward, the item is applied here alone)."""

    index: int  # in the request
    cid: bytes
    data: memoryview
    stage: Callable[[], Staged]
    update: ForwardedUpdate | None
    local_error: Callable[[FsError], FsError] | None = None  # maps an error of this copy


def split_payload(lengths: Sequence[int], payload: bytearray | None) -> list[memoryview]:
    """Each item's bytes: the next *length* of the payload (EINVAL unless
    the lengths cover it exactly)."""
    view = memoryview(payload if payload is not None else b"")
    out: list[memoryview] = []
    pos = 0
    for n in lengths:
        if n < 0 or pos + n > len(view):
            raise FsError(errno.EINVAL, "item lengths do not match the payload")
        out.append(view[pos : pos + n])
        pos += n
    if pos != len(view):
        raise FsError(errno.EINVAL, f"{len(view) - pos} payload bytes belong to no item")
    return out


def groups_of(items: Sequence[Sequence[Any]]) -> dict[GroupKey, list[int]]:
    """Item indices per (target, chain, chain_version); EMSGSIZE past
    MAX_WRITE_ITEMS, EINVAL for a chunk named twice on one target."""
    if len(items) > MAX_WRITE_ITEMS:
        raise FsError(
            errno.EMSGSIZE, f"{len(items)} writes in one request exceed {MAX_WRITE_ITEMS}: split it"
        )
    groups: dict[GroupKey, list[int]] = {}
    seen: set[tuple[int, bytes]] = set()
    for i, item in enumerate(items):
        key = (item[0], item[3])
        if key in seen:
            raise FsError(errno.EINVAL, f"chunk {item[3].hex()} is written twice in one request")
        seen.add(key)
        groups.setdefault((item[0], item[1], item[2]), []).append(i)
    return groups


class BatchWrites:
    """The batched write handlers of one storage node (its `StorageService`
    owns one; *damaged_here* is its mapping of the head's own-copy errors)."""

    def __init__(
        self,
        node: NodeContext,
        forwarding: Forwarding,
        resyncer: ResyncWorker,
        damaged_here: Callable[[int, bytes, FsError], FsError],
    ) -> None:
        self.node = node
        self.forwarding = forwarding
        self.resyncer = resyncer
        self.damaged_here = damaged_here

    async def write_many(
        self, items: list[WriteItem], payload: bytearray | None
    ) -> list[WriteOutcome]:
        return await self._by_group(items, [item[6] for item in items], payload, self._head_group)

    async def replicate_many(
        self, items: list[ReplicateItem], payload: bytearray | None
    ) -> list[WriteOutcome]:
        lengths = [item[9] for item in items]
        return await self._by_group(items, lengths, payload, self._replica_group)

    async def _by_group(
        self,
        items: Sequence[Any],
        lengths: list[int],
        payload: bytearray | None,
        apply: Callable[[Batch[Any], GroupKey, list[int]], Awaitable[None]],
    ) -> list[WriteOutcome]:
        """Each (target, chain, version) group of *items* applied by *apply*,
        side by side; per item its outcome (a group's own failure, raised
        by *apply*, is that of each of its items not answered yet)."""
        groups = groups_of(items)
        batch = Batch(items, split_payload(lengths, payload), [None] * len(items))

        async def run(key: GroupKey, indices: list[int]) -> None:
            try:
                await apply(batch, key, indices)
            except FsError as exc:
                _fail_unanswered(batch.results, indices, exc)

        async with trio.open_nursery() as nursery:
            for key, indices in groups.items():
                nursery.start_soon(run, key, indices)
        return [write_outcome(_answered(r)) for r in batch.results]

    # ---- one chain's items -------------------------------------------------

    async def _head_group(self, batch: Batch[WriteItem], key: GroupKey, indices: list[int]) -> None:
        target, chain, chain_version = key
        items, views, results = batch.items, batch.views, batch.results
        store = self.node.store(target)
        cids = [items[i][3] for i in indices]
        for cid in cids:
            check_chunk_id(cid)
        async with (
            self.node.locks.updates(target, cids),
            self.forwarding.admitted(target, chain, chain_version, head=True) as place,
        ):
            if place is not None:
                place = await self.forwarding.check_min_replicas(place, target, head=True)
            entries: list[Entry] = []
            for i in indices:
                _, _, _, cid, offset, chunk_size, _ = items[i]
                data = views[i]
                update = None
                if place is not None and place.successor is not None:
                    try:
                        update = head_update(store, cid, offset, chunk_size, len(data))
                    except FsError as exc:
                        results[i] = exc
                        continue
                stage = partial(stage_at_head, store, cid, offset, data, chunk_size)
                mapped = partial(self.damaged_here, target, cid)
                entries.append(Entry(i, cid, data, stage, update, mapped))
            await self._apply(store, place, entries, results)

    async def _replica_group(
        self, batch: Batch[ReplicateItem], key: GroupKey, indices: list[int]
    ) -> None:
        target, chain, chain_version = key
        items, views, results = batch.items, batch.views, batch.results
        store = self.node.store(target)
        valid: list[int] = []
        for i in indices:
            _, _, _, cid, _, _, version, base_version, full, _ = items[i]
            check_chunk_id(cid)
            if not full and version != base_version + 1:
                results[i] = FsError(
                    errno.EINVAL,
                    f"version {version} does not follow base_version {base_version}",
                )
            else:
                valid.append(i)
        cids = [items[i][3] for i in valid]
        async with (
            self.node.locks.updates(target, cids),
            self.forwarding.admitted(target, chain, chain_version, head=False) as place,
        ):
            sync = self.resyncer.state_at(target, place)
            entries: list[Entry] = []
            for i in valid:
                _, _, _, cid, offset, chunk_size, version, base_version, full, _ = items[i]
                data = views[i]
                update = None
                if place is not None and place.successor is not None:
                    try:
                        store.check_room(len(data))  # a full disk here: forward nothing
                    except FsError as exc:
                        results[i] = exc
                        continue
                    update = ForwardedUpdate(cid, offset, chunk_size, version, base_version, full)
                stage = partial(
                    stage_forwarded, store, cid, offset, chunk_size, version, full, data
                )
                entries.append(Entry(i, cid, data, stage, update))
            await self._apply(store, place, entries, results)
            if sync is not None:  # as `replicate` does for each
                for i in valid:
                    if isinstance(results[i], dict):
                        cid, full, base_version = items[i][3], items[i][8], items[i][7]
                        sync.touch(cid)
                        if full or base_version == 0 or cid in sync.trusted:
                            sync.trusted.add(cid)
                        sync.forwarded += 1

    # ---- applying ----------------------------------------------------------

    async def _apply(
        self, store: ChunkStore, place: Place | None, entries: list[Entry], results: list[Result]
    ) -> None:
        """Each entry applied: alone here (nothing to forward) in one update
        step, or staged here while forwarded and then committed."""
        alone = [e for e in entries if e.update is None]
        chained = [e for e in entries if e.update is not None]
        if alone:
            steps = [Step(e.cid, Then.COMMIT, stage=e.stage) for e in alone]
            await self.node.updates(store).run_many(steps)
            for e, step in zip(alone, steps, strict=True):
                results[e.index] = _step_result(e, step)
        if chained:
            assert place is not None and place.successor is not None
            await self._stage_forward_commit(store, place, chained, results)

    async def _stage_forward_commit(
        self, store: ChunkStore, place: Place, entries: list[Entry], results: list[Result]
    ) -> None:
        """`StorageService._stage_forward_commit` for many: all staged and
        flushed here (one update step) while forwarded in one
        `replicate_many`; each committed once both are done for it, and
        aborted here otherwise (also when we are cancelled)."""
        node = self.node
        updates = node.updates(store)
        steps = [Step(e.cid, Then.FLUSH, stage=e.stage) for e in entries]
        local_done = trio.Event()
        forwarded: list[WriteResult | FsError] = []
        failed: list[FsError] = []

        async def stage_here() -> None:
            try:
                await updates.run_many(steps)
            finally:
                local_done.set()

        async def whole_chunk(k: int) -> bytes:
            await local_done.wait()
            staged = steps[k].outcome
            if steps[k].error is not None or staged is None:
                raise _step_error(entries[k], steps[k])
            return await node.io(store.staged_content, staged)

        async def forward() -> None:
            sent = [(e.update, e.data) for e in entries if e.update is not None]
            try:
                forwarded.extend(await self.forwarding.forward_updates(place, sent, whole_chunk))
            except FsError as exc:
                failed.append(exc)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stage_here)
                await forward()
            committing: list[tuple[Entry, Staged]] = []
            dropped: list[Staged] = []
            for k, (e, step) in enumerate(zip(entries, steps, strict=True)):
                staged = step.outcome
                there = failed[0] if failed else forwarded[k]
                if step.error is not None or staged is None:
                    results[e.index] = _step_error(e, step)  # our copy's error comes first
                elif isinstance(there, FsError):
                    results[e.index] = there
                    dropped.append(staged)
                else:
                    committing.append((e, staged))
            if dropped:
                await node.io(_abort_all, store, dropped)
            commits = [Step(e.cid, Then.COMMIT, staged=staged) for e, staged in committing]
            await updates.run_many(commits)
            for (e, _), step in zip(committing, commits, strict=True):
                results[e.index] = _step_result(e, step)
        except BaseException:
            with trio.CancelScope(shield=True):
                await local_done.wait()  # (its step runs to its end, shielded)
                # (aborting one already committed or aborted does nothing)
                staged_here = [s.outcome for s in steps if s.error is None and s.outcome]
                if staged_here:
                    await node.io(_abort_all, store, staged_here)
            raise


def _abort_all(store: ChunkStore, updates: list[Staged]) -> None:
    for staged in updates:
        store.abort(staged)


def _step_error(e: Entry, step: Step) -> FsError:
    exc = step.error
    if exc is None:
        return FsError(errno.EIO, f"chunk {e.cid.hex()}: staged nothing")
    if not isinstance(exc, FsError):
        log.error("chunk %s: update failed: %r", e.cid.hex(), exc)
        exc = as_fs_error(exc)
    return e.local_error(exc) if e.local_error is not None else exc


def _step_result(e: Entry, step: Step) -> WriteResult | FsError:
    if step.error is not None:
        return _step_error(e, step)
    result: WriteResult = step.outcome
    return result


def _fail_unanswered(results: list[Result], indices: list[int], exc: FsError) -> None:
    for i in indices:
        if results[i] is None:
            results[i] = FsError(exc.code, exc.message)


def _answered(result: Result) -> WriteResult | FsError:
    return result if result is not None else FsError(errno.EIO, "write not applied")
