"""`up` picks its services' ports before it starts them, so another program
can take one in between. A cluster `up` has just formatted holds nothing yet:
it is formatted again on other ports. An existing cluster keeps its ports,
and `up` says which service found its port taken."""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from cliworld import processes_naming, run_cli, shufflefs_ok

from shufflefs.cluster import cli_errors, launcher
from shufflefs.cluster.lifecycle import port_taken, up

HOST = "127.0.0.1"


@pytest.fixture
def taken_port() -> Iterator[socket.socket]:
    """A port some other program listens on."""
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen(1)
        yield listener


@pytest.mark.e2e
def test_a_port_taken_after_format_picked_it_is_picked_again(
    tmp_path: Path, taken_port: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first ports format picks give storage1 a port that is taken by the
    time it starts (the race, made certain): `up` stops what it started,
    formats again on new ports, and the cluster comes up."""
    taken = taken_port.getsockname()[1]
    picks: list[list[int]] = []
    real_free_ports = launcher.free_ports

    def first_pick_taken(host: str, count: int) -> list[int]:
        ports = real_free_ports(host, count)
        if not picks:
            ports[2] = taken  # mgmtd, meta, storage1: the rpc ports come first
        picks.append(ports)
        return ports

    monkeypatch.setattr(launcher, "free_ports", first_pick_taken)
    data = tmp_path / "c"
    data.mkdir()
    (data / "kept").write_text("the user's, not format's")
    out = io.StringIO()
    try:
        cluster = up(data, None, storage_nodes=1, host=HOST, out=out, timeout=60.0)
        said = out.getvalue()
        assert "storage1 exited during start-up" in said, said
        assert "Address already in use" in said and "formatting again on other ports" in said
        assert "stopped mgmtd" in said, said  # what the first attempt started
        assert len(picks) == 2
        assert cluster.layout().storage_ports == [picks[1][2]] != [taken]
        assert (data / "kept").read_text() == "the user's, not format's"
        status = run_cli(["status", "--config", str(data / "client.toml")], tmp_path)
        assert status.returncode == 0 and "storage1" in status.stdout, status.stderr
    finally:
        run_cli(["down", "--data-dir", str(data)], tmp_path, timeout=120)
    assert processes_naming(str(data)) == []


@pytest.mark.e2e
def test_an_existing_cluster_keeps_its_ports_and_up_says_which_is_taken(
    tmp_path: Path, taken_port: socket.socket
) -> None:
    data = tmp_path / "c"
    shufflefs_ok("format", "--data-dir", str(data), "--storage-nodes", "1", cwd=tmp_path)
    cluster = launcher.LocalCluster(data)
    [port] = cluster.layout().storage_ports
    taken_port.close()  # the port format picked, taken by another program
    with socket.socket() as other:
        other.bind((HOST, port))
        other.listen(1)
        out = io.StringIO()
        with pytest.raises(cli_errors.StartFailed) as caught:
            up(data, None, out=out, timeout=60.0)
    assert "storage1 exited during start-up" in caught.value.message
    assert "Address already in use" in caught.value.message
    assert "formatting again" not in out.getvalue()
    assert cluster.layout().storage_ports == [port]
    assert processes_naming(str(data)) == []


def test_what_counts_as_a_taken_port() -> None:
    ours = "storage1 exited during start-up (exit 1): Address already in use (full log: x)"
    etcd = (  # etcd 3.x's own last line
        "etcd1 exited during start-up (exit 1): 2026-12-07 12:14:01.292525 C | etcdmain: "
        "listen tcp 127.0.0.1:34339: bind: address already in use (full log: x)"
    )
    assert port_taken(cli_errors.StartFailed(ours)) == ours
    assert port_taken(cli_errors.StartFailed(etcd)) == etcd
    assert port_taken(cli_errors.StartFailed("meta exited during start-up: disk full")) is None
    assert port_taken(cli_errors.UsageError("Address already in use")) is None  # not a start-up
