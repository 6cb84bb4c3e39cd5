"""Fixtures for the metadata tests: a fresh namespace per test, checked at the end."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from metaservice import env  # noqa: F401 (the fixture)

from shufflefs.metadata.protocol import Layout
from shufflefs.metadata.store import NamespaceStore

LAYOUT: Layout = {"chunk_size": 1 << 20, "chains": [1, 2]}


class FakeClock:
    """Wall clock for session leases, moved by hand."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Fs:
    """Shorthands for building trees in a NamespaceStore."""

    def __init__(self, ns: NamespaceStore) -> None:
        self.ns = ns
        self.layouts_made = 0
        self.session = ns.session_open("test", "localhost", os.getpid())["session"]

    def layout(self) -> Layout:
        self.layouts_made += 1
        return {"chunk_size": LAYOUT["chunk_size"], "chains": list(LAYOUT["chains"])}

    def file(self, parent: int, name: bytes, mode: int = 0o644) -> int:
        return self.ns.mknod(parent, name, stat.S_IFREG | mode, 0, 1000, 1000, self.layout)["ino"]

    def dir(self, parent: int, name: bytes, mode: int = 0o755) -> int:
        return self.ns.mkdir(parent, name, mode, 1000, 1000)["ino"]

    def open_new(self, parent: int, name: bytes) -> tuple[int, int]:
        """Create and open a file: (ino, handle)."""
        result = self.ns.create(
            parent, name, 0o644, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0, 0, self.session, self.layout
        )
        return result["attr"]["ino"], result["handle"]

    def names(self, ino: int) -> list[bytes]:
        page = self.ns.readdir(ino, None, 1024)
        assert not page["more"]
        return [name for name, _ in page["entries"]]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ns_path(tmp_path: Path) -> Path:
    return tmp_path / "namespace"


@pytest.fixture
def ns(ns_path: Path, clock: FakeClock) -> Iterator[NamespaceStore]:
    store = NamespaceStore(
        ns_path, map_size=64 << 20, sync=False, session_timeout=60.0, clock=clock
    )
    try:
        yield store
        assert store.fsck() == []  # every test leaves a consistent namespace
    finally:
        store.close()


@pytest.fixture
def fs(ns: NamespaceStore) -> Fs:
    return Fs(ns)
