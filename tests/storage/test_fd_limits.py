"""The fd caches' share of the open-file limit: raised where the process may
(hard limit too, as root), shrunk to what is left where it may not, so a
low limit makes the caches smaller instead of opens failing with EMFILE."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shufflefs.storage import cache as cache_module
from shufflefs.storage.cache import share_of_limit
from shufflefs.storage.config import StorageConfig

ROOT = os.geteuid() == 0


def test_the_share_is_the_configured_size_when_the_limit_allows() -> None:
    assert share_of_limit(1 << 20, 65536, 1, 0.25, 4096) == 65536
    assert share_of_limit(1 << 20, 65536, 4, 0.25, 4096) == 65536
    assert (
        StorageConfig(
            listen="a:1", mgmtd="b:2", data_dir="d", secret_file="s", targets=["t"]
        ).fd_cache
        == 65536
    )


def test_a_low_limit_shrinks_the_share_and_keeps_the_rest() -> None:
    # 20,000: a quarter (5,000) stays for sockets and the rest, 15,000 for one target
    assert share_of_limit(20000, 65536, 1, 0.25, 4096) == 15000
    assert share_of_limit(20000, 65536, 3, 0.25, 4096) == 5000
    # what is kept is at least *at_least*
    assert share_of_limit(8192, 65536, 2, 0.25, 4096) == 2048
    # of a limit below twice *at_least*, half is kept
    assert share_of_limit(3000, 65536, 2, 0.25, 4096) == 750
    # never below 16 a target, however low the limit
    assert share_of_limit(200, 65536, 64, 0.25, 4096) == 16
    # the client's short circuit: half of the limit for its caches
    assert share_of_limit(20000, 4096, 4, 0.5, 512) == 2500


def _run(code: str, prefix: list[str] | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [*(prefix or []), sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    return out.stdout.strip()


LOW_HARD_LIMIT = """
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (1000, 1200))
"""


class Limits:
    """The open-file limit as the kernel keeps it, for `raise_fd_limit`:
    a hard limit is raised only with the privilege (CAP_SYS_RESOURCE), as
    ``setrlimit`` refuses otherwise with the same error."""

    RLIMIT_NOFILE = resource.RLIMIT_NOFILE
    RLIM_INFINITY = resource.RLIM_INFINITY

    def __init__(self, soft: int, hard: int, privileged: bool) -> None:
        self.soft, self.hard, self.privileged = soft, hard, privileged

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.soft, self.hard

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        soft, hard = limits
        if soft > hard or (hard > self.hard and not self.privileged):
            raise ValueError("not allowed to raise maximum limit")
        self.soft, self.hard = soft, hard


@pytest.mark.parametrize(
    ("privileged", "nr_open", "got"),
    [(True, 1 << 20, 50000), (True, 30000, 30000), (False, 1 << 20, 1200)],
)
def test_the_hard_limit_is_raised_where_the_process_may(
    monkeypatch: pytest.MonkeyPatch, privileged: bool, nr_open: int, got: int
) -> None:
    """Privileged: soft and hard raised together, up to ``fs.nr_open``;
    not: the soft one up to the hard limit (the real refusal is exercised
    by the next test, without the capability)."""
    limits = Limits(1000, 1200, privileged)
    monkeypatch.setattr(cache_module, "resource", limits)
    monkeypatch.setattr(cache_module, "_nr_open", lambda: nr_open)
    assert cache_module.raise_fd_limit(50000) == got
    assert (limits.soft, limits.hard) == (got, got if privileged else 1200)
    assert cache_module.raise_fd_limit(500) == got  # never lowered


@pytest.mark.skipif(not ROOT or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_without_the_right_to_raise_it_the_daemon_keeps_fewer_files_open(
    tmp_path: Path,
) -> None:
    """A daemon that may not raise its hard limit (CAP_SYS_RESOURCE dropped)
    sizes its fd caches to it, and they open and evict past it without
    EMFILE: a target with twice as many chunk files as the process may open
    is written and read whole, twice."""
    drop = ["setpriv", "--inh-caps=-sys_resource", "--bounding-set=-sys_resource"]
    out = _run(
        LOW_HARD_LIMIT
        + f"""
    import logging, os
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from shufflefs.storage.config import StorageConfig
    from shufflefs.storage.daemon import fd_cache_share, open_store
    from shufflefs.storage.protocol import chunk_id
    config = StorageConfig(listen="a:1", mgmtd="b:2", data_dir="d", secret_file="s",
                           targets=["t"], fsync=False)
    share = fd_cache_share(config, 2)
    print("share", share, *resource.getrlimit(resource.RLIMIT_NOFILE))
    store = open_store(config, share, {str(tmp_path / "t")!r})
    n = 2500
    data = {{chunk_id(i, 0): os.urandom(100) for i in range(1, n + 1)}}
    for cid, b in data.items():
        store.write(cid, 0, 1 << 20, b)
    for _ in range(2):
        for cid, b in data.items():
            assert bytes(store.read(cid, 0, len(b))) == b
    print("read", n, "cached", store._fds.capacity, "open", len(os.listdir("/proc/self/fd")) < 1200)
    store.close()
    """,
        prefix=drop,
    )
    lines = out.splitlines()
    assert lines[0].split() == ["share", "300", "1200", "1200"]  # (1200 - 600) // 2
    assert lines[1] == "read 2500 cached 300 open True"
