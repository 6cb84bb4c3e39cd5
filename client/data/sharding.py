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

**Resume.** `EpochState` holds (seed, epoch, samples consumed by this rank).
The main-process dataset object never sees what DataLoader workers yield, so
the count comes from the trainer: ``state_dict(consumed=steps * batch_size)``
or the `ShuffleLoader` wrapper, which counts the batches as they are taken.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shufflefs.client.data.permutation import KeyedPermutation

log = logging.getLogger("shufflefs.client.data")

IntArray = npt.NDArray[np.int64]
STATE_FORMAT = "shufflefs.sampler/1"


@dataclass(frozen=True)
class Shard:
    """This rank's part of an epoch of ``n`` items."""

    n: int
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError("world_size must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), not {self.rank}")
        if self.n < 0:
            raise ValueError("negative item count")

    @property
    def size(self) -> int:
        """Items this rank sees per epoch."""
        if self.drop_last:
            return self.n // self.world_size
        return max(0, (self.n - self.rank + self.world_size - 1) // self.world_size)

    def global_positions(self, local: IntArray) -> IntArray:
        out: IntArray = local * self.world_size + self.rank
        return out


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
) -> Iterator[IntArray]:
    """The local positions worker *worker* of *num_workers* produces, in
    order, as blocks of *units_per_block* units of *unit* positions.

    Positions ``[start, total)`` are cut into units; unit ``i`` belongs to
    worker ``i % num_workers``. Only the last unit may be short."""
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, {num_workers}), not {worker}")
    if unit < 1 or units_per_block < 1:
        raise ValueError("unit and units_per_block must be at least 1")
    within = np.arange(unit, dtype=np.int64)
    block = 0
    while True:
        q = block * units_per_block + np.arange(units_per_block, dtype=np.int64)
        units = q * num_workers + worker
        positions = (start + units[:, None] * unit + within[None, :]).reshape(-1)
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


class EpochState:
    """(seed, epoch, samples consumed) of one rank, and what resuming means.

    * ``set_epoch(e)`` with a new epoch starts it from its first sample; with
      the current epoch it keeps the position, so a restored state survives
      the training loop's usual ``set_epoch`` call.
    * An iteration starts at the resume position (set by `load_state_dict`)
      and consumes it: iterating again in the same epoch starts over, in the
      same order (as torch's DistributedSampler does without ``set_epoch``).
    * ``state_dict()`` records the samples taken from this object's own
      iteration (exact in a single process, or a DataLoader with
      ``num_workers=0``); with workers pass ``consumed=`` or use
      `ShuffleLoader`.
    """

    kind = "items"

    def __init__(self, shard: Shard, seed: int, batch_size: int | None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.shard = shard
        self.seed = int(seed)
        self.batch_size = batch_size
        self.epoch = 0
        self._resume = 0  # where the next iteration starts
        self._consumed = 0  # samples this object's own iteration handed out
        self._perm: KeyedPermutation | None = None  # the last epoch's, kept

    def permutation(self, epoch: int | None = None) -> KeyedPermutation:
        """The order of *epoch* (default: the current one) over all ranks."""
        epoch = self.epoch if epoch is None else epoch
        perm = self._perm
        if perm is None or perm.epoch != epoch or perm.seed != self.seed:
            perm = self._perm = KeyedPermutation(self.shard.n, self.seed, epoch)
        return perm

    def ordered(self, positions: npt.ArrayLike, epoch: int | None = None) -> IntArray:
        """What stands at this rank's *positions* of *epoch* (item or window numbers)."""
        local = np.asarray(positions, dtype=np.int64)
        if local.size and (local.min() < 0 or local.max() >= len(self)):
            raise IndexError(f"positions outside this rank's [0, {len(self)})")
        return self.permutation(epoch)(self.shard.global_positions(local))

    def rank_slice(
        self, rank: int, position: int, count: int, epoch: int | None
    ) -> tuple[IntArray, IntArray]:
        """(positions, what stands there) of *rank*'s positions ``[position,
        position + count)`` of *epoch*, cut at the epoch's end: any rank's,
        so one process can explain a step of the whole job."""
        if position < 0 or count < 0:
            raise ValueError("position and count must be >= 0")
        shard = Shard(self.shard.n, rank, self.shard.world_size, self.shard.drop_last)
        local = np.arange(position, min(position + count, shard.size), dtype=np.int64)
        return local, self.permutation(epoch)(shard.global_positions(local))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_perm"] = None  # rebuilt on first use (pickled into DataLoader workers)
        return state

    def __len__(self) -> int:
        return self.shard.size

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.world_size

    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise ValueError("epoch must be >= 0")
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._resume = 0
            self._consumed = 0

    def _begin(self) -> int:
        """Start an iteration: the position it starts at."""
        start, self._resume = self._resume, 0
        self._consumed = start
        return start

    def _identity(self) -> dict[str, Any]:
        """What a saved state must agree with to be loaded here."""
        return {"num_items": self.shard.n}

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The exact position: load it into a dataset built the same way and
        the run continues with the samples it would have produced.

        *consumed*: samples of this epoch this rank has trained on (e.g.
        ``steps_this_epoch * batch_size``); default: what this object's own
        iteration handed out."""
        n = self._consumed if consumed is None else int(consumed)
        if not 0 <= n <= len(self):
            raise ValueError(f"consumed must be in [0, {len(self)}], not {n}")
        return {
            "format": STATE_FORMAT,
            "kind": self.kind,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": n,
            "rank": self.rank,
            "world_size": self.world_size,
            "drop_last": self.shard.drop_last,
            "batch_size": self.batch_size,
            **self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT or state.get("kind") != self.kind:
            raise ValueError(f"not a {self.kind} sampler state: {state!r:.200}")
        mine = self._identity()
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(
                    f"the saved state is for another dataset ({key}: saved {state.get(key)!r}, "
                    f"here {value!r})"
                )
        for key in ("rank", "world_size", "drop_last"):
            if state[key] != getattr(self.shard, key):
                raise ValueError(
                    f"the saved state is for {key}={state[key]!r}, this dataset has "
                    f"{getattr(self.shard, key)!r}: positions would not line up"
                )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= len(self):
            raise ValueError(f"saved consumed={consumed} outside [0, {len(self)}]")
        if self.seed != state["seed"]:
            log.info("taking seed %d from the saved state (was %d)", state["seed"], self.seed)
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._resume = consumed
        self._consumed = consumed
