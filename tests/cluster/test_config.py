"""mgmtd's config is checked when it loads; every command finds the client
config the same way; the three-host example configs of the docs load."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from shufflefs.cluster.config import (
    CONFIG_ENV,
    DEFAULT_CLIENT_CONFIG,
    ClientConfig,
    MgmtdConfig,
    find_client_config,
)
from shufflefs.metadata.config import MetaConfig
from shufflefs.rpc.config import load_config
from shufflefs.rpc.errors import FsError
from shufflefs.storage.config import StorageConfig

GOOD = 'listen = "127.0.0.1:0"\ndata_dir = "d"\nsecret_file = "s"\n'


@pytest.mark.parametrize(
    "extra,key",
    [
        ('advertise = "no-port"\n', "advertise"),
        ("chunk_size = 5000\n", "chunk_size"),
        ("heartbeat_interval = 20.0\n", "heartbeat_interval"),
        ("replace_offline_after = nan\n", "replace_offline_after"),
        ('replace_offline_after = "10m"\n', "replace_offline_after"),
        ("replace_max_offline = 0\n", "replace_max_offline"),
        ("replace_parallel = 0\n", "replace_parallel"),
    ],
)
def test_mgmtd_config_mistakes_name_the_file_and_key(tmp_path: Path, extra: str, key: str) -> None:
    path = tmp_path / "mgmtd.toml"
    path.write_text(GOOD + extra)
    with pytest.raises(FsError) as info:
        load_config(path, MgmtdConfig)
    assert info.value.errno == errno.EINVAL
    assert str(path) in info.value.message and key in info.value.message


def test_bad_listen_address_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "mgmtd.toml"
    path.write_text(GOOD.replace("127.0.0.1:0", "127.0.0.1:port"))
    with pytest.raises(FsError) as info:
        load_config(path, MgmtdConfig)
    assert info.value.errno == errno.EINVAL and "listen" in info.value.message


def test_client_config_lookup_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert find_client_config(None) == DEFAULT_CLIENT_CONFIG
    monkeypatch.setenv(CONFIG_ENV, "/env/client.toml")
    assert find_client_config(None) == Path("/env/client.toml")
    assert find_client_config("/flag/client.toml") == Path("/flag/client.toml")


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples" / "three-hosts"


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("mgmtd.toml", MgmtdConfig),
        ("meta.toml", MetaConfig),
        ("storage-1.toml", StorageConfig),
        ("client.toml", ClientConfig),
    ],
)
def test_the_three_host_examples_load(name: str, cls: type) -> None:
    """The configs docs/operations.md deploys are ones the services accept."""
    config = load_config(EXAMPLES / name, cls)
    assert "10.0.0." in str(vars(config))
