"""Wire protocol: framing, msgpack codec, multiplexed connections, auth, errors, limits."""

from shufflefs.rpc.client import RpcClient, open_rpc_client, parse_address
from shufflefs.rpc.errors import FsError, err
from shufflefs.rpc.framing import Limits
from shufflefs.rpc.schema import CallContext, Reply, rpc_method
from shufflefs.rpc.server import RpcServer

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
