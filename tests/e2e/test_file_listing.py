"""A native `FileDataset` over a directory tree: one metadata request per
directory (`readdir_layouts`, counted at the client's metadata stub), no
open per file, and the same files, sizes and bytes as a per-file walk;
and the sampler on a mount path hints the mount (fuse/prefetch.py)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clusters import ProcessCluster
from harness import evict

from shufflefs.client.data import FileDataset
from shufflefs.client.data.urls import client_for
from shufflefs.cluster.config import load_client_config
from shufflefs.metadata.stub import MetaStub

DIRS = 3
PER_DIR = 40


@pytest.fixture(scope="module")
def tree(mounted: ProcessCluster) -> tuple[Path, str, str]:
    """(the tree on the mount, its URL, the client config)."""
    root = mounted.mountpoint / "listing-tree"
    rng = np.random.default_rng(1)
    for d in range(DIRS):
        sub = root / f"class{d}" / "deeper" if d == 2 else root / f"class{d}"
        sub.mkdir(parents=True)
        for i in range(PER_DIR):
            (sub / f"s{i:03d}.bin").write_bytes(rng.bytes(int(rng.integers(0, 30_000))))
    mgmtd = load_client_config(mounted.client_config)[0].mgmtd
    return root, f"shufflefs://{mgmtd}/listing-tree", str(mounted.client_config)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Metadata requests this process sends, by method."""
    counter: Counter[str] = Counter()
    real = MetaStub._call

    async def counting(self: MetaStub, method: str, **args: Any) -> Any:
        counter[method] += 1
        return await real(self, method, **args)

    monkeypatch.setattr(MetaStub, "_call", counting)
    yield counter


def test_native_listing_is_one_request_per_directory(
    tree: tuple[Path, str, str], calls: Counter[str]
) -> None:
    root, url, config = tree
    client_for(config)  # connected before counting starts
    calls.clear()
    ds = FileDataset(url, seed=3, batch_size=16, config=config)
    directories = 1 + DIRS + 1  # the root, the class dirs, class2/deeper
    assert calls["readdir_layouts"] == directories
    assert calls["readdir"] == 0 and calls["open"] == 0 and calls["lookup"] == 0
    # the same files and sizes as a walk of the mount, file by file
    walked = sorted(
        (os.path.relpath(os.path.join(d, n), root), os.stat(os.path.join(d, n)).st_size)
        for d, _, names in os.walk(root)
        for n in names
    )
    listed = [(p[len(url) + 1 :], int(s)) for p, s in zip(ds.files, ds.sizes, strict=True)]
    assert listed == walked
    # read every batch: no open, and the bytes of a per-file read
    calls.clear()
    got = {}
    for batch in ds.sampler.batches():
        for i, data in zip(batch, ds.__getitems__(batch), strict=True):
            got[i] = data
    assert calls["open"] == 0 and calls["resolve"] == 0
    assert len(got) == len(ds)
    for i, path in enumerate(ds.files):
        assert got[i] == (root / path[len(url) + 1 :]).read_bytes()
    # iterating with readahead: the same
    ds.set_epoch(1)
    assert sum(len(b) for b in ds.iter_batches()) == len(ds)
    assert calls["open"] == 0
    ds.close()


def test_sampler_on_a_mount_path_hints_the_mount(tree: tuple[Path, str, str]) -> None:
    root, _, _ = tree
    mount = root.parent
    os.setxattr(mount, "user.shufflefs.prefetch", b"")  # nothing queued or held before

    def state() -> dict[str, Any]:
        s: dict[str, Any] = json.loads(os.getxattr(mount, "user.shufflefs.prefetch"))
        return s

    ds = FileDataset(str(root), seed=2, batch_size=8, mount_prefetch=32)
    assert ds.sampler.hints is not None and ds.sampler.hints.root == str(mount)
    before = state()["hinted"]
    order = list(ds.sampler)  # what a DataLoader's sampler iteration does
    ds.sampler.hints.flush()
    assert state()["hinted"] - before == len(order) == len(ds)
    # the dataset's own iteration hints along its reads, and reads right
    evict(ds.files)  # written through this mount: drop their pages, so reads reach it
    os.setxattr(mount, "user.shufflefs.prefetch", b"")
    before = state()
    ds.set_epoch(1)
    samples = list(ds)
    ds.close()
    after = state()
    assert after["hinted"] - before["hinted"] == len(ds)
    # the hinted bytes answered reads: from the mount's cache, or (a file
    # the kernel knows: the hint thread listed its directory) stored in the
    # kernel's page cache first
    used = after["hits"] - before["hits"] + after["stored"] - before["stored"]
    assert used > 0, after
    files = {p: Path(p).read_bytes() for p in ds.files}
    perm = ds.sampler.items(np.arange(len(ds)), 1)
    assert samples == [files[ds.files[i]] for i in perm.tolist()]
    # off: no hints
    assert FileDataset(str(root), mount_prefetch=0).sampler.hints is None
