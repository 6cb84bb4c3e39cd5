"""Client library: routing, metadata and storage clients, the file API.

`Client` (blocking, for ordinary code) is the entry point; `FileSystem` is
the async core that the FUSE mount shares. Names are imported on first use,
so that a command that only needs a submodule (every CLI call imports
`client.data.cli`) does not pay for the whole native client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shufflefs.client.native import Client, File

__all__ = ["Client", "File"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("shufflefs.client.native"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
