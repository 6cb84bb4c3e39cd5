"""Elastic resume: a run saved on W ranks x K workers continues on W' x K' with
another batch size, and over the epoch every sample is delivered exactly once."""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokendata import write_tokens

from shufflefs.client.data import FileSamples, Mixture, TokenWindows, combine_states
from shufflefs.client.data.sharding import Shard

SEQ = 8
Make = Callable[..., Any]


@pytest.fixture(scope="module")
def makers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Make]:
    base = tmp_path_factory.mktemp("elastic")
    paths = write_tokens(base / "tok", {"a.bin": 1601, "b.npy": 903, "c.bin": 450})
    files = base / "files"
    files.mkdir()
    for i in range(97):
        (files / f"f{i:03d}").write_bytes(f"file {i}".encode())

    def tokens(**kw: Any) -> TokenWindows:
        return TokenWindows(paths, seq_len=SEQ, dtype="uint32", seed=11, **kw)

    def mixture(**kw: Any) -> Mixture:
        parts = [TokenWindows([p], seq_len=SEQ, dtype="uint32") for p in paths]
        return Mixture(parts, weights=[0.5, 0.3, 0.2], seed=11, **kw)

    def file_samples(**kw: Any) -> FileSamples:
        return FileSamples(files, seed=11, **kw)

    return {"tokens": tokens, "mixture": mixture, "files": file_samples}


def ident(sample: Any) -> Any:
    return sample if isinstance(sample, bytes) else int(np.asarray(sample)[0])


def rank_batches(ds: Any, workers: int) -> Iterator[list[Any]]:
    """A rank's batches as a DataLoader with *workers* makes them: each worker
    a copy of the dataset, batches taken from the workers in turn."""
    streams = [
        copy.deepcopy(ds).iter_batches(worker=w, num_workers=workers) for w in range(workers)
    ]
    live = list(range(workers))
    while live:
        for w in list(live):
            batch = next(streams[w], None)
            if batch is None:
                live.remove(w)
                continue
            yield [ident(s) for s in batch]


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["tokens", "mixture", "files"]),
    before=st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 17)),
    after=st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 17)),
    cut=st.floats(0, 1),
    epoch=st.integers(0, 2),
)
def test_resume_on_another_shape_delivers_every_sample_once(
    makers: dict[str, Make],
    kind: str,
    before: tuple[int, int, int],
    after: tuple[int, int, int],
    cut: float,
    epoch: int,
) -> None:
    make = makers[kind]
    world, workers, batch = before
    full = make(batch_size=1)
    full.set_epoch(epoch)
    everything = Counter(ident(s) for b in full.iter_batches() for s in b)
    n = sum(everything.values())
    assert set(everything.values()) == {1}

    ranks = [make(rank=r, world_size=world, batch_size=batch) for r in range(world)]
    for ds in ranks:
        ds.set_epoch(epoch)
    lengths = [len(ds.sampler if kind == "files" else ds) for ds in ranks]
    steps = int(cut * (min(lengths) // batch))
    delivered: Counter[Any] = Counter()
    for ds in ranks:
        for b in itertools.islice(rank_batches(ds, workers), steps):
            delivered.update(b)
    states = [ds.state_dict(consumed=steps * batch) for ds in ranks]
    state = combine_states(states)
    assert state["position"] == min(n, steps * batch * world)

    world2, workers2, batch2 = after
    for r in range(world2):
        ds = make(rank=r, world_size=world2, batch_size=batch2)
        ds.load_state_dict(states)  # all ranks' states: checked to agree
        ds.set_epoch(epoch)  # the training loop's call keeps the position
        for b in rank_batches(ds, workers2):
            delivered.update(b)
    assert delivered == everything


def test_disagreeing_rank_states_are_refused(makers: dict[str, Make]) -> None:
    ranks = [makers["mixture"](rank=r, world_size=2, batch_size=4) for r in range(2)]
    good = [ds.state_dict(consumed=8) for ds in ranks]
    assert combine_states(good)["position"] == 16
    bad = [good[0], ranks[1].state_dict(consumed=12)]
    with pytest.raises(ValueError, match="disagree on position"):
        makers["mixture"](rank=0, world_size=3).load_state_dict(bad)
    other_seed = dict(good[1], seed=12)
    with pytest.raises(ValueError, match="disagree on seed"):
        combine_states([good[0], other_seed])
    with pytest.raises(ValueError):
        combine_states([])


def test_a_state_of_the_previous_format_still_loads(makers: dict[str, Make]) -> None:
    ds = makers["tokens"](rank=1, world_size=3, batch_size=4)
    legacy = {
        "format": "shufflefs.sampler/1",
        "kind": "token_windows",
        "seed": 11,
        "epoch": 1,
        "consumed": 8,
        "rank": 1,
        "world_size": 3,
        "drop_last": False,
        "batch_size": 4,
        **ds._identity(),
    }
    ds.load_state_dict(legacy)
    assert ds.state_dict()["position"] == 24 and ds.epoch == 1


def test_global_position_of_a_lockstep_count() -> None:
    for n in (0, 1, 10, 97):
        for world in (1, 3, 8):
            for start in sorted({0, n // 3, n}):
                shard = Shard(n, 0, world, start=start)
                assert shard.global_position(0) == (start if shard.most else n)
                assert shard.global_position(shard.most) == n
                with pytest.raises(ValueError):
                    shard.global_position(shard.most + 1)
                sizes = [Shard(n, r, world, start=start).size for r in range(world)]
                assert sum(sizes) == n - start
