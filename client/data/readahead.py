"""Readahead along the shuffle.

The order is a pure function of (seed, epoch, position), so the reads of
every future batch are known. `pipeline` turns a stream of read plans into a
stream of filled buffers while keeping the next ``depth`` plans' reads in
flight: when the trainer gets batch ``b``, the reads of batches
``b+1 ... b+depth`` have been issued (for the native client each one is one
request per storage node). Memory is bounded: at most ``depth + 1`` batch
buffers exist at once (the one handed out and those in flight), plus
whatever the consumer keeps.

``depth = 0`` reads each batch synchronously when it is asked for: plain
reads, the baseline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from shufflefs.client.data.mount_hints import lookahead
from shufflefs.client.data.readers import RangeReader

P = TypeVar("P")
IntArray = npt.NDArray[np.int64]


@dataclass
class ReadPlan(Generic[P]):
    """One batch to read: ranges laid end to end into a fresh buffer."""

    tag: P  # what the consumer needs to interpret the buffer (positions, ...)
    files: IntArray
    offsets: IntArray
    lengths: IntArray


def _fresh(plan: ReadPlan[P]) -> npt.NDArray[np.uint8]:
    return np.empty(int(plan.lengths.sum()), dtype=np.uint8)


def _samples(plan: ReadPlan[P]) -> int:
    return len(plan.files)


def pipeline(
    reader: RangeReader,
    plans: Iterator[ReadPlan[P]],
    depth: int,
    buffer: Callable[[ReadPlan[P]], npt.NDArray[np.uint8]] = _fresh,
) -> Iterator[tuple[P, npt.NDArray[np.uint8]]]:
    """(tag, filled buffer) for each plan, in order, reading *depth* ahead
    (and, on a shufflefs mount, hinting the mount further ahead still)."""
    hints = reader.hints
    if hints is not None:
        plans = lookahead(
            plans, hints.ahead, lambda p: hints.plan(p.files, p.offsets, p.lengths), _samples
        )
    if depth <= 0:
        for plan in plans:
            buf = buffer(plan)
            reader.read_into(plan.files, plan.offsets, plan.lengths, buf.data)
            yield plan.tag, buf
        return
    inflight: deque[tuple[P, npt.NDArray[np.uint8], Future[None]]] = deque()

    def fill() -> None:
        while len(inflight) < depth:
            plan = next(plans, None)
            if plan is None:
                return
            buf = buffer(plan)
            fut = reader.submit(plan.files, plan.offsets, plan.lengths, buf.data)
            inflight.append((plan.tag, buf, fut))

    try:
        fill()
        while inflight:
            tag, buf, fut = inflight.popleft()
            fill()  # the next `depth` batches are in flight while this one is used
            fut.result()
            yield tag, buf
    finally:
        # the consumer stopped early (or a read failed): drop what is queued;
        # reads already running finish into buffers nobody will look at
        for _, _, fut in inflight:
            fut.cancel()
