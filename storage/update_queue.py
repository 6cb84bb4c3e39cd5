"""Updates of one target, batched into one worker-thread call each.

Every write of a chunk does its disk work (`storage/staging.py`: stage, flush,
commit) in a worker thread, off the event loop. One thread call per step of
each update cost the daemon more CPU than the disk work itself: a small
file's write through a lone replica took ~1 ms of the daemon's CPU, half of
it handing the step to a thread and back and the worker threads contending
for the GIL and for the group flush (measured: the same 2,400 writes with
the steps run on the loop took half the CPU; docs/storage.md, "Group
flushes"). So the steps of the updates that arrive at a target while
a batch is in a thread wait, and go together in the next batch, one thread
call: every update's stage first, then one group flush of all the bytes owed
(`WritableTarget.flush_many`), then one record transaction
(`WritableTarget.commit_many`). Alone, an update pays what it paid before;
under load one thread call carries many, and the flushes and transactions
are shared as before.

The order per update is unchanged: staged (written), flushed, committed,
acknowledged; a step that fails fails that update only (an update whose
flush or commit fails is aborted, as `commit` does). Two steps of one chunk
never share a batch (the service holds the chunk's lock from stage to
commit; a batch is cut before a second one anyway).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from shufflefs.cluster.metrics_catalog import UPDATE_BATCH
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import WriteResult
from shufflefs.storage.staging import Staged
from shufflefs.storage.store import ChunkStore

MAX_BATCH = 256


class Then(enum.Enum):
    """What an update's step does after staging (if it stages)."""

    FLUSH = "flush"  # make its bytes durable; the staged update is returned
    COMMIT = "commit"  # flush what is owed, then commit its record


@dataclass(eq=False)
class Step:
    """One update's step: *stage* (a call staging it with its flush
    deferred) or the *staged* update of an earlier step, then *then*.
    *cid* keeps two steps of one chunk out of one batch."""

    cid: bytes
    then: Then
    stage: Callable[[], Staged] | None = None
    staged: Staged | None = None
    outcome: Any = None
    error: BaseException | None = None
    finished: bool = False
    turn: trio.Event = field(default_factory=trio.Event)

    def result(self) -> Any:
        exc = self.error
        if exc is None:
            return self.outcome
        if isinstance(exc, FsError):  # a fresh one per caller: tracebacks are not shared
            raise type(exc)(exc.code, exc.message)
        raise exc


def run_steps(store: ChunkStore, steps: list[Step]) -> None:
    """A batch's disk work, in a worker thread: every stage, then one flush
    of the bytes owed, then one commit of the records. Each step's outcome
    or error is set on it."""
    for step in steps:
        if step.stage is not None:
            try:
                step.staged = step.stage()
            except Exception as exc:
                step.error = exc
    owed = [(s, s.staged) for s in steps if s.error is None and s.staged is not None]
    flushed = store.flush_many([staged for _, staged in owed])
    committing: list[tuple[Step, Staged]] = []
    for (step, staged), error in zip(owed, flushed, strict=True):
        if error is None:
            if step.then is Then.COMMIT:
                committing.append((step, staged))
            continue
        store.abort(staged)  # (a FLUSH's update never reached its caller)
        step.error = error
    updates = [staged for _, staged in committing]
    try:
        results: list[WriteResult | Exception] = store.commit_many(updates)
    except Exception as exc:  # refused as a whole: nothing of it committed
        for staged in updates:
            store.abort(staged)
        results = [exc] * len(updates)
    for (step, _), result in zip(committing, results, strict=True):
        if isinstance(result, Exception):
            step.error = result
        else:
            step.outcome = result
    for step, staged in owed:
        if step.then is Then.FLUSH and step.error is None:
            step.outcome = staged


class UpdateQueue:
    """One target's update steps: the first caller that finds no batch in a
    thread leads one with everything queued; callers arriving meanwhile
    wait for the next, which the first of them leads. *run_in_thread* is the
    node's worker-thread call (`NodeContext.io`)."""

    def __init__(
        self,
        store: ChunkStore,
        run_in_thread: Callable[..., Awaitable[Any]],
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.store = store
        self._run_in_thread = run_in_thread
        self.max_batch = max(1, max_batch)
        self._pending: list[Step] = []
        self._busy = False
        self.batches = 0  # thread calls made (tests, stats)
        self.steps = 0  # steps they carried

    async def stage_durably(self, cid: bytes, stage: Callable[[], Staged]) -> Staged:
        """Stage an update and flush it in one step; returns it staged and
        durable, not committed (aborted here if the flush fails)."""
        staged: Staged = await self._run(Step(cid, Then.FLUSH, stage=stage))
        return staged

    async def commit(self, staged: Staged) -> WriteResult:
        """Flush (if still owed) and commit a staged update; aborted if
        either fails."""
        result: WriteResult = await self._run(Step(staged.cid, Then.COMMIT, staged=staged))
        return result

    async def write(self, cid: bytes, stage: Callable[[], Staged]) -> WriteResult:
        """Stage, flush and commit an update in one step."""
        result: WriteResult = await self._run(Step(cid, Then.COMMIT, stage=stage))
        return result

    async def run_many(self, steps: list[Step]) -> None:
        """Run *steps* (of distinct chunks: a batch of writes) and return once
        each is finished: its `outcome` or `error` set. They go into the same
        thread call when they fit one, as if they had arrived together."""
        with trio.CancelScope(shield=True):  # (as `_run`)
            self._pending.extend(steps)
            try:
                for step in steps:
                    if step.finished:
                        continue
                    if self._busy:
                        await step.turn.wait()
                    if not step.finished:
                        await self._lead()
            except BaseException:
                # a batch we led failed as a whole: our steps it did not
                # carry leave the queue, and the lead passes on without them
                left = [step for step in steps if not step.finished]
                if left:
                    self._pending = [s for s in self._pending if s not in left]
                    if self._pending:
                        self._pending[0].turn.set()
                    else:
                        self._busy = False
                raise

    async def _run(self, step: Step) -> Any:
        # shielded: a step handed to a thread runs to its end, and its
        # caller must learn how it ended (a staged update nobody aborts or
        # commits would hold its chunk's file until the next start)
        with trio.CancelScope(shield=True):
            self._pending.append(step)
            if self._busy:
                await step.turn.wait()  # finished, or our turn to lead
            if not step.finished:
                await self._lead()
        return step.result()

    async def _lead(self) -> None:
        self._busy = True
        batch: list[Step] = []
        try:
            batch = self._take()
            self.batches += 1
            self.steps += len(batch)
            UPDATE_BATCH.observe(len(batch))
            await self._run_in_thread(run_steps, self.store, batch)
        except BaseException as exc:
            for step in batch:
                if step.error is None and step.outcome is None:
                    step.error = exc
            raise
        finally:
            for step in batch:
                step.finished = True
                step.turn.set()
            if self._pending:
                self._pending[0].turn.set()  # the next batch's leader
            else:
                self._busy = False

    def _take(self) -> list[Step]:
        """The next batch: the queue's order, at most one step per chunk."""
        batch: list[Step] = []
        rest: list[Step] = []
        cids: set[bytes] = set()
        for step in self._pending:
            if len(batch) < self.max_batch and step.cid not in cids:
                cids.add(step.cid)
                batch.append(step)
            else:
                rest.append(step)
        self._pending = rest
        return batch
