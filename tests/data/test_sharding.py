"""Coverage: over an epoch, every window exactly once across ranks x workers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tokendata import DEFAULT_FILES, window_starts, write_tokens

from shufflefs.client.data.sharding import Shard, worker_blocks
from shufflefs.client.data.tokens import TokenWindows

SEQ = 64


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_tokens(tmp_path_factory.mktemp("tokens"))


def first_tokens(ds: TokenWindows, worker: int, workers: int) -> list[int]:
    out: list[int] = []
    for batch in ds.iter_batches(worker=worker, num_workers=workers):
        assert batch.shape[1] == SEQ + 1
        # every window is seq_len + 1 consecutive tokens of one file
        assert (np.diff(batch.astype(np.int64), axis=1) == 1).all()
        out.extend(batch[:, 0].tolist())
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("batch_size", [7, 32])
@pytest.mark.parametrize("stride", [None, 5])
def test_every_window_once_over_ranks_and_workers(
    paths: list[str], world_size: int, batch_size: int, stride: int | None
) -> None:
    expected = window_starts(DEFAULT_FILES, SEQ, stride or SEQ)
    for epoch in (0, 1):
        seen: Counter[int] = Counter()
        total_len = 0
        for rank in range(world_size):
            ds = TokenWindows(
                paths,
                seq_len=SEQ,
                stride=stride,
                seed=3,
                rank=rank,
                world_size=world_size,
                batch_size=batch_size,
                readahead=2,
            )
            ds.set_epoch(epoch)
            assert ds.num_windows == len(expected)
            total_len += len(ds)
            mine = []
            for worker in range(2):
                mine += first_tokens(ds, worker, 2)
            assert len(mine) == len(ds)
            seen.update(mine)
        assert total_len == len(expected)
        assert sorted(seen) == sorted(expected)
        assert set(seen.values()) == {1}


def test_samples_without_batch_size_are_sharded_per_sample(paths: list[str]) -> None:
    expected = window_starts(DEFAULT_FILES, SEQ, 3)
    seen: list[int] = []
    for rank in range(2):
        ds = TokenWindows(paths, seq_len=SEQ, stride=3, seed=9, rank=rank, world_size=2)
        for worker in range(3):
            ds_iter = ds._batches(worker, 3)
            seen += [int(x) for batch in ds_iter for x in batch[:, 0]]
    assert sorted(seen) == sorted(expected)


def test_drop_last_gives_equal_ranks_without_repeats(paths: list[str]) -> None:
    n = len(window_starts(DEFAULT_FILES, SEQ, SEQ))
    world = 4
    assert n % world  # the test needs a remainder to drop
    seen: list[int] = []
    for rank in range(world):
        ds = TokenWindows(
            paths, seq_len=SEQ, rank=rank, world_size=world, drop_last=True, batch_size=8
        )
        assert len(ds) == n // world
        got = [t for w in range(2) for t in first_tokens(ds, w, 2)]
        assert len(got) == n // world
        seen += got
    assert len(set(seen)) == len(seen) == n - n % world


def test_ranks_differ_by_at_most_one() -> None:
    for n in (0, 1, 5, 97, 100):
        for world in (1, 2, 3, 7):
            sizes = [Shard(n, r, world).size for r in range(world)]
            assert sum(sizes) == n
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("unit,per_block", [(1, 1), (1, 64), (5, 1), (8, 3)])
def test_worker_blocks_partition_the_rest_of_the_epoch(unit: int, per_block: int) -> None:
    total, start = 203, 17
    for workers in (1, 2, 3, 4):
        got: list[int] = []
        for w in range(workers):
            blocks = list(worker_blocks(total, start, unit, w, workers, per_block))
            for b in blocks:
                assert (np.diff(b) > 0).all()
            got += [int(x) for b in blocks for x in b]
        assert sorted(got) == list(range(start, total))
        # unit i of the rest belongs to worker i % workers
        for w in range(workers):
            for b in worker_blocks(total, start, unit, w, workers, per_block):
                assert all(((x - start) // unit) % workers == w for x in b.tolist())


def test_bad_shard_arguments() -> None:
    with pytest.raises(ValueError):
        Shard(10, 2, 2)
    with pytest.raises(ValueError):
        Shard(10, 0, 0)
    with pytest.raises(ValueError):
        list(worker_blocks(10, 0, 1, 3, 2, 1))


def test_local_and_global_positions(tmp_path: Path) -> None:
    paths = write_tokens(tmp_path, {"x.bin": 2000})
    ds0 = TokenWindows(paths, seq_len=9, rank=0, world_size=3, seed=1)
    ds2 = TokenWindows(paths, seq_len=9, rank=2, world_size=3, seed=1)
    single = TokenWindows(paths, seq_len=9, seed=1)
    order = single.windows(np.arange(len(single)))
    # rank r's local position j is the single-process position j * world + r
    assert ds0.windows(np.arange(len(ds0))).tolist() == order[0::3].tolist()
    assert ds2.windows(np.arange(len(ds2))).tolist() == order[2::3].tolist()
