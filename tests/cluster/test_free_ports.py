"""`launcher.free_ports`: distinct ports free to listen on, taken below the
kernel's ephemeral range (a port from that range, free when `shufflefs up`
picks it, can become an outgoing connection's local port before its daemon
binds it: the daemon then fails with EADDRINUSE); ports already taken are
skipped."""

from __future__ import annotations

import socket

import pytest

from shufflefs.cluster import launcher
from shufflefs.cluster.cli_errors import UsageError


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    low = launcher._ephemeral_low()
    ports = launcher.free_ports("127.0.0.1", 12)
    assert len(set(ports)) == 12
    assert all(launcher.PORT_FLOOR <= p < low for p in ports)
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        for s in socks:
            s.close()


def test_taken_ports_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    try:
        # every candidate but the last is the taken one
        monkeypatch.setattr(launcher.random, "sample", lambda r, k: [taken] * (k - 1) + [taken + 1])
        monkeypatch.setattr(launcher, "_ephemeral_low", lambda: taken + 100)
        monkeypatch.setattr(launcher, "PORT_FLOOR", taken - 100)
        ports = launcher.free_ports("127.0.0.1", 1)
        assert ports[0] != taken
    finally:
        held.close()


def test_a_host_that_is_not_here_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="cannot listen there"):
        launcher.free_ports("192.0.2.1", 2)
