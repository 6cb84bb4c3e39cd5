"""A DataLoader that counts: exact ``state_dict`` with any number of workers.

DataLoader workers run on copies of the dataset, and the loader prefetches,
so neither the dataset nor its sampler in the main process knows how many
samples the trainer has actually taken. `ShuffleLoader` does: it wraps a
real ``torch.utils.data.DataLoader`` built with the dataset's own batch size
(the one that aligns worker batches with the single-process order), counts
the batches as the trainer takes them, and saves (seed, epoch, samples
consumed). Restoring it continues with exactly the batches the
uninterrupted run would have produced.

Requires torch (the rest of the package does not).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from shufflefs.client.data.datasets import FileDataset, TokenWindowDataset
from shufflefs.client.data.sharding import EpochState


class ShuffleLoader:
    """``DataLoader(dataset, batch_size=dataset.batch_size, **kwargs)``, plus
    `state_dict` / `load_state_dict` / `set_epoch`. For a `FileDataset` the
    dataset's sampler is passed as the loader's sampler."""

    def __init__(self, dataset: TokenWindowDataset | FileDataset, **kwargs: Any) -> None:
        batch_size = dataset.batch_size
        if batch_size is None:
            raise ValueError("give the dataset a batch_size (the loader uses the same one)")
        if "batch_size" in kwargs and kwargs["batch_size"] != batch_size:
            raise ValueError("the loader's batch_size must be the dataset's")
        kwargs.pop("batch_size", None)
        if kwargs.get("persistent_workers"):
            # workers would keep the first epoch's copy of the dataset
            raise ValueError("persistent_workers would not see set_epoch or a restored position")
        self.dataset = dataset
        self.batch_size = batch_size
        self.order: EpochState
        if isinstance(dataset, FileDataset):
            self.order = dataset.sampler
            self.loader = DataLoader(
                dataset, batch_size=batch_size, sampler=dataset.sampler, **kwargs
            )
        else:
            self.order = dataset
            self.loader = DataLoader(dataset, batch_size=batch_size, **kwargs)
        self._epoch = -1  # the epoch _position counts in (-1: not iterated since a load)
        self._position = 0

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        order = self.order
        start = order._resume
        self._epoch = order.epoch
        self._position = start
        it = iter(self.loader)
        if self.loader.num_workers > 0 and order is self.dataset:
            # the workers took their copy (with the resume position); the next
            # iteration of this epoch starts over, as a plain one does
            order._resume = 0
        for batch in it:
            self._position = min(self._position + self.batch_size, len(order))
            yield batch

    def state_dict(self) -> dict[str, Any]:
        order = self.order
        if self._epoch == order.epoch:
            return order.state_dict(consumed=self._position)
        return order.state_dict(consumed=order._resume)  # not iterated in this epoch yet

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state)
        self._epoch = -1
