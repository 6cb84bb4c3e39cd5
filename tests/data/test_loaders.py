"""Resume through real loaders: persistent DataLoader workers, torchdata's
StatefulDataLoader and ShuffleLoader each equal an uninterrupted run."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokendata import write_tokens
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from shufflefs.client.data import Mixture, ShuffleLoader, TokenWindowDataset

SEQ = 16
BATCH = 8
EPOCHS = 3
Make = Callable[[], Any]
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


@pytest.fixture(scope="module", params=["tokens", "mixture"])
def make(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Make:
    paths = write_tokens(
        tmp_path_factory.mktemp("loaders"), {"a.bin": 2401, "b.npy": 1203, "c.bin": 801}
    )
    if request.param == "tokens":
        return lambda: TokenWindowDataset(
            paths, seq_len=SEQ, dtype="uint32", seed=3, batch_size=BATCH
        )

    def mixture() -> Mixture:
        parts = [TokenWindowDataset([p], seq_len=SEQ, dtype="uint32") for p in paths]
        return Mixture(parts, weights=[0.5, 0.3, 0.2], seed=3, batch_size=BATCH)

    return mixture


def as_bytes(batch: Any) -> bytes:
    assert isinstance(batch, torch.Tensor)
    return batch.numpy().tobytes()


def uninterrupted(make: Make) -> list[bytes]:
    ds = make()
    out = []
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        out += [as_bytes(b) for b in ds.iter_batches()]
    return out


def per_epoch(make: Make) -> int:
    return -(-len(make()) // BATCH)


@pytest.mark.parametrize("stop", [(0, 0), (1, 5), (2, 1)])
def test_persistent_workers_resume(make: Make, stop: tuple[int, int]) -> None:
    resume_through_dataloader(make, stop, "fork")


def test_persistent_spawned_workers_resume(tmp_path: Path) -> None:
    """Spawned workers (the default on macOS, and what CUDA users pick) get
    the dataset pickled, epoch and position included. Once, on a mixture:
    spawning costs seconds a loader."""
    paths = write_tokens(tmp_path, {"a.bin": 801, "b.npy": 403, "c.bin": 301})

    def mixture() -> Mixture:
        parts = [TokenWindowDataset([p], seq_len=SEQ, dtype="uint32") for p in paths]
        return Mixture(parts, weights=[0.5, 0.3, 0.2], seed=3, batch_size=BATCH)

    resume_through_dataloader(mixture, (1, 5), "spawn")


def resume_through_dataloader(make: Make, stop: tuple[int, int], start_method: str) -> None:
    expected = uninterrupted(make)
    ds = make()

    def loader_for(ds: Any) -> DataLoader[Any]:
        return DataLoader(
            ds,
            batch_size=BATCH,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context=start_method,
        )

    loader = loader_for(ds)
    got: list[bytes] = []
    for epoch in range(stop[0] + 1):
        ds.set_epoch(epoch)
        if epoch < stop[0]:
            got += [as_bytes(b) for b in loader]
    got += [as_bytes(b) for b in itertools.islice(loader, stop[1])]
    state = ds.state_dict(consumed=stop[1] * BATCH)
    del loader
    again = make()
    again.load_state_dict(state)
    loader = loader_for(again)
    for epoch in range(stop[0], EPOCHS):
        again.set_epoch(epoch)  # persistent workers follow set_epoch and the restored position
        got += [as_bytes(b) for b in loader]
    assert got == expected


def test_persistent_workers_follow_epochs_without_a_restore(make: Make) -> None:
    ds = make()
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2, persistent_workers=True)
    got = []
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        got += [as_bytes(b) for b in loader]
    assert got == uninterrupted(make)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [(0, 3), (1, 0), (1, 7)])
def test_stateful_dataloader_resume(make: Make, workers: int, stop: tuple[int, int]) -> None:
    expected = uninterrupted(make)

    def loader_for(ds: Any) -> StatefulDataLoader:
        return StatefulDataLoader(
            ds, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0
        )

    ds = make()
    loader = loader_for(ds)
    got: list[bytes] = []
    for epoch in range(stop[0]):
        ds.set_epoch(epoch)
        got += [as_bytes(b) for b in loader]
    ds.set_epoch(stop[0])
    it = iter(loader)
    got += [as_bytes(next(it)) for _ in range(stop[1])]
    state = loader.state_dict()
    del it, loader
    again = make()
    again.set_epoch(stop[0])
    loader = loader_for(again)
    loader.load_state_dict(state)
    got += [as_bytes(b) for b in loader]
    for epoch in range(stop[0] + 1, EPOCHS):
        again.set_epoch(epoch)
        got += [as_bytes(b) for b in loader]
    assert got == expected


@pytest.mark.parametrize("persistent", [False, True])
def test_shuffle_loader_with_persistent_workers(make: Make, persistent: bool) -> None:
    expected = uninterrupted(make)
    n = per_epoch(make)
    for cut in (3, n + 2):
        ds = make()
        loader = ShuffleLoader(ds, num_workers=2, persistent_workers=persistent)
        got: list[bytes] = []
        epoch = 0
        taken = 0
        while taken < cut:
            loader.set_epoch(epoch)
            for b in itertools.islice(loader, cut - taken):
                got.append(as_bytes(b))
                taken += 1
            if taken % n == 0:
                epoch += 1
        state = loader.state_dict()
        again = make()
        resumed = ShuffleLoader(again, num_workers=2, persistent_workers=persistent)
        resumed.load_state_dict(state)
        for e in range(state["epoch"], EPOCHS):
            resumed.set_epoch(e)
            got += [as_bytes(b) for b in resumed]
        assert got == expected, cut
