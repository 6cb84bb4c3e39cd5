"""Client library: routing, metadata and storage clients, the file API.

`Client` (blocking, for ordinary code) is the entry point; `FileSystem` is
the async core that the FUSE mount shares.
"""

from shufflefs.client.native import Client, File

__all__ = ["Client", "File"]
