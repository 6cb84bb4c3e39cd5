"""A mixture read by a real DataLoader with workers on the mount and through the
native client gives exactly the batches of the same mixture on local files,
and resumes on another world size there too."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clusters import ProcessCluster
from tokendata import write_tokens
from torch.utils.data import DataLoader

from shufflefs.client.data import FileDataset, Mixture, ShuffleLoader, TokenWindowDataset
from shufflefs.client.data.urls import client_for
from shufflefs.cluster.config import load_client_config

pytestmark = pytest.mark.e2e

SEQ = 128
BATCH = 16
# windows straddle 1 MiB chunk ends; three sources of different sizes
SOURCES = {"web": {"w0.bin": 900_001, "w1.bin": 500_003}, "code": {"c.npy": 400_007}}


class Where:
    def __init__(self, local: Path, mount: Path, url: str, config: str) -> None:
        self.local, self.mount, self.url, self.config = local, mount, url, config

    def root(self, where: str) -> str:
        return {"local": str(self.local), "fuse": str(self.mount), "native": self.url}[where]


@pytest.fixture(scope="module")
def where(mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Where:
    local = tmp_path_factory.mktemp("mix-local")
    for name, files in SOURCES.items():
        write_tokens(local / name, files, dtype="uint16")
    rng = np.random.default_rng(5)
    (local / "books").mkdir()
    for i in range(50):
        (local / "books" / f"b{i:03d}.txt").write_bytes(rng.bytes(int(rng.integers(1, 30_000))))
    mount = mounted.mountpoint / "mix-tests"
    shutil.copytree(local, mount)
    mgmtd = load_client_config(mounted.client_config)[0].mgmtd
    return Where(local, mount, f"shufflefs://{mgmtd}/mix-tests", str(mounted.client_config))


def tokens_mixture(
    w: Where, place: str, rank: int = 0, world: int = 1, readahead: int = 2
) -> Mixture:
    root = w.root(place)
    parts = [
        TokenWindowDataset(
            [f"{root}/{name}/{f}" for f in files],
            seq_len=SEQ,
            dtype="uint16",
            readahead=readahead,
            config=w.config,
        )
        for name, files in SOURCES.items()
    ]
    return Mixture(
        parts,
        weights=[0.7, 0.3],
        seed=21,
        rank=rank,
        world_size=world,
        batch_size=BATCH,
        readahead=readahead,
    )


def batches(ds: Any, epoch: int, workers: int = 2) -> list[bytes]:
    ds.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=workers, persistent_workers=True)
    return [b.numpy().tobytes() for b in loader]


def test_dataloader_over_a_mixture_on_the_mount_equals_local(where: Where) -> None:
    for epoch in (0, 1):
        expected = batches(tokens_mixture(where, "local"), epoch)
        assert len(expected) == -(-len(tokens_mixture(where, "local")) // BATCH)
        assert batches(tokens_mixture(where, "fuse"), epoch) == expected
        assert batches(tokens_mixture(where, "native", readahead=4), epoch) == expected


def test_mixture_with_files_resumes_on_another_world_size_natively(where: Where) -> None:
    def make(place: str, rank: int, world: int) -> Mixture:
        root = where.root(place)
        web = TokenWindowDataset(
            [f"{root}/web/{f}" for f in SOURCES["web"]], seq_len=SEQ, dtype="uint16",
            config=where.config,
        )  # fmt: skip
        books = FileDataset(f"{root}/books", config=where.config)
        return Mixture([web, books], weights=[0.9, 0.1], seed=2, rank=rank, world_size=world,
                       batch_size=4)  # fmt: skip

    def ident(sample: Any) -> bytes:
        return sample if isinstance(sample, bytes) else np.asarray(sample).tobytes()

    everything = sorted(ident(s) for b in make("local", 0, 1).iter_batches() for s in b)
    got: list[bytes] = []
    states = []
    for rank in range(3):  # 3 ranks take 5 steps each
        ds = make("native", rank, 3)
        loader = ShuffleLoader(ds, num_workers=2)
        for step, batch in enumerate(loader):
            got += [ident(s) for s in batch]
            if step == 4:
                break
        states.append(loader.state_dict())
    for rank in range(2):  # and 2 ranks on the mount finish the epoch
        ds = make("fuse", rank, 2)
        ds.load_state_dict(states)
        got += [ident(s) for b in ShuffleLoader(ds, num_workers=2) for s in b]
    assert sorted(got) == everything
    # explain names the native bytes
    mix = make("native", 0, 1)
    client = client_for(where.config)
    for key in mix.explain(100, 6):
        path = "/" + key["path"].split("/", 3)[3]
        assert len(client.pread(path, key["offset"], key["length"])) == key["length"]
