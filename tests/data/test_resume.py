"""Resume: stop at any step, restore, and get exactly the uninterrupted run's samples."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokendata import write_tokens
from torch.utils.data import DataLoader

from shufflefs.client.data import FileDataset, ShuffleLoader, TokenWindowDataset
from shufflefs.client.data.tokens import TokenWindows

SEQ = 32
BATCH = 16


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_tokens(tmp_path_factory.mktemp("tokens"), {"a.bin": 9001, "b.npy": 4001})


def run_epochs(ds: TokenWindows, epochs: range) -> list[bytes]:
    out = []
    for epoch in epochs:
        ds.set_epoch(epoch)
        out += [np.asarray(b).tobytes() for b in ds.iter_batches()]
    return out


@pytest.mark.parametrize("stop", [0, 1, 17, 25, 26])
def test_single_process_resume(paths: list[str], stop: int) -> None:
    """Stop after *stop* batches of epoch 1, save, restore in a new object."""
    full = TokenWindows(paths, seq_len=SEQ, seed=5, batch_size=BATCH)
    per_epoch = -(-len(full) // BATCH)
    assert per_epoch == 26
    expected = run_epochs(full, range(3))

    first = TokenWindows(paths, seq_len=SEQ, seed=5, batch_size=BATCH)
    got = run_epochs(first, range(1))
    first.set_epoch(1)
    # take exactly `stop` batches (a batch handed out counts as consumed)
    got += [np.asarray(b).tobytes() for b in itertools.islice(first.iter_batches(), stop)]
    state = first.state_dict()
    assert state["epoch"] == 1
    assert state["consumed"] == min(stop * BATCH, len(first))

    resumed = TokenWindows(paths, seq_len=SEQ, seed=123, batch_size=BATCH)  # seed from the state
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # what a training loop does: must keep the position
    got += [np.asarray(b).tobytes() for b in resumed.iter_batches()]
    got += run_epochs(resumed, range(2, 3))
    assert got == expected


def test_sample_iteration_resume_mid_batch(paths: list[str]) -> None:
    """Samples, not batches: stop at any sample (no batch size at all)."""
    full = TokenWindows(paths, seq_len=SEQ, seed=1)
    expected = [s.tobytes() for s in full]
    for stop in (0, 1, 63, 64, 65, 200, len(expected)):
        ds = TokenWindows(paths, seq_len=SEQ, seed=1)
        got = [s.tobytes() for s in itertools.islice(ds, stop)]
        again = TokenWindows(paths, seq_len=SEQ, seed=1)
        again.load_state_dict(ds.state_dict())
        got += [s.tobytes() for s in again]
        assert got == expected, stop


def loader_batches(ds: TokenWindowDataset, workers: int, limit: int | None = None) -> list[bytes]:
    loader = DataLoader(ds, batch_size=BATCH, num_workers=workers)
    return [b.numpy().tobytes() for b in itertools.islice(loader, limit)]


def test_dataloader_with_workers_matches_single_process_and_resumes(paths: list[str]) -> None:
    def make() -> TokenWindowDataset:
        return TokenWindowDataset(paths, seq_len=SEQ, seed=7, batch_size=BATCH, readahead=2)

    single = make()
    single.set_epoch(2)
    expected = [b.numpy().tobytes() for b in single.iter_batches()]
    assert all(isinstance(b, torch.Tensor) for b in make().iter_batches())

    ds = make()
    ds.set_epoch(2)
    assert loader_batches(ds, 2) == expected  # workers: the single-process order

    # stop after 9 batches, save with the count the trainer knows, restore
    ds = make()
    ds.set_epoch(2)
    head = loader_batches(ds, 2, limit=9)
    state = ds.state_dict(consumed=9 * BATCH)
    restored = make()
    restored.load_state_dict(state)
    restored.set_epoch(2)
    assert head + loader_batches(restored, 2) == expected
    # and restoring into a single process gives the same continuation
    alone = make()
    alone.load_state_dict(state)
    assert head + [b.numpy().tobytes() for b in alone.iter_batches()] == expected


def shuffle_loader_run(
    make: Any, epochs: range, stop: tuple[int, int] | None, state: dict[str, Any] | None
) -> tuple[list[bytes], dict[str, Any] | None]:
    ds = make()
    loader = ShuffleLoader(ds, num_workers=2)
    if state is not None:
        loader.load_state_dict(state)
    out: list[bytes] = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        if stop is not None and epoch == stop[0]:
            out += [to_bytes(b) for b in itertools.islice(loader, stop[1])]
            return out, loader.state_dict()
        out += [to_bytes(b) for b in loader]
    return out, loader.state_dict()


def to_bytes(batch: Any) -> bytes:
    if isinstance(batch, torch.Tensor):
        return batch.numpy().tobytes()
    return b"|".join(batch)


@pytest.mark.parametrize("kind", ["tokens", "files"])
def test_shuffle_loader_state_is_exact_with_workers(
    paths: list[str], tmp_path: Path, kind: str
) -> None:
    if kind == "files":
        d = tmp_path / "files"
        d.mkdir()
        rng = np.random.default_rng(0)
        for i in range(150):
            (d / f"rec{i:04d}.bin").write_bytes(rng.bytes(int(rng.integers(0, 300))))

        def make() -> Any:
            return FileDataset(d, seed=4, batch_size=BATCH)

        stops = [(0, 0), (1, 3), (1, 9)]
    else:

        def make() -> Any:
            return TokenWindowDataset(paths, seq_len=SEQ, seed=4, batch_size=BATCH)

        stops = [(0, 0), (1, 7), (1, 25)]
    expected, end_state = shuffle_loader_run(make, range(2), None, None)
    assert end_state is not None and end_state["epoch"] == 1
    for stop in stops:
        head, state = shuffle_loader_run(make, range(2), stop, None)
        assert state is not None
        assert state["epoch"] == stop[0]
        assert state["consumed"] == stop[1] * BATCH
        tail, _ = shuffle_loader_run(make, range(stop[0], 2), None, state)
        assert head + tail == expected, stop


def test_state_is_refused_by_another_dataset(paths: list[str], tmp_path: Path) -> None:
    ds = TokenWindows(paths, seq_len=SEQ, rank=0, world_size=2, batch_size=BATCH)
    state = ds.state_dict(consumed=BATCH)
    with pytest.raises(ValueError, match="another dataset"):
        TokenWindows(paths, seq_len=SEQ + 1, rank=0, world_size=2).load_state_dict(state)
    # issue 14: the state is global, so another world size or rank continues it
    # (tests/data/test_elastic.py checks the samples), but ranks that disagree are refused
    for rank, world in ((0, 3), (1, 2)):
        other_shape = TokenWindows(paths, seq_len=SEQ, rank=rank, world_size=world)
        other_shape.load_state_dict(state)
        assert other_shape.state_dict()["position"] == 2 * BATCH
    behind = ds.state_dict(consumed=BATCH - 1)
    with pytest.raises(ValueError, match="disagree on position"):
        TokenWindows(paths, seq_len=SEQ, rank=1, world_size=2).load_state_dict([state, behind])
    other = write_tokens(tmp_path, {"a.bin": 9001, "b.npy": 4002})
    with pytest.raises(ValueError, match="another dataset"):
        TokenWindows(other, seq_len=SEQ, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError):
        ds.state_dict(consumed=len(ds) + 1)
    # the same files elsewhere (a copy, a mount) accept it
    TokenWindows(paths, seq_len=SEQ, rank=0, world_size=2).load_state_dict(state)


def test_epoch_semantics(paths: list[str]) -> None:
    ds = TokenWindows(paths, seq_len=SEQ, seed=2, batch_size=BATCH)
    first = [b.tobytes() for b in ds.iter_batches()]
    # iterating again without set_epoch: the same epoch again, from its start
    assert [b.tobytes() for b in ds.iter_batches()] == first
    ds.set_epoch(1)
    second = [b.tobytes() for b in ds.iter_batches()]
    assert second != first and sorted(second) != sorted(first)  # a new order
    assert ds.state_dict()["consumed"] == len(ds)
    ds.set_epoch(2)
    assert ds.state_dict()["consumed"] == 0


def test_readahead_and_read_grouping_do_not_change_batches(paths: list[str]) -> None:
    def run(readahead: int, read_size: int, worker: int, workers: int) -> list[bytes]:
        ds = TokenWindows(
            paths, seq_len=SEQ, seed=6, batch_size=BATCH, readahead=readahead, read_size=read_size
        )
        got = list(ds.iter_batches(worker=worker, num_workers=workers))
        assert all(len(b) == BATCH for b in got[:-1]) and 0 < len(got[-1]) <= BATCH
        return [b.tobytes() for b in got]

    for workers in (1, 3):
        for worker in range(workers):
            plain = run(0, 1, worker, workers)
            for readahead, read_size in ((1, 1), (1, 50), (3, 256), (2, 10_000)):
                assert run(readahead, read_size, worker, workers) == plain
