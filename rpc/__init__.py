"""Wire protocol: framing, msgpack codec, multiplexed connections, auth, errors, limits.

Names are imported on first use: `shufflefs.rpc.errors` alone (what every
CLI call's error handling needs) does not import trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shufflefs.rpc.addresses import parse_address
    from shufflefs.rpc.client import RpcClient, open_rpc_client
    from shufflefs.rpc.errors import FsError, err
    from shufflefs.rpc.framing import Limits
    from shufflefs.rpc.schema import CallContext, Reply, rpc_method
    from shufflefs.rpc.server import RpcServer

_WHERE = {
    "RpcClient": "shufflefs.rpc.client",
    "open_rpc_client": "shufflefs.rpc.client",
    "parse_address": "shufflefs.rpc.addresses",
    "FsError": "shufflefs.rpc.errors",
    "err": "shufflefs.rpc.errors",
    "Limits": "shufflefs.rpc.framing",
    "CallContext": "shufflefs.rpc.schema",
    "Reply": "shufflefs.rpc.schema",
    "rpc_method": "shufflefs.rpc.schema",
    "RpcServer": "shufflefs.rpc.server",
}

__all__ = [
    "CallContext",
    "FsError",
    "Limits",
    "Reply",
    "RpcClient",
    "RpcServer",
    "err",
    "open_rpc_client",
    "parse_address",
    "rpc_method",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
