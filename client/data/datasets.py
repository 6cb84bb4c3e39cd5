"""The datasets as PyTorch sees them (and as plain Python sees them without it).

`TokenWindowDataset` is a `torch.utils.data.IterableDataset` and
`FileDataset` a map-style `torch.utils.data.Dataset` when torch is installed;
then token samples and batches are handed out as tensors (sharing memory with
the read buffer, no copy). Without torch they are the same classes over
plain ``object`` and hand out numpy arrays. torch is optional: nothing here
needs it to be importable.

With a DataLoader (recipe, exact with any ``num_workers``):

    ds = TokenWindowDataset(paths, seq_len=1024, dtype="uint16", seed=0, rank=rank,
                            world_size=world, batch_size=32)
    loader = ShuffleLoader(ds, num_workers=4)      # a DataLoader that counts
    loader.load_state_dict(ckpt["data"])            # when resuming
    for epoch in range(start_epoch, epochs):
        ds.set_epoch(epoch)                         # keeps a restored position
        for batch in loader:                        # (32, 1025) tensors
            ...
            ckpt["data"] = loader.state_dict()      # saved with the model

or a plain ``DataLoader(ds, batch_size=32, num_workers=4)`` (the same
batch size as the dataset's) and ``ds.state_dict(consumed=steps * 32)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from shufflefs.client.data.files import FileSamples
from shufflefs.client.data.mixture import MixtureSamples
from shufflefs.client.data.tokens import TokenWindows

if TYPE_CHECKING:
    from torch.utils.data import Dataset as MapBase
    from torch.utils.data import IterableDataset as IterableBase
else:
    try:
        from torch.utils.data import Dataset as MapBase
        from torch.utils.data import IterableDataset as IterableBase
    except ImportError:  # torch is optional
        MapBase = IterableBase = object


def _to_torch(array: npt.NDArray[Any]) -> Any:
    try:
        import torch
    except ImportError:
        return array
    return torch.from_numpy(np.ascontiguousarray(array))


class TokenWindowDataset(TokenWindows, IterableBase):
    """`TokenWindows` as a torch ``IterableDataset``: samples (and
    `iter_batches` batches) are tensors when torch is installed. Inside a
    DataLoader worker it shards itself by worker id."""

    def _convert(self, array: npt.NDArray[Any]) -> Any:
        return _to_torch(array)


class FileDataset(FileSamples, MapBase):
    """`FileSamples` as a map-style torch ``Dataset``; pass
    ``sampler=ds.sampler`` (or use `ShuffleLoader`) to get the shuffle,
    sharding and resume."""


class Mixture(MixtureSamples, IterableBase):
    """`MixtureSamples` as a torch ``IterableDataset`` (tensors where its
    components give tensors); inside a DataLoader worker it shards itself by
    worker id."""
