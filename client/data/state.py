"""Where an epoch stands, as one global number, and what resuming from it means.

The state of a data order is ``(seed, epoch, position)``: ``position`` is how
many samples of the epoch's global order the whole job has consumed (the
ranks take it as one prefix, see `sharding`), plus the quarantine and, for a
mixture, the schedule. Nothing in it depends on how many ranks or workers
produced it, so a run saved on W ranks x K workers resumes on any W' x K'
with any batch size: the new ranks cut the rest of the epoch among
themselves, and over the epoch every sample is delivered once.

Every rank saves the same global state. `combine_states` takes the states
of all ranks (or any subset) and refuses them when they disagree: ranks that
did not stop at the same step would otherwise resume with a silent gap or
repeat.

DataLoader workers hold copies of the dataset. The epoch and the resume
position are kept in a small block of shared memory (`Control`) that the
main process writes (``set_epoch``, ``load_state_dict``) and each worker
reads when its iteration begins, so persistent workers follow the main
process instead of keeping their first copy. Inside a worker, `state_dict`
and `load_state_dict` describe that worker's own stream: that is what
torchdata's ``StatefulDataLoader`` saves per worker and gives back to each.
"""

from __future__ import annotations

import logging
import multiprocessing
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing import context
from typing import Any

import numpy as np
import numpy.typing as npt

from shufflefs.client.data.permutation import KeyedPermutation
from shufflefs.client.data.sharding import (
    Shard,
    in_worker,
    read_grouping,
    worker_blocks,
    worker_identity,
)

log = logging.getLogger("shufflefs.client.data")

IntArray = npt.NDArray[np.int64]
STATE_FORMAT = "shufflefs.sampler/2"
LEGACY_FORMAT = "shufflefs.sampler/1"  # per rank: (rank, world_size, consumed)
# what a state says about who saved it, not about the order: may differ between ranks
SAVED_BY = ("rank", "consumed", "worker")


def combine_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The one global state of several ranks' states; ValueError naming the
    first field on which two of them disagree."""
    if not states:
        raise ValueError("no states to combine")
    first = states[0]
    for other in states[1:]:
        for key in sorted(set(first) | set(other)):
            if key in SAVED_BY:
                continue
            if first.get(key) != other.get(key):
                raise ValueError(
                    f"the ranks' data states disagree on {key}: rank {first.get('rank')} saved "
                    f"{first.get(key)!r:.80}, rank {other.get('rank')} saved {other.get(key)!r:.80}"
                    " (did they stop at different steps?); refusing to resume from them"
                )
    return first


class Control:
    """(version, epoch, start, resume) in shared memory: written by the main
    process, read by DataLoader workers (forked: inherited; spawned: passed
    with the dataset). Pickled any other way it becomes a private copy."""

    def __init__(self, values: Sequence[int] = (0, 0, 0, 0)) -> None:
        self.array = multiprocessing.RawArray("q", 4)
        self.array[:] = list(values)

    def read(self) -> tuple[int, int, int, int]:
        version, epoch, start, resume = self.array[:]
        return version, epoch, start, resume

    def write(self, epoch: int, start: int, resume: int) -> None:
        self.array[1:4] = [epoch, start, resume]
        self.array[0] = self.array[0] + 1

    def __getstate__(self) -> dict[str, Any]:
        if context.get_spawning_popen() is not None:
            return {"array": self.array}
        return {"values": list(self.array[:])}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "array" in state:
            self.array = state["array"]
        else:
            self.__init__(state["values"])  # type: ignore[misc]


@dataclass(frozen=True)
class Cursor:
    """One iteration: its part of the epoch, the local position it begins at
    and, for a restored worker, how much of that worker's stream is done."""

    shard: Shard
    epoch: int
    start: int
    skip: int = 0


class EpochState:
    """(seed, epoch, global position, quarantine) and what resuming means.

    * ``set_epoch(e)`` with a new epoch starts it from its first sample; with
      the current epoch it keeps the position, so a restored state survives
      the training loop's usual ``set_epoch`` call.
    * An iteration starts at the resume position and consumes it: iterating
      again in the same epoch starts over, in the same order.
    * ``state_dict()`` is global; ``consumed=`` is the samples per rank the
      trainer has taken (``steps * batch_size``), by default what this
      object's own iteration handed out (exact without workers).
    """

    kind = "items"

    def __init__(self, shard: Shard, seed: int, batch_size: int | None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.shard = shard
        self.seed = int(seed)
        self.batch_size = batch_size
        self.epoch = 0
        self.quarantined: list[dict[str, Any]] = []
        self._blocked: IntArray = np.zeros(0, dtype=np.int64)  # quarantined item numbers
        self._control = Control()
        self._used = -1  # the control version this copy's last iteration began from
        self._consumed = 0  # samples this object's iteration handed out (local, from shard.start)
        self._cursor: Cursor | None = None
        self._restored: Cursor | None = None  # a worker's own saved stream (StatefulDataLoader)
        self._perm: KeyedPermutation | None = None  # the last epoch's, kept

    # ---- the order ---------------------------------------------------------

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
        shard = replace(self.shard, rank=rank)
        local = np.arange(position, min(position + count, shard.size), dtype=np.int64)
        return local, self.permutation(epoch)(shard.global_positions(local))

    def __len__(self) -> int:
        return self.shard.size

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.world_size

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_perm"] = None  # rebuilt on first use (pickled into DataLoader workers)
        return state

    # ---- epochs and iterations --------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise ValueError("epoch must be >= 0")
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._control.write(self.epoch, 0, 0)
            self.shard = replace(self.shard, start=0)
            self._consumed = 0

    def _peek(self) -> tuple[int, int, int]:
        """(epoch, start, resume) the next iteration of this copy begins at."""
        version, epoch, start, resume = self._control.read()
        if version == self._used:  # this position was iterated already: start over
            return epoch, 0, 0
        return epoch, start, resume

    def _begin(self) -> Cursor:
        """Start an iteration (in this process: the main one or a worker)."""
        restored, self._restored = self._restored, None
        if restored is not None and restored.epoch == self._control.read()[1]:
            cursor = restored  # this worker's own saved stream
        else:  # (a worker's state of another epoch than the main process's: stale)
            epoch, start, resume = self._peek()
            cursor = Cursor(replace(self.shard, start=start), epoch, resume)
            self._used = self._control.read()[0]
        self.epoch = cursor.epoch
        self.shard = cursor.shard
        self._consumed = cursor.start
        self._cursor = cursor
        return cursor

    def _adopt(self, mark_used: bool) -> None:
        """Take the position the next iteration begins at without iterating:
        for a loader whose DataLoader workers begin the iteration
        (*mark_used*: mark it as they do) or that begins it here."""
        epoch, start, resume = self._peek()
        if mark_used:
            self._used = self._control.read()[0]
        self.epoch = epoch
        self.shard = replace(self.shard, start=start)
        self._consumed = resume

    def _finish(self, cursor: Cursor) -> None:
        """An iteration ran to its end: this rank's part of the epoch is done."""
        if self._cursor is cursor:
            self._consumed = cursor.shard.most

    def _blocks(
        self, cursor: Cursor, worker: int, num_workers: int, readahead: int, read_size: int
    ) -> Iterator[tuple[IntArray, IntArray, IntArray]]:
        """(local positions, those not quarantined, their items) of each read
        of this worker's stream (see `sharding.worker_blocks`)."""
        unit, per_block = read_grouping(self.batch_size, readahead, read_size)
        perm = self.permutation(cursor.epoch)
        shard = cursor.shard
        blocks = worker_blocks(
            shard.size, cursor.start, unit, worker, num_workers, per_block, cursor.skip
        )
        for local in blocks:
            items = perm(shard.global_positions(local))
            keep = self._keep(items)
            yield (local, local, items) if keep is None else (local, local[keep], items[keep])

    # ---- state -------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        """What a saved state must agree with to be loaded here."""
        return {"num_items": self.shard.n}

    def _extra_state(self) -> dict[str, Any]:
        """More of the order's definition (a mixture's schedule)."""
        return {}

    def _load_extra(self, state: dict[str, Any], position: int) -> None:
        return None

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The global position: load it into a dataset built the same way (on
        any number of ranks) and the run continues with the samples it would
        have produced.

        *consumed*: samples of this epoch each rank has trained on since the
        last restore (e.g. ``steps * batch_size``); default: what this
        object's own iteration handed out. Inside a DataLoader worker: that
        worker's own stream (what StatefulDataLoader saves)."""
        n = self._consumed if consumed is None else int(consumed)
        if consumed is None and in_worker() and self._cursor is not None:
            return self._worker_state(self._cursor)
        if not 0 <= n <= self.shard.most:
            raise ValueError(f"consumed must be in [0, {self.shard.most}], not {n}")
        return {
            "format": STATE_FORMAT,
            "kind": self.kind,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.shard.global_position(n),
            "quarantine": sorted(self.quarantined, key=_key_order),
            "rank": self.rank,
            "world_size": self.world_size,
            "consumed": n,
            "drop_last": self.shard.drop_last,
            "batch_size": self.batch_size,
            **self._identity(),
            **self._extra_state(),
        }

    def _worker_state(self, cursor: Cursor) -> dict[str, Any]:
        worker, workers = worker_identity()
        state = self.state_dict(consumed=cursor.start)
        state["worker"] = {
            "id": worker,
            "num_workers": workers,
            "start": cursor.shard.start,
            "resume": cursor.start,
            "delivered": cursor.skip + self._consumed - cursor.start,
        }
        return state

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Continue from a saved state: one (every rank saves the same), or
        the list of all ranks' states, refused if they disagree."""
        if not isinstance(state, dict):
            state = combine_states(list(state))
        state = self._upgrade(state)
        if state.get("kind") != self.kind:
            raise ValueError(f"not a {self.kind} sampler state: {state!r:.200}")
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ValueError(
                    f"the saved state is for another dataset ({key}: saved {state.get(key)!r}, "
                    f"here {value!r})"
                )
        position = int(state["position"])
        if self.seed != state["seed"]:
            log.info("taking seed %d from the saved state (was %d)", state["seed"], self.seed)
        self.seed = int(state["seed"])
        self._load_extra(state, position)
        if not 0 <= position <= self.shard.n:
            raise ValueError(f"saved position={position} outside [0, {self.shard.n}]")
        self.quarantine(state.get("quarantine", []))
        worker = state.get("worker")
        if worker is not None and in_worker():
            self._restore_worker(state, worker)
            return
        if in_worker():  # a copy: the shared position is the main process's to write
            shard = replace(self.shard, start=position)
            self._restored = Cursor(shard, int(state["epoch"]), 0)
            return
        self.epoch = int(state["epoch"])
        self._control.write(self.epoch, position, 0)
        self.shard = replace(self.shard, start=position)
        self._consumed = 0

    def _restore_worker(self, state: dict[str, Any], worker: dict[str, Any]) -> None:
        here = worker_identity()
        if (worker["id"], worker["num_workers"]) != here:
            raise ValueError(
                f"a state saved by worker {worker['id']} of {worker['num_workers']} loaded into "
                f"worker {here[0]} of {here[1]}"
            )
        shard = replace(self.shard, start=int(worker["start"]))
        self._restored = Cursor(
            shard, int(state["epoch"]), int(worker["resume"]), int(worker["delivered"])
        )

    def _upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state of an older format, as this one."""
        if state.get("format") == STATE_FORMAT:
            return state
        if state.get("format") != LEGACY_FORMAT:
            raise ValueError(f"not a sampler state: {state!r:.200}")
        old = Shard(self.shard.n, int(state["rank"]), int(state["world_size"]), state["drop_last"])
        return {**state, "position": old.global_position(int(state["consumed"]))}

    # ---- quarantine --------------------------------------------------------

    def quarantine(self, keys: Sequence[Any]) -> None:
        """Skip these samples (keys as `explain` names them) from now on; every
        other sample keeps its place in the order (a batch holding one is
        one shorter)."""
        known = {_key_tuple(k) for k in self.quarantined}
        added = [self._normalize_key(k) for k in keys]
        items = [self._item_of_key(k) for k in added]  # a bad key changes nothing
        for key in added:
            if _key_tuple(key) not in known:
                known.add(_key_tuple(key))
                self.quarantined.append(key)
        self._blocked = np.union1d(self._blocked, np.asarray(items, dtype=np.int64))

    def _normalize_key(self, key: Any) -> dict[str, Any]:
        out = as_key(key)
        out.pop("component", None)
        return out

    def _item_of_key(self, key: dict[str, Any]) -> int:
        """The item (window, file) a key names; ValueError if none."""
        raise ValueError(f"{type(self).__name__} cannot quarantine samples")

    def _keep(self, items: IntArray) -> npt.NDArray[np.bool_] | None:
        """Which of *items* are not quarantined (None: all of them)."""
        blocked = getattr(self, "_blocked", None)
        if blocked is None or blocked.size == 0:
            return None
        keep: npt.NDArray[np.bool_] = ~np.isin(items, blocked)
        return keep


def as_key(key: Any) -> dict[str, Any]:
    """A sample key as a dict: from a dict, or a (path, offset, length) or
    (component, path, offset, length) sequence."""
    if isinstance(key, dict):
        out = {"path": str(key["path"]), "offset": int(key["offset"]), "length": int(key["length"])}
        if key.get("component") is not None:
            out = {"component": int(key["component"]), **out}
        return out
    parts = list(key)
    if len(parts) == 3:
        return {"path": str(parts[0]), "offset": int(parts[1]), "length": int(parts[2])}
    if len(parts) == 4:
        return as_key(dict(zip(("component", "path", "offset", "length"), parts, strict=True)))
    raise ValueError(f"a sample key is (component, path, offset, length), not {key!r}")


def _key_tuple(key: dict[str, Any]) -> tuple[Any, ...]:
    return (key.get("component", -1), key["path"], key["offset"], key["length"])


def _key_order(key: dict[str, Any]) -> tuple[Any, ...]:
    return _key_tuple(key)


def file_index(paths: Sequence[str], path: str) -> int:
    """The index of *path* among a dataset's *paths*: the same path, or the
    only one with its file name (the same files elsewhere: a copy, a mount)."""
    for i, p in enumerate(paths):
        if p == path:
            return i
    name = path.rsplit("/", 1)[-1]
    same = [i for i, p in enumerate(paths) if p.rsplit("/", 1)[-1] == name]
    if len(same) == 1:
        return same[0]
    if same:
        raise ValueError(f"{path}: several files of this dataset have that name")
    raise ValueError(f"{path} is not a file of this dataset")


class Batched(ABC):
    """Batches and samples of a dataset that reads in units (`_units`: the
    positions each covers and its samples), counting positions as consumed."""

    batch_size: int | None
    _consumed: int

    @abstractmethod
    def _units(self, worker: int | None, num_workers: int | None) -> Iterator[tuple[int, Any]]:
        """This worker's units from the current position: (positions covered,
        the samples read), the first more than the second's rows when some of
        them are quarantined."""

    def _convert(self, value: Any) -> Any:
        """What a sample or batch is handed out as (numpy here; torch tensors
        in `TokenWindowDataset`)."""
        return value

    def iter_batches(
        self, *, worker: int | None = None, num_workers: int | None = None
    ) -> Generator[Any, None, None]:
        """This rank's batches from the current position (the last may be
        shorter, and one holding quarantined samples is). Inside a DataLoader
        worker, that worker's batches. *worker*/*num_workers* override the
        DataLoader's worker identity (to shard by hand)."""
        if self.batch_size is None:
            raise ValueError("iter_batches needs the dataset's batch_size")
        for positions, batch in self._units(worker, num_workers):
            self._consumed += positions
            yield self._convert(batch)

    def __iter__(self) -> Iterator[Any]:
        """This rank's samples from the current position (in a DataLoader
        worker: that worker's share)."""
        for positions, batch in self._units(None, None):
            for row in batch:
                self._consumed += 1
                yield self._convert(row)
            self._consumed += positions - len(batch)  # quarantined ones
