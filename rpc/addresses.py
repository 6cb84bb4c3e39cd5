"""Addresses as configs and command lines spell them, parsed without the
network stack (the CLI checks a config before it imports trio)."""

from __future__ import annotations

import errno
import socket

from shufflefs.rpc.errors import FsError


def parse_address(address: str, *, listen: bool = False) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); EINVAL if malformed. Port 0
    (any free port) is only valid for an address to listen on."""
    host, sep, port = address.rpartition(":")
    lowest = 0 if listen else 1
    if not sep or not host or not port.isdigit() or not lowest <= int(port) < 65536:
        raise FsError(errno.EINVAL, f"bad address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """(host, port) -> 'host:port', an IPv6 host in brackets: what
    `parse_address` reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def mgmtd_addresses(value: str) -> list[str]:
    """The ``mgmtd`` setting of a config: one address, or several mgmtd
    instances (HA) separated by commas. EINVAL if any is malformed."""
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    if not addresses:
        raise FsError(errno.EINVAL, "no mgmtd address given")
    for a in addresses:
        parse_address(a)
    return addresses


def hostname() -> str:
    """The name this host is known by in the cluster unless a config says."""
    return socket.gethostname()


def address_toward(address: str) -> str | None:
    """This host's own address on its route to *address* (host:port), as the
    kernel picks it; None if there is no route. A UDP "connect" only picks
    the route: nothing is sent."""
    host, port = parse_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, where in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(where)
                local: str = probe.getsockname()[0]
                return local
        except OSError:
            continue
    return None
