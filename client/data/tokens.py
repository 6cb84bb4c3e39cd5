"""Shuffled windows of tokens: the core of `TokenWindowDataset`, without torch.

Sample ``j`` of rank ``r`` in epoch ``e`` is window
``perm_e(j * world_size + r)`` of the `WindowIndex`, where ``perm_e`` is the
keyed bijection of (seed, e): nothing is materialized, any position is
reachable at once, and the reads of every future batch are known, so they
are issued ahead (`readahead`). See `sharding` for ranks, workers and resume.

    ds = TokenWindows(["shufflefs://10.0.0.5:8000/owt/train.bin"], seq_len=1024,
                      dtype="uint16", seed=0, rank=rank, world_size=world, batch_size=32)
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in ds.iter_batches():   # (32, 1025) arrays
            ...
        # or: for sample in ds: ...       # (1025,) arrays

Overlapping windows: ``stride=s`` starts a window every ``s`` tokens, so
``n`` tokens give about ``n / s`` samples without copying anything (a
pre-shuffled copy of them would cost ``seq_len / s`` times the data).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shufflefs.client.data.readahead import ReadPlan, pipeline
from shufflefs.client.data.readers import RangeReader, make_reader
from shufflefs.client.data.sharding import Shard, fingerprint, worker_identity
from shufflefs.client.data.sources import WindowIndex, token_files
from shufflefs.client.data.state import Batched, Cursor, EpochState, file_index

IntArray = npt.NDArray[np.int64]

# with readahead (or without a batch size) a read covers at least this many samples
READ_SIZE = 256

PathArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def as_path_list(paths: PathArg) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


@dataclass(frozen=True)
class ExplainedSample:
    """One sample of a step, named precisely enough to replay it."""

    rank: int
    position: int  # in the rank's order for the epoch
    item: int  # window (or file) number in the dataset
    path: str
    byte_offset: int
    byte_length: int


def split_units(
    local: IntArray, kept: IntArray, rows: Any, start: int, unit: int
) -> Iterator[tuple[int, Any]]:
    """(positions, rows) per unit of *unit* positions of a read (its
    positions *local*, of which *kept* were read into *rows*); a unit whose
    samples are all quarantined is an empty batch, so batches stay aligned
    with positions. ``unit=0``: the whole read as one piece."""
    if unit == 0 or local.size == 0:
        yield int(local.size), rows
        return
    ids = (local - start) // unit
    kept_ids = (kept - start) // unit
    for u in np.unique(ids).tolist():
        lo, hi = np.searchsorted(kept_ids, [u, u + 1]).tolist()
        yield int(np.count_nonzero(ids == u)), rows[lo:hi]


def samples_of_step(
    explain_rank: Callable[[int, int, int, int | None], list[ExplainedSample]],
    world_size: int,
    step: int,
    batch_size: int | None,
    epoch: int | None,
) -> list[ExplainedSample]:
    """Every rank's batch *step* (ranks in order), from a dataset's
    ``_explain_rank(rank, position, count, epoch)``."""
    if batch_size is None:
        raise ValueError("explain_step needs a batch size")
    out: list[ExplainedSample] = []
    for rank in range(world_size):
        out.extend(explain_rank(rank, step * batch_size, batch_size, epoch))
    return out


class TokenWindows(Batched, EpochState):
    """Shuffled, sharded, resumable windows of ``seq_len + 1`` tokens.

    *paths*: local paths on any filesystem, or ``shufflefs://host:port/path``
    URLs (the native client; *config* names the client config). *stride*:
    ``None`` for non-overlapping windows (stride = seq_len), or any step down
    to 1. *batch_size*: the DataLoader's batch size, if known; it makes
    workers produce whole batches in the single-process order, which is what
    makes resume exact with workers. *readahead*: reads kept in flight ahead
    of the consumer (0: plain reads, each batch when it is asked for); a read
    is one batch, or several consecutive batches of this worker adding up to
    at least *read_size* samples, so memory stays within
    ``(readahead + 1) * max(batch_size, read_size)`` samples. *out_dtype*:
    convert samples (e.g. ``"int64"`` for embedding lookups); default: the
    files' dtype.
    """

    kind = "token_windows"

    def __init__(
        self,
        paths: PathArg,
        seq_len: int = 1024,
        dtype: str | np.dtype[Any] | None = None,
        stride: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        *,
        batch_size: int | None = None,
        readahead: int = 4,
        read_size: int = READ_SIZE,
        drop_last: bool = False,
        config: str | os.PathLike[str] | None = None,
        out_dtype: str | np.dtype[Any] | None = None,
    ) -> None:
        self.paths = as_path_list(paths)
        self.config = os.fspath(config) if config is not None else None
        files = token_files(self.paths, dtype, self.config)
        self.index = WindowIndex(files, seq_len, seq_len if stride is None else stride)
        super().__init__(
            Shard(self.index.num_windows, rank, world_size, drop_last), seed, batch_size
        )
        if readahead < 0 or read_size < 1:
            raise ValueError("readahead must be >= 0 and read_size >= 1")
        self.readahead = readahead
        self.read_size = read_size
        self.out_dtype = np.dtype(out_dtype) if out_dtype is not None else None
        self._reader: RangeReader | None = None

    # ---- geometry --------------------------------------------------------

    @property
    def seq_len(self) -> int:
        return self.index.seq_len

    @property
    def stride(self) -> int:
        return self.index.stride

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.index.dtype

    @property
    def num_windows(self) -> int:
        """Windows in the whole dataset (all ranks)."""
        return self.index.num_windows

    def _identity(self) -> dict[str, Any]:
        return {
            "num_items": self.index.num_windows,
            "fingerprint": fingerprint(
                {
                    "files": [
                        [os.path.basename(f.path), f.num_tokens, f.data_offset]
                        for f in self.index.files
                    ],
                    "seq_len": self.seq_len,
                    "stride": self.stride,
                    "dtype": self.index.dtype.str,
                }
            ),
        }

    # ---- the order -------------------------------------------------------

    def windows(self, positions: npt.ArrayLike, epoch: int | None = None) -> IntArray:
        """Window numbers at this rank's *positions* of *epoch*."""
        return self.ordered(positions, epoch)

    def explain(
        self, position: int, count: int = 1, epoch: int | None = None
    ) -> list[tuple[str, int, int]]:
        """(path, byte offset, byte length) of this rank's samples at positions
        ``[position, position + count)`` of *epoch* (default: the current one),
        cut at the epoch's end. Step ``k`` with batch size ``B`` is
        ``explain(k * B, B)``."""
        return [
            (s.path, s.byte_offset, s.byte_length)
            for s in self._explain_rank(self.rank, position, count, epoch)
        ]

    def _explain_rank(
        self, rank: int, position: int, count: int, epoch: int | None
    ) -> list[ExplainedSample]:
        local, windows = self.rank_slice(rank, position, count, epoch)
        files, offsets = self.index.locate(windows)
        n = self.index.window_bytes
        return [
            ExplainedSample(rank, int(p), int(w), self.index.paths[f], int(o), n)
            for p, w, f, o in zip(
                local.tolist(), windows.tolist(), files.tolist(), offsets.tolist(), strict=True
            )
        ]

    def explain_step(
        self, step: int, batch_size: int | None = None, epoch: int | None = None
    ) -> list[ExplainedSample]:
        """Every sample of global step *step*: each rank's batch *step*, ranks in
        order (per-rank batch size *batch_size*, default the dataset's)."""
        return samples_of_step(
            self._explain_rank,
            self.world_size,
            step,
            self.batch_size if batch_size is None else batch_size,
            epoch,
        )

    # ---- quarantine and locating samples (also for `Mixture`) -------------

    def _item_of_key(self, key: dict[str, Any]) -> int:
        f = file_index(self.index.paths, key["path"])
        step = self.stride * self.index.itemsize
        rel = key["offset"] - int(self.index.data_offsets[f])
        if (
            key["length"] != self.index.window_bytes
            or rel < 0
            or rel % step
            or rel // step >= int(self.index.counts[f])
        ):
            raise ValueError(f"{key} is not a window of this dataset")
        return int(self.index.first[f]) + rel // step

    def _locate(self, items: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """(file, byte offset, byte length) of windows *items*."""
        files, offsets = self.index.locate(items)
        return files, offsets, np.full(items.size, self.index.window_bytes, dtype=np.int64)

    def _decode(self, buf: npt.NDArray[np.uint8], lengths: IntArray) -> npt.NDArray[Any]:
        """Read bytes of whole windows as a (rows, seq_len + 1) array."""
        batch = buf.view(self.index.dtype).reshape(-1, self.index.window)
        if not batch.dtype.isnative:
            batch = batch.astype(batch.dtype.newbyteorder("="))
        if self.out_dtype is not None and batch.dtype != self.out_dtype:
            batch = batch.astype(self.out_dtype)
        return batch

    # ---- reading ---------------------------------------------------------

    @property
    def reader(self) -> RangeReader:
        if self._reader is None:
            self._reader = make_reader(self.index.paths, self.config, max(1, self.readahead))
        return self._reader

    def close(self) -> None:
        """Release open files and reader threads (reopened on next use)."""
        if self._reader is not None:
            self._reader.close()

    def _plans(
        self, cursor: Cursor, worker: int, num_workers: int
    ) -> Iterator[ReadPlan[tuple[IntArray, IntArray]]]:
        for local, kept, windows in self._blocks(
            cursor, worker, num_workers, self.readahead, self.read_size
        ):
            yield ReadPlan((local, kept), *self._locate(windows))

    def _units(
        self, worker: int | None, num_workers: int | None
    ) -> Iterator[tuple[int, npt.NDArray[Any]]]:
        """This worker's batches (with a batch size; else blocks of samples),
        each with the number of positions it covers (more than its rows when
        samples of it are quarantined)."""
        if worker is None or num_workers is None:
            worker, num_workers = worker_identity()
        cursor = self._begin()
        unit = self.batch_size or 0
        plans = self._plans(cursor, worker, num_workers)
        for (local, kept), buf in pipeline(self.reader, plans, self.readahead):
            batch = self._decode(buf, np.zeros(0, dtype=np.int64))
            yield from split_units(local, kept, batch, cursor.start, unit)
        self._finish(cursor)

    def _batches(self, worker: int | None, num_workers: int | None) -> Iterator[npt.NDArray[Any]]:
        """This worker's batches (with a batch size; else blocks of samples)."""
        for _, batch in self._units(worker, num_workers):
            yield batch

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.index.files)} files, {self.num_windows} windows of "
            f"{self.seq_len}+1 {self.dtype}, stride {self.stride}, rank {self.rank}/"
            f"{self.world_size}, seed {self.seed}, epoch {self.epoch})"
        )
