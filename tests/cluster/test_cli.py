"""The `shufflefs` command: user mistakes get one line and a non-zero exit;
an unreachable service (refused, timeout, wrong secret, other protocol) its
own exit code; `up` notices a service that fails, gives up at its deadline,
and takes back what it started."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import trio
from cliworld import (
    RUN_TIMEOUT,
    Result,
    assert_unreachable,
    client_config,
    edit_toml,
    free_port,
    processes_naming,
    run_cli,
    shufflefs_ok,
)
from clusters import wait_until
from harness import interruptible, shufflefs

from shufflefs.cluster import cli_errors
from shufflefs.cluster.cli_errors import run_reporting
from shufflefs.cluster.launcher import LocalCluster
from shufflefs.cluster.lifecycle import up
from shufflefs.cluster.startup import wait_writable
from shufflefs.rpc import framing
from shufflefs.rpc.server import RpcServer


@pytest.mark.parametrize(
    "args,needle",
    [
        (["status", "--config", "/nonexistent/client.toml"], "not found"),
        (["down", "--data-dir", "/nonexistent-dir"], "no shufflefs cluster"),
        (["mgmtd", "--config", "/nonexistent/mgmtd.toml"], "not found"),
        (["meta", "--config", "/nonexistent/meta.toml"], "not found"),
        (["storage", "--config", "/nonexistent/storage.toml"], "not found"),
        (["mount", "--config", "/nonexistent/client.toml", "/tmp"], "not found"),
        (["umount", "/"], "not a shufflefs mount"),
        (["format", "--data-dir", "{tmp}/x", "--chunk-size", "lots"], "bad size"),
        (["format", "--data-dir", "{tmp}/x", "--storage-nodes", "0"], "at least 1"),
    ],
)
def test_user_mistakes_get_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    result = shufflefs(*[a.replace("{tmp}", str(tmp_path)) for a in args], check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_bad_config_file_names_the_key(tmp_path: Path) -> None:
    shufflefs("format", "--data-dir", str(tmp_path / "c"), "--storage-nodes", "1")
    config = tmp_path / "c" / "mgmtd" / "mgmtd.toml"
    config.write_text(config.read_text() + "\nheartbeat_timout = 3\n")
    result = shufflefs("mgmtd", "--config", str(config), check=False)
    assert result.returncode != 0 and "heartbeat_timout" in result.stderr
    assert "Traceback" not in result.stderr


def test_insecure_secret_refused(tmp_path: Path) -> None:
    shufflefs("format", "--data-dir", str(tmp_path / "c"), "--storage-nodes", "1")
    os.chmod(tmp_path / "c" / "secret", 0o644)
    result = shufflefs("status", "--config", str(tmp_path / "c" / "client.toml"), check=False)
    assert result.returncode != 0 and "chmod 600" in result.stderr


def test_format_writes_configs_and_a_private_secret(tmp_path: Path) -> None:
    out = shufflefs("format", "--data-dir", str(tmp_path / "c"), "--storage-nodes", "2")
    assert "formatted" in out.stdout
    assert (tmp_path / "c" / "secret").stat().st_mode & 0o777 == 0o600
    for f in (
        "client.toml",
        "cluster.toml",
        "mgmtd/mgmtd.toml",
        "meta/meta.toml",
        "storage1/storage.toml",
        "storage2/storage.toml",
    ):
        assert (tmp_path / "c" / f).exists(), f
    again = shufflefs("format", "--data-dir", str(tmp_path / "c"), check=False)
    assert again.returncode != 0 and "already holds a cluster" in again.stderr


@pytest.mark.e2e  # starts the services as processes
def test_status_json_shape(tmp_path: Path) -> None:
    data = tmp_path / "c"
    shufflefs("up", "--data-dir", str(data), "--no-mount", "--storage-nodes", "2")
    try:
        status = json.loads(
            shufflefs("status", "--json", "--config", str(data / "client.toml")).stdout
        )
        kinds = sorted(n["kind"] for n in status["nodes"])
        assert kinds == ["meta", "mgmtd", "storage", "storage"]
        for n in status["nodes"]:
            assert set(n) >= {"id", "kind", "address", "host", "pid", "state"}
            assert n["state"] == "online"
        assert len(status["targets"]) == 2 and len(status["chains"]) == 2
        assert status["capacity"]["capacity"] > 0
        text = shufflefs("status", "--config", str(data / "client.toml")).stdout
        assert "NODES" in text and "CHAINS" in text
    finally:
        shufflefs("down", "--data-dir", str(data))


# ---- failures with their own exit code (see `shufflefs --help`) -----------------------


def test_a_service_that_never_answers_is_a_timeout(tmp_path: Path) -> None:
    with socket.socket() as listener:  # accepted by the kernel, never by anyone
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        config = client_config(tmp_path, address, b"0123456789abcdef" * 4)
        r = run_cli(["status", "--config", str(config)], tmp_path)
    assert_unreachable(r, cli_errors.EXIT_TIMEOUT, address)
    assert r.seconds < 10


async def serve_in_background(secret: bytes, nursery: trio.Nursery) -> str:
    server = RpcServer(secret, [], name="mgmtd")
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"127.0.0.1:{port}"


async def run_cli_async(argv: list[str], cwd: Path) -> Result:
    return await trio.to_thread.run_sync(run_cli, argv, cwd)


async def test_wrong_secret_is_an_auth_failure(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        address = await serve_in_background(b"the-cluster-secret-0123456789abcdef", nursery)
        config = client_config(tmp_path, address, b"another-secret-0123456789abcdef")
        r = await run_cli_async(["status", "--config", str(config)], tmp_path)
        nursery.cancel_scope.cancel()
    assert_unreachable(r, cli_errors.EXIT_AUTH, address)


async def test_other_protocol_version_is_a_version_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = b"the-cluster-secret-0123456789abcdef"
    monkeypatch.setattr(framing, "VERSION", framing.VERSION + 1)  # this process's server only
    async with trio.open_nursery() as nursery:
        address = await serve_in_background(secret, nursery)
        config = client_config(tmp_path, address, secret)
        r = await run_cli_async(["status", "--config", str(config)], tmp_path)
        nursery.cancel_scope.cancel()
    assert_unreachable(r, cli_errors.EXIT_VERSION, address)
    assert "protocol" in r.stderr


def test_internal_error_is_one_line_and_logged(tmp_path: Path) -> None:
    """A bug (here: a config class whose check itself crashes) is one line
    naming the log that holds its traceback."""

    def crash() -> int:
        raise KeyError("boom")

    data = tmp_path / "c"
    shufflefs_ok("format", "--data-dir", str(data), "--storage-nodes", "1", cwd=tmp_path)
    args = argparse.Namespace(data_dir=str(data))
    assert run_reporting("shufflefs test", args, crash) == cli_errors.EXIT_INTERNAL
    log = (data / "logs" / "cli.log").read_text()
    assert "Traceback" in log and "KeyError" in log


@pytest.mark.e2e
def test_up_with_a_service_that_fails_stops_everything(tmp_path: Path) -> None:
    """meta cannot bind its port: `up` notices at once, names meta and its
    error, stops what it started, and leaves no process behind."""
    data = tmp_path / "c"
    shufflefs_ok("format", "--data-dir", str(data), "--storage-nodes", "1", cwd=tmp_path)
    meta_port = tomllib.loads((data / "cluster.toml").read_text())["meta_port"]
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", meta_port))
        squatter.listen(1)
        r = run_cli(["up", "--data-dir", str(data), "--no-mount"], tmp_path, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == cli_errors.EXIT_START_FAILED and len(lines) == 1, r.stderr
    assert lines[0].startswith("shufflefs up: meta ") and "in use" in lines[0], r.stderr
    assert str(data / "logs" / "meta.out") in lines[0]
    assert processes_naming(str(data)) == []
    assert "stopped mgmtd" in r.stdout


@pytest.mark.e2e
def test_up_adds_storage_nodes_to_an_existing_cluster(tmp_path: Path) -> None:
    data = tmp_path / "c"
    shufflefs_ok("up", "--data-dir", str(data), "--no-mount", "--storage-nodes", "1", cwd=tmp_path)
    try:
        r = shufflefs_ok(
            "up", "--data-dir", str(data), "--no-mount", "--storage-nodes", "2", cwd=tmp_path
        )
        assert "added storage2" in r.stdout
        status = run_cli(["status", "--json", "--config", str(data / "client.toml")], tmp_path)
        assert status.stdout.count('"kind": "storage"') == 2
    finally:
        run_cli(["down", "--data-dir", str(data)], tmp_path, timeout=120)
    assert processes_naming(str(data)) == []


@pytest.mark.e2e
def test_up_waits_for_a_writable_chain_and_says_when_there_is_none(tmp_path: Path) -> None:
    """A restarted storage target resyncs before it serves again, and while
    no chain has `min_replicas` serving replicas the metadata server refuses
    new files (EROFS). `up` waits for a writable chain after the services
    are up; if none is by its deadline it says so and stops nothing. Here
    two of three storage daemons are stopped and the third frozen, so the
    two restarted ones cannot resync until it is thawed."""
    data, mnt = tmp_path / "c", tmp_path / "mnt"
    shufflefs_ok("up", "--data-dir", str(data), "--mountpoint", str(mnt), cwd=tmp_path)
    cluster = LocalCluster(data)
    frozen = int((data / "run" / "storage1.pid").read_text())
    try:
        for i in range(20):
            (mnt / f"f{i}").write_bytes(b"x" * 100_000)
        for name in ("storage2", "storage3"):
            os.kill(int((data / "run" / f"{name}.pid").read_text()), signal.SIGTERM)
        wait_until(
            "the chain to lose its write quorum",
            lambda: trio.run(wait_writable, cluster, {}, 0.0) is not None,
            timeout=60,
        )
        os.kill(frozen, signal.SIGSTOP)
        out = io.StringIO()
        up(data, None, out=out, timeout=3.0)
        said = out.getvalue()
        assert "warning: still waiting for a storage chain with 2 serving replicas" in said, said
        assert "stopped" not in said
        os.kill(frozen, signal.SIGCONT)
        assert trio.run(wait_writable, cluster, {}, 60.0) is None
        (mnt / "after-restart").write_bytes(b"y" * 100_000)
        assert (mnt / "after-restart").read_bytes() == b"y" * 100_000
        assert (mnt / "f7").read_bytes() == b"x" * 100_000
    finally:
        os.kill(frozen, signal.SIGCONT)
        run_cli(["down", "--data-dir", str(data)], tmp_path, timeout=120)
    assert processes_naming(str(data)) == []


@pytest.mark.e2e
def test_down_unmounts_the_clusters_other_mounts(tmp_path: Path) -> None:
    """`shufflefs down` also ends the `shufflefs mount`s of its cluster made
    apart from `up`'s (else they answer ENOTCONN once the servers are gone)."""
    data, mnt, other = tmp_path / "c", tmp_path / "mnt", tmp_path / "other"
    other.mkdir()
    shufflefs_ok("up", "--data-dir", str(data), "--mountpoint", str(mnt), cwd=tmp_path)
    try:
        config = str(data / "client.toml")
        shufflefs_ok("mount", "--config", config, "-o", "ro", str(other), cwd=tmp_path)
        (mnt / "f").write_bytes(b"x")
        assert (other / "f").read_bytes() == b"x"
        r = run_cli(["down", "--data-dir", str(data)], tmp_path, timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"unmounted {other}" in r.stdout
    finally:
        run_cli(["down", "--data-dir", str(data)], tmp_path, timeout=120)
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f]
    assert str(other) not in points and str(mnt) not in points
    assert processes_naming(str(data)) == []


def test_interrupted_command_exits_130(tmp_path: Path) -> None:
    """Ctrl-C while waiting for a service is exit 130, not a traceback."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        config = client_config(tmp_path, address, b"0123456789abcdef" * 4)
        proc = subprocess.Popen(
            [sys.executable, "-m", "shufflefs.cluster.cli", "status", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=interruptible,
        )
        listener.settimeout(RUN_TIMEOUT)
        conn, _ = listener.accept()  # the command is now waiting for the service to answer
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
        conn.close()
    assert proc.returncode == cli_errors.EXIT_INTERRUPTED and "Traceback" not in err, err


@pytest.mark.e2e
def test_up_gives_up_at_its_deadline_naming_what_it_waited_for(tmp_path: Path) -> None:
    """A storage daemon that never registers (its mgmtd address is wrong, so
    it retries forever): `up` gives up at the deadline, says it was waiting
    for storage1 to register, and stops everything it started."""
    data = tmp_path / "c"
    shufflefs_ok("format", "--data-dir", str(data), "--storage-nodes", "1", cwd=tmp_path)
    storage_toml = data / "storage1" / "storage.toml"
    edit_toml(storage_toml, storage_toml, mgmtd=f"127.0.0.1:{free_port()}")
    out = io.StringIO()
    started = time.monotonic()
    with pytest.raises(cli_errors.StartFailed) as caught:
        up(data, None, out=out, timeout=3.0)
    assert time.monotonic() - started < 20
    assert "timed out after 3s waiting for storage1" in caught.value.message
    assert "to register with mgmtd" in caught.value.message
    assert processes_naming(str(data)) == []
    assert "stopped storage1" in out.getvalue() and "stopped mgmtd" in out.getvalue()
