"""``shufflefs://host:port/path`` URLs and the native clients behind them.

``host:port`` is mgmtd's address. The secret is never in a URL: it comes
from the client config (``config=``, else ``$SHUFFLEFS_CONFIG``, else
``./.shufflefs/client.toml``), and the config's mgmtd must be the URL's, so a
URL cannot silently read another cluster than the one it names.
``shufflefs:///path`` (no address) means the config's cluster.

One `Client` serves every dataset and fsspec instance of a process that
uses the same config. A DataLoader worker forked from a process that holds
one inherits the object; the client notices the new pid and reconnects.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from shufflefs.client.native import Client
from shufflefs.cluster.config import find_client_config, load_client_config

SCHEME = "shufflefs"
PREFIX = f"{SCHEME}://"

_clients: dict[str, Client] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Url:
    mgmtd: str  # host:port, or "" for the config's cluster
    path: str  # absolute path inside the filesystem

    def __str__(self) -> str:
        return f"{PREFIX}{self.mgmtd}{self.path}"


def is_url(path: str | os.PathLike[str]) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse_url(url: str) -> Url:
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        raise ValueError(f"not a {SCHEME}:// URL: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: {SCHEME}:// URLs take no query or fragment")
    path = parts.path or "/"
    if not path.startswith("/"):
        path = "/" + path
    return Url(parts.netloc, path)


def _same_address(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        host_a, port_a = a.rsplit(":", 1)
        host_b, port_b = b.rsplit(":", 1)
        if port_a != port_b:
            return False
        return socket.gethostbyname(host_a.strip("[]")) == socket.gethostbyname(host_b.strip("[]"))
    except (ValueError, OSError):
        return False


def config_path(config: str | os.PathLike[str] | None = None) -> Path:
    """The client config a URL is read with (absolute, so a worker that
    changed directory finds the same one)."""
    return find_client_config(config).absolute()


def check_cluster(url: Url, config: str | os.PathLike[str] | None = None) -> Path:
    """The config to use for *url*; ValueError if it names another cluster."""
    path = config_path(config)
    if url.mgmtd:
        cfg, _ = load_client_config(path)
        if not _same_address(cfg.mgmtd, url.mgmtd):
            raise ValueError(
                f"{url} names mgmtd {url.mgmtd}, but the client config {path} is for "
                f"{cfg.mgmtd}; pass config= (or set $SHUFFLEFS_CONFIG) for that cluster"
            )
    return path


def client_for(config: str | os.PathLike[str] | None = None) -> Client:
    """This process's client for the cluster of *config* (shared, created on
    first use, its session closed at interpreter exit)."""
    key = str(config_path(config))
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = Client(key)
        return client


@atexit.register
def _close_clients() -> None:
    """Close the sessions cleanly instead of leaving them to expire (a forked
    child that ends with os._exit skips this, and its client's close is a
    no-op for an object it inherited anyway)."""
    with _lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        client.close()
