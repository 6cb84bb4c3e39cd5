"""A DataLoader that counts: exact ``state_dict`` with any number of workers.

DataLoader workers run on copies of the dataset, and the loader prefetches,
so neither the dataset nor its sampler in the main process knows how many
samples the trainer has actually taken. `ShuffleLoader` does: it wraps a
real ``torch.utils.data.DataLoader`` over the dataset's own batches (units
of ``batch_size`` positions, which align worker batches with the
single-process order and stay aligned when samples are quarantined), counts
the batches as the trainer takes them, and saves the global position.
Restoring it, on any number of ranks, continues with exactly the samples
the uninterrupted run would have produced.

Requires torch (the rest of the package does not).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from shufflefs.client.data.datasets import FileDataset
from shufflefs.client.data.files import ShuffleSampler
from shufflefs.client.data.state import EpochState


class BatchStream(IterableDataset[Any]):
    """A dataset's own batches (``iter_batches``) as an iterable dataset: a
    batch is a unit of positions, one shorter per quarantined sample, so
    counting batches counts positions."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset.iter_batches())


class BatchSampler:
    """A `ShuffleSampler`'s batches as a DataLoader ``batch_sampler``."""

    def __init__(self, sampler: ShuffleSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.batches()

    def __len__(self) -> int:
        batch = self.sampler.batch_size or 1
        return -(-len(self.sampler) // batch)


class ShuffleLoader:
    """A DataLoader over the dataset's own batches, plus `state_dict` /
    `load_state_dict` / `set_epoch`. For a `FileDataset` the dataset's sampler
    makes the batches. ``persistent_workers=True`` works: workers take the
    epoch and position from the main process at every iteration."""

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        batch_size = dataset.batch_size
        if batch_size is None:
            raise ValueError("give the dataset a batch_size (the loader uses the same one)")
        if "batch_size" in kwargs and kwargs["batch_size"] != batch_size:
            raise ValueError("the loader's batch_size must be the dataset's")
        kwargs.pop("batch_size", None)
        self.dataset = dataset
        self.batch_size = batch_size
        self.order: EpochState
        self.loader: DataLoader[Any]
        if isinstance(dataset, FileDataset):
            self.order = dataset.sampler
            self.loader = DataLoader(dataset, batch_sampler=BatchSampler(dataset.sampler), **kwargs)
        else:
            self.order = dataset
            self.loader = DataLoader(BatchStream(dataset), batch_size=None, **kwargs)
        self._epoch = -1  # the epoch _position counts in (-1: not iterated since a load)
        self._position = 0

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        order = self.order
        workers_iterate = self.loader.num_workers > 0 and order is self.dataset
        resume = order._peek()[2]
        if not workers_iterate:
            order._adopt(mark_used=False)  # the iteration itself begins in this process
        it = iter(self.loader)
        if workers_iterate:
            # the workers took the position; mark it used as they do, so the next
            # iteration of this epoch starts over, as a plain one does
            order._adopt(mark_used=True)
        self._epoch = order.epoch
        self._position = resume
        for batch in it:
            self._position = min(self._position + self.batch_size, order.shard.most)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        order = self.order
        if self._epoch == order.epoch:
            return order.state_dict(consumed=self._position)
        return order.state_dict(consumed=0)  # not iterated in this epoch yet

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.order.load_state_dict(state)
        self._epoch = -1
