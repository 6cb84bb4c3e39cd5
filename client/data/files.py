"""One sample per file: a directory of images, records, documents.

The same shuffle, sharding and resume as token windows, over file numbers
(files sorted by path): `ShuffleSampler` yields this rank's file indices in
the keyed order of (seed, epoch), from the resume position. `FileSamples` is
map-style (``ds[i]`` is file ``i``, ``len(ds)`` the number of files) so it
plugs into a DataLoader with ``sampler=ds.sampler``; ``__getitems__`` reads
a whole batch of files at once (for the native client: one request per
storage node for all of them). Iterating the dataset itself yields this
rank's samples in order with readahead, like `TokenWindows`.

A sample is the file's bytes, or ``transform(bytes)`` (decode an image,
parse a record).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shufflefs.client.data.mount_hints import DEFAULT_AHEAD, MountHints, lookahead
from shufflefs.client.data.readahead import ReadPlan, pipeline
from shufflefs.client.data.readers import RangeReader, make_reader
from shufflefs.client.data.sharding import (
    Shard,
    fingerprint,
    worker_identity,
)
from shufflefs.client.data.sources import Namespace
from shufflefs.client.data.state import EpochState, file_index
from shufflefs.client.data.tokens import (
    ExplainedSample,
    PathArg,
    as_path_list,
    samples_of_step,
    split_units,
)

IntArray = npt.NDArray[np.int64]


class ShuffleSampler(EpochState):
    """This rank's item indices for an epoch, in the keyed shuffled order,
    from the resume position. Usable as a DataLoader ``sampler``."""

    kind = "files"

    def __init__(
        self,
        n: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
        identity: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(Shard(n, rank, world_size, drop_last), seed, batch_size)
        self._extra = identity or {}
        self.files: FileKeys | None = None  # names samples for quarantine keys
        self.hints: MountHints | None = None  # files on a shufflefs mount: hint them ahead

    def _identity(self) -> dict[str, Any]:
        return {"num_items": self.shard.n, **self._extra}

    def _item_of_key(self, key: dict[str, Any]) -> int:
        if self.files is None:
            return super()._item_of_key(key)
        return self.files.item_of_key(key)

    def items(self, positions: npt.ArrayLike, epoch: int | None = None) -> IntArray:
        """Item indices at this rank's *positions* of *epoch*."""
        return self.ordered(positions, epoch)

    def _runs(self, unit: int) -> Iterator[tuple[int, IntArray]]:
        """(positions, items not quarantined) per *unit* positions of this rank."""
        cursor = self._begin()
        perm = self.permutation(cursor.epoch)
        shard = cursor.shard
        for lo in range(cursor.start, shard.size, unit):
            local = np.arange(lo, min(lo + unit, shard.size), dtype=np.int64)
            items = perm(shard.global_positions(local))
            keep = self._keep(items)
            yield local.size, items if keep is None else items[keep]
        self._finish(cursor)

    def _hinted_runs(self, unit: int) -> Iterator[tuple[int, IntArray]]:
        hints = self.hints
        if hints is None:
            return self._runs(unit)
        return lookahead(
            self._runs(min(unit, 64)), hints.ahead, lambda r: hints.files(r[1].tolist()), _run_size
        )

    def __iter__(self) -> Iterator[int]:
        for positions, items in self._hinted_runs(1024):
            for item in items.tolist():
                self._consumed += 1
                yield item
            self._consumed += positions - items.size

    def batches(self) -> Iterator[list[int]]:
        """This rank's items as batches of ``batch_size`` positions (shorter
        where samples are quarantined): a DataLoader ``batch_sampler``."""
        if self.batch_size is None:
            raise ValueError("batches() needs the sampler's batch_size")
        for positions, items in self._hinted_runs(self.batch_size):
            self._consumed += positions
            yield items.tolist()


def _run_size(run: tuple[int, IntArray]) -> int:
    return int(run[1].size)


class FileKeys:
    """Quarantine keys (path, 0, size) of a collection of files, as file numbers."""

    def __init__(self, files: list[str], sizes: IntArray) -> None:
        self.files = files
        self.sizes = sizes

    def item_of_key(self, key: dict[str, Any]) -> int:
        i = file_index(self.files, key["path"])
        if key["offset"] != 0 or key["length"] != int(self.sizes[i]):
            raise ValueError(f"{key} is not a sample of this dataset (a whole file)")
        return i


class FileSamples:
    """Files as samples, shuffled, sharded and resumable.

    *paths*: a directory (every regular file below it, sorted), or a list of
    files; local paths or ``shufflefs://`` URLs. *suffixes*: keep only files
    ending so (e.g. ``(".jpg", ".png")``). Other arguments as `TokenWindows`.
    """

    def __init__(
        self,
        paths: PathArg,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        *,
        batch_size: int | None = None,
        readahead: int = 4,
        read_size: int = 64,
        drop_last: bool = False,
        config: str | os.PathLike[str] | None = None,
        transform: Callable[[bytes], Any] | None = None,
        suffixes: Sequence[str] | None = None,
        mount_prefetch: int = DEFAULT_AHEAD,
    ) -> None:
        self.config = os.fspath(config) if config is not None else None
        given = as_path_list(paths)
        ns = Namespace(given, self.config)
        found: list[tuple[str, int]] = []
        if len(given) == 1 and ns.isdir(given[0]):
            found = ns.walk(given[0])
        else:
            found = list(zip(given, ns.sizes(given), strict=True))
        if suffixes is not None:
            found = [(p, s) for p, s in found if p.endswith(tuple(suffixes))]
        if not found:
            raise ValueError(f"no files in {given!r}")
        self.files = [p for p, _ in found]
        # natively listed files are read by their listed layouts, without opens
        self._layouts = [ns.layouts.get(p) for p in self.files] if ns.layouts else None
        self.sizes = np.asarray([s for _, s in found], dtype=np.int64)
        self.transform = transform
        if readahead < 0 or read_size < 1:
            raise ValueError("readahead must be >= 0 and read_size >= 1")
        self.readahead = readahead
        self.read_size = read_size
        self.sampler = ShuffleSampler(
            len(self.files),
            seed,
            rank,
            world_size,
            batch_size=batch_size,
            drop_last=drop_last,
            identity={
                "fingerprint": fingerprint([[os.path.basename(p), int(s)] for p, s in found])
            },
        )
        self.sampler.files = FileKeys(self.files, self.sizes)
        if not ns.native:
            self.sampler.hints = MountHints.find(self.files, mount_prefetch, whole_files=True)
        self._reader: RangeReader | None = None

    # ---- map-style -------------------------------------------------------

    def __len__(self) -> int:
        """Files in the dataset (the sampler's length is this rank's share)."""
        return len(self.files)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Several files in one read (one request per storage node)."""
        items = np.asarray(indices, dtype=np.int64)
        if items.size and (items.min() < 0 or items.max() >= len(self.files)):
            raise IndexError(f"file index outside [0, {len(self.files)})")
        buf = np.empty(int(self.sizes[items].sum()), dtype=np.uint8)
        self.reader.read_into(items, np.zeros_like(items), self.sizes[items], buf.data)
        return self._decode(buf, self.sizes[items])

    # ---- order, position, explain (delegated to the sampler) --------------

    @property
    def batch_size(self) -> int | None:
        return self.sampler.batch_size

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def seed(self) -> int:
        return self.sampler.seed

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        return self.sampler.state_dict(consumed)

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        self.sampler.load_state_dict(state)

    def quarantine(self, keys: Sequence[Any]) -> None:
        """Skip these files (keys ``(path, 0, size)`` as `explain` names them)."""
        self.sampler.quarantine(keys)

    @property
    def quarantined(self) -> list[dict[str, Any]]:
        return self.sampler.quarantined

    @property
    def shard(self) -> Shard:
        return self.sampler.shard

    def permutation(self, epoch: int | None = None) -> Any:
        return self.sampler.permutation(epoch)

    def _keep(self, items: IntArray) -> npt.NDArray[np.bool_] | None:
        return self.sampler._keep(items)

    def _item_of_key(self, key: dict[str, Any]) -> int:
        return self.sampler._item_of_key(key)

    def _locate(self, items: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """(file, byte offset, byte length) of files *items*: whole files."""
        return items, np.zeros_like(items), self.sizes[items]

    def _decode(self, buf: npt.NDArray[np.uint8], lengths: IntArray) -> list[Any]:
        out: list[Any] = []
        pos = 0
        for n in lengths.tolist():
            data = buf[pos : pos + n].tobytes()
            out.append(self.transform(data) if self.transform is not None else data)
            pos += n
        return out

    def explain(
        self, position: int, count: int = 1, epoch: int | None = None
    ) -> list[tuple[str, int, int]]:
        """(path, 0, size) of this rank's samples at positions
        ``[position, position + count)`` of *epoch*."""
        return [
            (s.path, s.byte_offset, s.byte_length)
            for s in self._explain_rank(self.sampler.rank, position, count, epoch)
        ]

    def _explain_rank(
        self, rank: int, position: int, count: int, epoch: int | None
    ) -> list[ExplainedSample]:
        local, items = self.sampler.rank_slice(rank, position, count, epoch)
        return [
            ExplainedSample(rank, p, i, self.files[i], 0, int(self.sizes[i]))
            for p, i in zip(local.tolist(), items.tolist(), strict=True)
        ]

    def explain_step(
        self, step: int, batch_size: int | None = None, epoch: int | None = None
    ) -> list[ExplainedSample]:
        return samples_of_step(
            self._explain_rank,
            self.sampler.world_size,
            step,
            self.batch_size if batch_size is None else batch_size,
            epoch,
        )

    # ---- iterating with readahead ----------------------------------------

    @property
    def reader(self) -> RangeReader:
        if self._reader is None:
            self._reader = make_reader(
                self.files,
                self.config,
                max(1, self.readahead),
                hints=self.sampler.hints,
                find_hints=False,
                layouts=self._layouts,
            )
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def _units(
        self, worker: int | None, num_workers: int | None
    ) -> Iterator[tuple[int, list[Any]]]:
        if worker is None or num_workers is None:
            worker, num_workers = worker_identity()
        s = self.sampler
        cursor = s._begin()

        def plans() -> Iterator[ReadPlan[tuple[IntArray, IntArray, IntArray]]]:
            for local, kept, items in s._blocks(
                cursor, worker, num_workers, self.readahead, self.read_size
            ):
                files, offsets, lengths = self._locate(items)
                yield ReadPlan((local, kept, lengths), files, offsets, lengths)

        for (local, kept, lengths), buf in pipeline(self.reader, plans(), self.readahead):
            samples = self._decode(buf, lengths)
            yield from split_units(local, kept, samples, cursor.start, s.batch_size or 0)
        s._finish(cursor)

    def _batches(self, worker: int | None, num_workers: int | None) -> Iterator[list[Any]]:
        """This worker's batches (with a batch size; else blocks of samples)."""
        for _, batch in self._units(worker, num_workers):
            yield batch

    def iter_batches(
        self, *, worker: int | None = None, num_workers: int | None = None
    ) -> Iterator[list[Any]]:
        """This rank's batches (lists of samples) from the current position."""
        if self.batch_size is None:
            raise ValueError("iter_batches needs the dataset's batch_size")
        for positions, batch in self._units(worker, num_workers):
            self.sampler._consumed += positions
            yield batch

    def __iter__(self) -> Iterator[Any]:
        """This rank's samples in the shuffled order, read ahead."""
        for positions, batch in self._units(None, None):
            for sample in batch:
                self.sampler._consumed += 1
                yield sample
            self.sampler._consumed += positions - len(batch)

    def __repr__(self) -> str:
        s = self.sampler
        return (
            f"{type(self).__name__}({len(self.files)} files, rank {s.rank}/{s.world_size}, "
            f"seed {s.seed}, epoch {s.epoch})"
        )
