"""Training-data reads: shuffled, resumable samplers with readahead.

    from shufflefs.client.data import TokenWindowDataset, FileDataset, Mixture

See docs/training-data.md. Names are imported on first use, so that
``import shufflefs.client.data.tokens`` (the CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shufflefs.client.data.datasets import FileDataset, Mixture, TokenWindowDataset
    from shufflefs.client.data.files import FileSamples, ShuffleSampler
    from shufflefs.client.data.interleave import Schedule
    from shufflefs.client.data.mixture import MixtureSamples
    from shufflefs.client.data.permutation import KeyedPermutation
    from shufflefs.client.data.sample_files import pil_loader, read_sample
    from shufflefs.client.data.state import combine_states
    from shufflefs.client.data.tokens import TokenWindows
    from shufflefs.client.data.torch import ShuffleLoader

_WHERE = {
    "TokenWindowDataset": "shufflefs.client.data.datasets",
    "FileDataset": "shufflefs.client.data.datasets",
    "TokenWindows": "shufflefs.client.data.tokens",
    "FileSamples": "shufflefs.client.data.files",
    "ShuffleSampler": "shufflefs.client.data.files",
    "KeyedPermutation": "shufflefs.client.data.permutation",
    "Mixture": "shufflefs.client.data.datasets",
    "MixtureSamples": "shufflefs.client.data.mixture",
    "Schedule": "shufflefs.client.data.interleave",
    "combine_states": "shufflefs.client.data.state",
    "ShuffleLoader": "shufflefs.client.data.torch",
    "read_sample": "shufflefs.client.data.sample_files",
    "pil_loader": "shufflefs.client.data.sample_files",
}

__all__ = [
    "FileDataset",
    "FileSamples",
    "KeyedPermutation",
    "Mixture",
    "MixtureSamples",
    "Schedule",
    "ShuffleLoader",
    "ShuffleSampler",
    "TokenWindowDataset",
    "TokenWindows",
    "combine_states",
    "pil_loader",
    "read_sample",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
