"""A server's bootstrap, the same for every kind of node (mgmtd aside): its
identity on disk (``node.json``), the address it listens on and the address
it registers for others to reach it.

``node.json`` holds the node id and cluster id mgmtd gave the node at its
first registration (so a restarted node comes back as itself, and a data dir
formatted for another cluster is refused) and, on a storage node, the targets
added at runtime (``shufflefs target add``) beyond the config's. It is
written durably (temp file, fsync, rename, fsync of the folder).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from pathlib import Path

from shufflefs.rpc.addresses import hostname, join_address, mgmtd_addresses, parse_address
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.files import read_json, write_json_durably

NODE_FILE = "node.json"

# Listening on one of these means every interface: the address to register
# is then this machine's name (or the config's `host`).
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


@dataclass
class NodeState:
    node_id: int | None = None
    cluster_id: str | None = None
    targets: list[str] = field(default_factory=list)  # added at runtime (storage)

    @classmethod
    def load(cls, data_dir: Path) -> NodeState:
        """The state a node saved before, or a blank one on its first start."""
        path = Path(data_dir) / NODE_FILE
        if not path.exists():
            return cls()
        data = read_json(path)
        node_id, cluster_id = data.get("node_id"), data.get("cluster_id")
        targets = data.get("targets", [])
        if node_id is not None and (not isinstance(node_id, int) or isinstance(node_id, bool)):
            raise FsError(errno.EIO, f"{path}: 'node_id' is not an integer")
        if cluster_id is not None and not isinstance(cluster_id, str):
            raise FsError(errno.EIO, f"{path}: 'cluster_id' is not a string")
        if not isinstance(targets, list) or not all(isinstance(p, str) for p in targets):
            raise FsError(errno.EIO, f"{path}: 'targets' is not a list of paths")
        return cls(node_id, cluster_id, list(targets))

    def save(self, data_dir: Path, *, fsync: bool = True) -> None:
        data: dict[str, object] = {"node_id": self.node_id, "cluster_id": self.cluster_id}
        if self.targets:
            data["targets"] = list(self.targets)
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        write_json_durably(Path(data_dir) / NODE_FILE, data, fsync)


def listen_address(listen: str) -> tuple[str, int]:
    """'host:port' to bind; port 0 (any free port) and a wildcard host
    ('0.0.0.0', '[::]', or empty: every interface) are allowed."""
    if listen.startswith(":"):
        listen = "0.0.0.0" + listen
    return parse_address(listen, listen=True)


def advertised_address(
    listen_host: str, port: int, *, advertise: str | None = None, host: str | None = None
) -> str:
    """The address registered with mgmtd: *advertise* if the config sets
    one, else the bound host and port, with a wildcard host replaced by
    *host* (the config's machine name) or this machine's hostname."""
    if advertise:
        parse_address(advertise)
        return advertise
    if listen_host in WILDCARD_HOSTS:
        listen_host = host or hostname()
    return join_address(listen_host, port)


def check_addresses(
    where: str,
    *,
    listen: str,
    advertise: str | None,
    mgmtd: str | None = None,
    metrics: str | None = None,
) -> None:
    """The address settings every server config has (mgmtd itself has no
    *mgmtd*; *metrics* is the optional Prometheus endpoint), checked up front
    with the config's name in the message."""
    for key, value, parse in (
        ("listen", listen, listen_address),
        ("mgmtd", mgmtd, mgmtd_addresses),
        ("advertise", advertise, parse_address),
        ("metrics", metrics, listen_address),
    ):
        if value is None:
            continue
        try:
            parse(value)
        except FsError as exc:
            raise FsError(errno.EINVAL, f"{where}: {key}: {exc.message}") from None
