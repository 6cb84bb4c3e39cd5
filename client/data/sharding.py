"""Who reads which sample: ranks, DataLoader workers, and the resume position.

**Ranks.** Position ``p`` of an epoch's shuffled order belongs to rank
``p % world_size``, as that rank's local position ``p // world_size``. So
local position ``j`` of rank ``r`` is global position ``j * world_size + r``,
every position belongs to exactly one rank, and global step ``k`` of a run
with per-rank batch size ``B`` is the contiguous block of positions
``[k*B*W, (k+1)*B*W)``: `explain` can name it without knowing anything else.
Ranks differ by at most one sample per epoch; ``drop_last`` trims every rank
to ``n // world_size`` for jobs that need equal counts (then up to
``world_size - 1`` samples, a different few each epoch, are skipped).

**Workers.** Inside a rank the samples from the resume position on are cut
into units of ``unit`` samples (the batch size, when the dataset knows it;
else single samples), and worker ``w`` of ``K`` takes units ``w, w+K,
w+2K, ...``. A DataLoader takes one batch from each worker in turn, so when
``unit`` is its batch size the loader's output is exactly the single-process
order, and resuming from "samples consumed" is exact with any number of
workers.

**Resume anywhere.** The ranks of a run consume the epoch's order as one
prefix: after ``c`` samples per rank, global positions ``[0, c * world_size)``
are done, whatever the number of ranks. A resumed run cuts the rest of the
epoch ``[start, n)`` the same way among its own ranks: local position ``j``
of rank ``r`` is global position ``start + j * world_size + r`` (`Shard`
with ``start``). `state.EpochState` holds that position.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Shard:
    """This rank's part of an epoch of ``n`` items."""

    n: int
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    start: int = 0  # global position this part of the epoch begins at (a resume)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError("world_size must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), not {self.rank}")
        if self.n < 0:
            raise ValueError("negative item count")
        if not 0 <= self.start <= self.n:
            raise ValueError(f"start must be in [0, {self.n}], not {self.start}")

    @property
    def size(self) -> int:
        """Items this rank sees from ``start`` to the epoch's end."""
        rest = self.n - self.start
        if self.drop_last:
            return rest // self.world_size
        return max(0, (rest - self.rank + self.world_size - 1) // self.world_size)

    @property
    def most(self) -> int:
        """The largest rank's `size`: a count of samples per rank that means
        "the whole epoch is done" on every rank."""
        rest = self.n - self.start
        if self.drop_last:
            return rest // self.world_size
        return -(-rest // self.world_size)

    def global_positions(self, local: IntArray) -> IntArray:
        out: IntArray = self.start + local * self.world_size + self.rank
        return out

    def global_position(self, consumed: int) -> int:
        """Where the epoch stands once every rank has taken *consumed* samples
        of this part (the ranks move in lockstep: one batch per step)."""
        if not 0 <= consumed <= self.most:
            raise ValueError(f"consumed must be in [0, {self.most}], not {consumed}")
        if consumed == self.most:
            return self.n  # drop_last's remainder is skipped, not pending
        return self.start + consumed * self.world_size


def in_worker() -> bool:
    """True inside a torch DataLoader worker process."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def worker_identity() -> tuple[int, int]:
    """(worker id, number of workers) inside a torch DataLoader worker, else
    (0, 1). torch is consulted only if already imported: a process that never
    imported it cannot be a DataLoader worker."""
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return 0, 1
    info = data.get_worker_info()
    if info is None:
        return 0, 1
    return int(info.id), int(info.num_workers)


def worker_blocks(
    total: int,
    start: int,
    unit: int,
    worker: int,
    num_workers: int,
    units_per_block: int,
    skip: int = 0,
) -> Iterator[IntArray]:
    """The local positions worker *worker* of *num_workers* produces, in
    order, as blocks of *units_per_block* units of *unit* positions.

    Positions ``[start, total)`` are cut into units; unit ``i`` belongs to
    worker ``i % num_workers``. Only the last unit may be short. *skip*: the
    first positions of this worker's stream already delivered (a worker
    restored from its own saved state, as torchdata's StatefulDataLoader does)."""
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, {num_workers}), not {worker}")
    if unit < 1 or units_per_block < 1 or skip < 0:
        raise ValueError("unit and units_per_block must be at least 1, skip at least 0")
    within = np.arange(unit, dtype=np.int64)
    first, drop = divmod(skip, unit)
    block = 0
    while True:
        q = first + block * units_per_block + np.arange(units_per_block, dtype=np.int64)
        units = q * num_workers + worker
        positions = (start + units[:, None] * unit + within[None, :]).reshape(-1)
        if block == 0 and drop:
            positions = positions[drop:]
        positions = positions[positions < total]
        if positions.size == 0:
            return
        yield positions
        block += 1


def read_grouping(batch_size: int | None, readahead: int, read_size: int) -> tuple[int, int]:
    """(unit, units per read) for `worker_blocks`.

    The unit is the batch (single samples without a batch size). With
    readahead, one read covers at least *read_size* samples: consecutive
    batches of this worker's stream go out together, so a batch of 8 costs
    an eighth of a request per storage node instead of one; without
    readahead, a batch is read when it is asked for and not before."""
    unit = batch_size or 1
    if batch_size is not None and readahead == 0:
        return unit, 1
    return unit, max(1, -(-read_size // unit))


def fingerprint(parts: Any) -> str:
    """A short stable digest of what defines a dataset's index (file names,
    sizes, window geometry): a state saved for one dataset is refused by
    another instead of silently resuming somewhere else."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()
