"""Mixtures: several datasets as one shuffled, sharded, resumable order.

    from shufflefs.client.data import Mixture, TokenWindowDataset
    mix = Mixture([web, code, books], weights=[0.5, 0.3, 0.2], seed=0,
                  rank=rank, world_size=world, batch_size=32)

Global position ``p`` of epoch ``e`` holds sample ``k`` of component ``i``,
both from `interleave.Schedule` (exact proportions, from the position alone);
that sample is position ``k`` of the component's own keyed permutation (its
seed derived from the mixture's seed and ``i``). Ranks, workers, resume and
quarantine are `EpochState`'s, over the mixture's positions; components may
be token windows, file datasets, or mixtures.

When a component runs out (*exhausted*): ``"stop"`` ends the epoch at the
first position where some component would need more samples than it has
(every sample of the epoch is then distinct); ``"repeat"`` continues that
component with its next epoch's order, and the epoch is *samples_per_epoch*
positions long (default: all components' samples added up). With "repeat"
mixture epoch ``e`` continues each component where epoch ``e - 1`` left it.
A schedule's positions count from the start of each epoch.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import struct
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from shufflefs.client.data.files import FileSamples
from shufflefs.client.data.interleave import Schedule
from shufflefs.client.data.readahead import ReadPlan, pipeline
from shufflefs.client.data.readers import RangeReader, make_reader
from shufflefs.client.data.sharding import (
    Shard,
    fingerprint,
    read_grouping,
    worker_blocks,
    worker_identity,
)
from shufflefs.client.data.state import Batched, EpochState, as_key
from shufflefs.client.data.tokens import READ_SIZE, TokenWindows, split_units

log = logging.getLogger("shufflefs.client.data")

IntArray = npt.NDArray[np.int64]
Leaf = TokenWindows | FileSamples
EXHAUSTED = ("stop", "repeat")
Weights = Sequence[float | int]


def component_seed(seed: int, index: int) -> int:
    """Component *index*'s permutation seed in a mixture of *seed*: unrelated
    orders for components of the same size, one number to reproduce them."""
    digest = hashlib.blake2b(
        struct.pack("<QQ", seed & (2**64 - 1), index), digest_size=8, person=b"sfs-mix"
    ).digest()
    return int.from_bytes(digest, "little") >> 1


def _set_seed(component: Any, seed: int) -> None:
    if isinstance(component, MixtureSamples):
        component._reseed(seed)
    elif isinstance(component, FileSamples):
        component.sampler.seed = seed
    else:
        component.seed = seed


def _size(component: Any) -> int:
    return int(component.shard.n)


def _identity(component: Any) -> dict[str, Any]:
    if isinstance(component, FileSamples):
        return component.sampler._identity()
    out: dict[str, Any] = component._identity()
    return out


class MixtureReader:
    """One reader over the files of all a mixture's leaves (file ``f`` of leaf
    ``l`` is ``base[l] + f``), so a batch drawn from several components is
    still one read: for the native client, one request per storage node."""

    def __init__(self, leaves: Sequence[Leaf], threads: int) -> None:
        paths: list[str] = []
        base = []
        for leaf in leaves:
            base.append(len(paths))
            paths += leaf_paths(leaf)
        configs = {leaf.config for leaf in leaves}
        if len(configs) > 1:
            raise ValueError("a mixture's components must use one client config")
        self.base = np.asarray(base, dtype=np.int64)
        self.reader = make_reader(paths, configs.pop(), threads)


def leaf_paths(leaf: Leaf) -> list[str]:
    return list(leaf.index.paths) if isinstance(leaf, TokenWindows) else list(leaf.files)


class MixtureSamples(Batched, EpochState):
    """Datasets mixed with exact proportions, optionally changing with the
    position (*schedule*: ``[(start_position, weights), ...]`` instead of
    *weights*). Iterates like `TokenWindows` (samples, or `iter_batches`);
    batches of token windows of one shape are arrays (tensors for
    `TokenWindowDataset` components), others lists of samples. Without torch:
    `shufflefs.client.data.Mixture` is this as a torch ``IterableDataset``,
    and the CLI (`sample explain`, `quarantine`) uses this one, so it does
    not pay for importing torch."""

    kind = "mixture"

    def __init__(
        self,
        components: Sequence[Any],
        weights: Weights | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        *,
        schedule: Schedule | Sequence[tuple[int, Weights]] | None = None,
        exhausted: str = "stop",
        samples_per_epoch: int | None = None,
        batch_size: int | None = None,
        readahead: int = 4,
        read_size: int = READ_SIZE,
        drop_last: bool = False,
    ) -> None:
        if (weights is None) == (schedule is None):
            raise ValueError("give the mixture weights or a schedule (one of them)")
        if exhausted not in EXHAUSTED:
            raise ValueError(f"exhausted must be one of {EXHAUSTED}, not {exhausted!r}")
        if readahead < 0 or read_size < 1:
            raise ValueError("readahead must be >= 0 and read_size >= 1")
        self.components = list(components)
        for c in self.components:
            if not isinstance(c, (TokenWindows, FileSamples, MixtureSamples)):
                raise TypeError(f"a mixture component must be a dataset of this package, not {c!r}")
        if isinstance(schedule, Schedule):
            self.schedule = schedule
        else:
            self.schedule = Schedule(schedule if schedule is not None else [(0, weights or [])])
        if self.schedule.components != len(self.components):
            raise ValueError(
                f"{len(self.components)} components but {self.schedule.components} weights"
            )
        self.exhausted = exhausted
        self.samples_per_epoch = samples_per_epoch
        self.readahead = readahead
        self.read_size = read_size
        self.leaves: list[Leaf] = []
        self.leaf_base: list[int] = []  # first leaf of each component
        for c in self.components:
            self.leaf_base.append(len(self.leaves))
            self.leaves += c.leaves if isinstance(c, MixtureSamples) else [c]
        super().__init__(Shard(0, rank, world_size, drop_last), seed, batch_size)
        self._reseed(self.seed)
        self.shard = replace(self.shard, n=self._epoch_length())
        shapes = {
            (leaf.index.window, (leaf.out_dtype or leaf.index.dtype).str)
            if isinstance(leaf, TokenWindows)
            else None
            for leaf in self.leaves
        }
        self._arrays = None not in shapes and len(shapes) == 1  # batches are 2-D arrays
        self._reader: MixtureReader | None = None

    # ---- definition ----------------------------------------------------------

    def _reseed(self, seed: int) -> None:
        self.seed = int(seed)
        for i, c in enumerate(self.components):
            _set_seed(c, component_seed(self.seed, i))

    def _epoch_length(self) -> int:
        sizes = [_size(c) for c in self.components]
        if self.exhausted == "stop":
            length = self.schedule.length_within(sizes)
        else:
            for i, n in enumerate(sizes):
                if n == 0 and any(p.a[i] for p in self.schedule.pieces):
                    raise ValueError(f"component {i} is empty and cannot repeat")
            length = self.samples_per_epoch if self.samples_per_epoch is not None else sum(sizes)
        self._per_epoch = self.schedule.counts(length)  # each component's samples per epoch
        return length

    def _identity(self) -> dict[str, Any]:
        return {
            "components": fingerprint([_identity(c) for c in self.components]),
            "exhausted": self.exhausted,
            "samples_per_epoch": self.samples_per_epoch,
        }

    def _extra_state(self) -> dict[str, Any]:
        return {"schedule": self.schedule.as_list(), "num_items": self.shard.n}

    def _load_extra(self, state: dict[str, Any], position: int) -> None:
        saved = Schedule([(int(s), list(a)) for s, a in state["schedule"]])
        if saved != self.schedule:
            log.info("schedule changed at position %d: the part before it stays as run", position)
            self.schedule = saved.continued(self.schedule, position)
        self._reseed(self.seed)
        self.shard = replace(self.shard, n=self._epoch_length())

    def set_schedule(self, schedule: Schedule | Sequence[tuple[int, Weights]]) -> None:
        """Follow *schedule* from the current global position on; what was
        consumed before it stays as it was (no sample repeated or dropped)."""
        new = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
        position = self.state_dict()["position"]
        self.schedule = self.schedule.continued(new, position)
        self.shard = replace(self.shard, n=self._epoch_length())

    # ---- the order -------------------------------------------------------------

    def _resolve(self, epoch: int, positions: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """(component, leaf, item) at sorted global *positions* of *epoch*."""
        comp, index = self.schedule.lookup(positions)
        leaf = np.empty(positions.size, dtype=np.int64)
        item = np.empty(positions.size, dtype=np.int64)
        for i, c in enumerate(self.components):
            where = np.flatnonzero(comp == i)
            if where.size == 0:
                continue
            k = index[where]
            if self.exhausted == "repeat":
                total = epoch * self._per_epoch[i] + k
                epochs, pos = total // _size(c), total % _size(c)
            else:
                epochs, pos = np.full(k.size, epoch, dtype=np.int64), k
            for e in np.unique(epochs).tolist():
                sel = epochs == e
                at = where[sel]
                if isinstance(c, MixtureSamples):
                    order = np.argsort(pos[sel], kind="stable")
                    _, sub_leaf, sub_item = c._resolve(int(e), pos[sel][order])
                    leaf[at[order]] = self.leaf_base[i] + sub_leaf
                    item[at[order]] = sub_item
                else:
                    leaf[at] = self.leaf_base[i]
                    item[at] = c.permutation(int(e))(pos[sel])
        return comp, leaf, item

    def _keep_leaves(self, leaf: IntArray, item: IntArray) -> npt.NDArray[np.bool_] | None:
        keep: npt.NDArray[np.bool_] | None = None
        for li in np.unique(leaf).tolist():
            sel = leaf == li
            mask = self.leaves[li]._keep(item[sel])
            if mask is not None:
                if keep is None:
                    keep = np.ones(leaf.size, dtype=bool)
                keep[np.flatnonzero(sel)[~mask]] = False
        return keep

    def _locate(self, leaf: IntArray, item: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """(leaf's file, byte offset, byte length) of each (leaf, item)."""
        files = np.empty(leaf.size, dtype=np.int64)
        offsets = np.empty(leaf.size, dtype=np.int64)
        lengths = np.empty(leaf.size, dtype=np.int64)
        for li in np.unique(leaf).tolist():
            sel = leaf == li
            files[sel], offsets[sel], lengths[sel] = self.leaves[li]._locate(item[sel])
        return files, offsets, lengths

    def explain(
        self, position: int, count: int = 1, epoch: int | None = None
    ) -> list[dict[str, Any]]:
        """The samples at global positions ``[position, position + count)`` of
        *epoch* (default: the current one), cut at the epoch's end, as keys
        ``{"component", "path", "offset", "length"}`` (plus ``"quarantined":
        True`` for a quarantined one). Global step ``k`` of a run with global
        batch ``G`` that started the epoch (or resumed) at position ``s`` is
        ``explain(s + k * G, G)``."""
        if position < 0 or count < 0:
            raise ValueError("position and count must be >= 0")
        pos = np.arange(position, min(position + count, self.shard.n), dtype=np.int64)
        return self._keys(self.epoch if epoch is None else epoch, pos)

    def _keys(self, epoch: int, positions: IntArray) -> list[dict[str, Any]]:
        comp, leaf, item = self._resolve(epoch, positions)
        files, offsets, lengths = self._locate(leaf, item)
        keep = self._keep_leaves(leaf, item)
        out = []
        for k, (c, li, f, o, n) in enumerate(
            zip(
                comp.tolist(),
                leaf.tolist(),
                files.tolist(),
                offsets.tolist(),
                lengths.tolist(),
                strict=True,
            )
        ):
            key: dict[str, Any] = {
                "component": c,
                "path": leaf_paths(self.leaves[li])[f],
                "offset": o,
                "length": n,
            }
            if keep is not None and not keep[k]:
                key["quarantined"] = True
            out.append(key)
        return out

    def explain_step(
        self, step: int, batch_size: int | None = None, epoch: int | None = None
    ) -> list[dict[str, Any]]:
        """Every rank's batch *step* since this part of the epoch began (the
        start, or the position it was resumed at), ranks in order, each key
        with its rank and global position."""
        batch = self.batch_size if batch_size is None else batch_size
        if batch is None:
            raise ValueError("explain_step needs a batch size")
        out = []
        for rank in range(self.world_size):
            shard = replace(self.shard, rank=rank)
            local = np.arange(step * batch, min((step + 1) * batch, shard.size), dtype=np.int64)
            glob = shard.global_positions(local)
            for p, key in zip(
                glob.tolist(), self._keys(self.epoch if epoch is None else epoch, glob), strict=True
            ):
                out.append({"rank": rank, "position": p, **key})
        return out

    # ---- quarantine --------------------------------------------------------------

    def _normalize_key(self, key: Any) -> dict[str, Any]:
        out = as_key(key)
        i = out.get("component")
        if i is None or not 0 <= i < len(self.components):
            last = len(self.components) - 1
            raise ValueError(f"a mixture's sample key names its component (0..{last}): {key!r}")
        return out

    def quarantine(self, keys: Sequence[Any]) -> None:
        """Skip these samples (keys as `explain` returns them) from now on;
        every other sample keeps its place in the order."""
        normalized = [self._normalize_key(k) for k in keys]
        for key in normalized:
            self._quarantine_in(self.components[key["component"]], key)
        known = {(k["component"], k["path"], k["offset"], k["length"]) for k in self.quarantined}
        for key in normalized:
            t = (key["component"], key["path"], key["offset"], key["length"])
            if t not in known:
                known.add(t)
                self.quarantined.append(key)

    def _quarantine_in(self, component: Any, key: dict[str, Any]) -> None:
        plain = {k: v for k, v in key.items() if k != "component"}
        if not isinstance(component, MixtureSamples):
            component.quarantine([plain])
            return
        for i, sub in enumerate(component.components):  # a nested mixture: the one that has it
            try:
                component._quarantine_in(sub, plain)
            except ValueError:
                continue
            component.quarantined.append({"component": i, **plain})
            return
        raise ValueError(f"{key} is not a sample of component {key['component']}")

    def _keep(self, items: IntArray) -> npt.NDArray[np.bool_] | None:
        raise TypeError("a mixture's quarantine is its leaves'")

    # ---- reading -----------------------------------------------------------------

    @property
    def files(self) -> MixtureReader:
        if self._reader is None:
            self._reader = MixtureReader(self.leaves, max(1, self.readahead))
        return self._reader

    @property
    def reader(self) -> RangeReader:
        return self.files.reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.reader.close()

    def _plans(self, cursor: Any, worker: int, num_workers: int) -> Iterator[ReadPlan[Any]]:
        unit, per_block = read_grouping(self.batch_size, self.readahead, self.read_size)
        shard = cursor.shard
        file_base = self.files.base
        blocks = worker_blocks(
            shard.size, cursor.start, unit, worker, num_workers, per_block, cursor.skip
        )
        for local in blocks:
            _, leaf, item = self._resolve(cursor.epoch, shard.global_positions(local))
            kept = local
            keep = self._keep_leaves(leaf, item)
            if keep is not None:
                kept, leaf, item = local[keep], leaf[keep], item[keep]
            order = np.argsort(leaf, kind="stable")  # grouped by leaf, to decode per leaf
            leaf, item = leaf[order], item[order]
            files, offsets, lengths = self._locate(leaf, item)
            yield ReadPlan(
                (local, kept, leaf, order, lengths), file_base[leaf] + files, offsets, lengths
            )

    def _assemble(
        self, buf: npt.NDArray[np.uint8], leaf: IntArray, order: IntArray, lengths: IntArray
    ) -> Any:
        """The samples of a read, back in position order."""
        ends = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        cuts = [0, *(np.flatnonzero(np.diff(leaf)) + 1).tolist(), leaf.size]
        out: Any = None
        for lo, hi in itertools.pairwise(cuts):
            if lo == hi:
                continue
            rows: Any = self.leaves[int(leaf[lo])]._decode(
                buf[int(ends[lo]) : int(ends[hi])], lengths[lo:hi]
            )
            if self._arrays:
                if out is None:
                    out = np.empty((leaf.size, rows.shape[1]), dtype=rows.dtype)
                out[order[lo:hi]] = rows
            else:
                if out is None:
                    out = [None] * leaf.size
                for k, row in zip(order[lo:hi].tolist(), rows, strict=True):
                    out[k] = row
        if out is None:
            return self._empty()
        return out

    def _empty(self) -> Any:
        if not self._arrays:
            return []
        leaf = self.leaves[0]
        assert isinstance(leaf, TokenWindows)
        return np.empty(
            (0, leaf.index.window), dtype=leaf.out_dtype or leaf.index.dtype.newbyteorder("=")
        )

    def _units(self, worker: int | None, num_workers: int | None) -> Iterator[tuple[int, Any]]:
        if worker is None or num_workers is None:
            worker, num_workers = worker_identity()
        cursor = self._begin()
        plans = self._plans(cursor, worker, num_workers)
        for (local, kept, leaf, order, lengths), buf in pipeline(
            self.reader, plans, self.readahead
        ):
            samples = self._assemble(buf, leaf, order, lengths)
            yield from split_units(local, kept, samples, cursor.start, self.batch_size or 0)
        self._finish(cursor)

    def _convert(self, value: Any) -> Any:
        leaf = self.leaves[0]
        if self._arrays and isinstance(leaf, TokenWindows):
            return leaf._convert(value)
        return value

    def __repr__(self) -> str:
        return (
            f"Mixture({len(self.components)} components, {self.shard.n} samples per epoch, "
            f"schedule {self.schedule.as_list()}, {self.exhausted}, rank {self.rank}/"
            f"{self.world_size}, seed {self.seed}, epoch {self.epoch})"
        )
