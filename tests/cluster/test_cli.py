"""The `shufflefs` command: user mistakes get one line and a non-zero exit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness import shufflefs


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
