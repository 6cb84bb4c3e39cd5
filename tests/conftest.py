"""Fixtures of every test, and the two layers of the suite.

Clusters come from clusters.py (see its docstring): `cluster` runs mgmtd and
storage daemons in the test's own process; `mounted`, `mnt`, `native`,
`process_cluster` and `fault_cluster` run real processes through the real
launcher and need root and /dev/fuse.

Layers: a test is `e2e` when it lives under tests/e2e or tests/faults or uses
one of the process fixtures (or says so with ``pytest.mark.e2e``);
``pytest -m "not e2e"`` runs the rest, the unit layer, without root or FUSE.
"""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import (
    cluster,
    fault_cluster,
    mnt,
    mounted,
    native,
    process_cluster,
    writable_mnt,
    writeback_cache_mount,
    writeback_mount,
)
from opsworld import ops_cluster

__all__ = [
    "cluster",
    "fault_cluster",
    "mnt",
    "mounted",
    "native",
    "ops_cluster",
    "process_cluster",
    "writable_mnt",
    "writeback_cache_mount",
    "writeback_mount",
]

TESTS = Path(__file__).parent
E2E_FOLDERS = (TESTS / "e2e", TESTS / "faults")
# Fixtures that start service processes or mount (directly or through another).
PROCESS_FIXTURES = frozenset(
    {"mounted", "mnt", "writable_mnt", "native", "process_cluster", "fault_cluster", "ops_cluster"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        in_e2e_folder = any(item.path.is_relative_to(folder) for folder in E2E_FOLDERS)
        uses_processes = PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if in_e2e_folder or uses_processes:
            item.add_marker(pytest.mark.e2e)


# One lock for the whole machine: the kernel's caches are the machine's.
KERNEL_CACHES_LOCK = Path(tempfile.gettempdir()) / "shufflefs-tests-kernel-caches.lock"


@pytest.fixture
def kernel_caches() -> Iterator[None]:
    """The kernel's page, dentry and inode caches to this test alone, while it
    runs: for a test that drops them (`/proc/sys/vm/drop_caches`) and for one
    that counts what they spare (requests that reach the mount or a daemon,
    pages resident after a warmup). `make test` runs two pytest workers, and
    each holds this lock (an exclusive `flock`) only around such a test."""
    with open(KERNEL_CACHES_LOCK, "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
