"""Mixtures: each component in its own order, exact bytes, exhaustion, quarantine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokendata import write_tokens

from shufflefs.client.data import FileSamples, Mixture, TokenWindows
from shufflefs.client.data.mixture import component_seed
from shufflefs.client.data.permutation import KeyedPermutation

SEQ = 16
FILES = {"a1.bin": 3001, "a2.npy": 1201, "b.bin": 2003, "c.npy": 1503}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    paths = write_tokens(tmp_path_factory.mktemp("mix"), FILES)  # token values unique over all
    return [paths[:2], paths[2:3], paths[3:]]


def components(sources: list[list[str]]) -> list[TokenWindows]:
    return [TokenWindows(p, seq_len=SEQ, dtype="uint32") for p in sources]


def mixture(sources: list[list[str]], **kw: Any) -> Mixture:
    kw.setdefault("weights", [0.5, 0.3, 0.2])
    return Mixture(components(sources), **kw)


def read(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32), epoch=st.integers(0, 3), batch=st.integers(1, 40))
def test_each_component_keeps_its_own_permutation(
    sources: list[list[str]], seed: int, epoch: int, batch: int
) -> None:
    mix = mixture(sources, seed=seed, batch_size=batch)
    mix.set_epoch(epoch)
    rows = np.concatenate([np.asarray(b) for b in mix.iter_batches()])
    assert len(rows) == len(mix) == mix.shard.n
    comp, _leaf, item = mix._resolve(epoch, np.arange(len(mix), dtype=np.int64))
    for i, c in enumerate(mix.components):
        mine = item[comp == i]
        perm = KeyedPermutation(c.num_windows, component_seed(seed, i), epoch)
        assert mine.tolist() == perm(np.arange(mine.size)).tolist()
        # and the bytes are those windows
        files, offsets = c.index.locate(mine)
        got = rows[comp == i]
        for row, f, o in list(zip(got, files.tolist(), offsets.tolist(), strict=True))[:20]:
            assert row.tobytes() == read(c.index.paths[f], o, c.index.window_bytes)
    # stop: the epoch ends when the first component would run out
    counts = mix.schedule.counts(len(mix))
    sizes = [c.num_windows for c in mix.components]
    assert all(n <= s for n, s in zip(counts, sizes, strict=True))
    assert any(n > s for n, s in zip(mix.schedule.counts(len(mix) + 1), sizes, strict=True))


def test_explain_names_exactly_the_delivered_bytes(sources: list[list[str]]) -> None:
    for rank in range(2):
        mix = mixture(sources, seed=3, rank=rank, world_size=2, batch_size=7)
        mix.set_epoch(1)
        for step, batch in enumerate(mix.iter_batches()):
            keys = [k for k in mix.explain_step(step) if k["rank"] == rank]
            assert [read(k["path"], k["offset"], k["length"]) for k in keys] == [
                r.tobytes() for r in np.asarray(batch)
            ]
            # global positions: rank r's step k is start + (k*B + j) * W + r
            assert [k["position"] for k in keys] == [(step * 7 + j) * 2 + rank for j in range(7)][
                : len(keys)
            ]
            if step > 12:
                break
    mix = mixture(sources, seed=3)
    mix.set_epoch(1)
    assert [{k: v for k, v in key.items()} for key in mix.explain(10, 5)] == [
        {x: k[x] for x in ("component", "path", "offset", "length")}
        for k in mixture(sources, seed=3, world_size=1).explain(10, 5, epoch=1)
    ]


def test_repeat_continues_a_component_with_its_next_epoch(sources: list[list[str]]) -> None:
    per_epoch = 2000
    mix = mixture(sources, seed=1, exhausted="repeat", samples_per_epoch=per_epoch)
    assert len(mix) == per_epoch
    sizes = [c.num_windows for c in mix.components]
    streams: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for epoch in range(2):
        comp, _, item = mix._resolve(epoch, np.arange(per_epoch, dtype=np.int64))
        for i in range(3):
            streams[i] += item[comp == i].tolist()
    for i, n in enumerate(sizes):
        s = streams[i]
        assert len(s) > n  # the small components wrapped
        for e in range(len(s) // n):
            perm = KeyedPermutation(n, component_seed(1, i), e)
            assert s[e * n : (e + 1) * n] == perm(np.arange(n)).tolist()


@settings(max_examples=10, deadline=None)
@given(
    picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=8),
    batch=st.integers(1, 30),
    cut=st.integers(0, 20),
)
def test_quarantine_removes_exactly_those_samples_and_shifts_nothing(
    sources: list[list[str]], picks: list[int], batch: int, cut: int
) -> None:
    plain = mixture(sources, seed=5, batch_size=batch)
    everything = plain.explain(0, len(plain))
    bad = [everything[p % len(everything)] for p in picks]
    bad_set = {(k["component"], k["path"], k["offset"]) for k in bad}
    expected = [
        [r.tobytes() for r in np.asarray(b)]
        for b in mixture(sources, seed=5, batch_size=batch).iter_batches()
    ]
    mix = mixture(sources, seed=5, batch_size=batch)
    mix.quarantine(bad)
    got = [[r.tobytes() for r in np.asarray(b)] for b in mix.iter_batches()]
    assert len(got) == len(expected)  # every batch keeps its place
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        keys = plain.explain(step * batch, batch)
        assert g == [
            row
            for row, k in zip(e, keys, strict=True)
            if (k["component"], k["path"], k["offset"]) not in bad_set
        ]
    # explain marks them; the quarantine travels in the state and a resumed run reproduces it
    marked = [k for k in mix.explain(0, len(mix)) if k.get("quarantined")]
    assert {(k["component"], k["path"], k["offset"]) for k in marked} == bad_set
    head = mixture(sources, seed=5, batch_size=batch)
    head.quarantine(bad)
    it = head.iter_batches()
    first = [[r.tobytes() for r in np.asarray(next(it))] for _ in range(min(cut, len(got)))]
    state = head.state_dict()
    assert len(state["quarantine"]) == len(bad_set)
    resumed = mixture(sources, seed=5, batch_size=batch)
    resumed.load_state_dict(state)
    rest = [[r.tobytes() for r in np.asarray(b)] for b in resumed.iter_batches()]
    assert first + rest == got


def test_quarantine_keys_are_checked(sources: list[list[str]]) -> None:
    mix = mixture(sources)
    key = mix.explain(0, 1)[0]
    with pytest.raises(ValueError):
        mix.quarantine([{**key, "offset": key["offset"] + 1}])
    with pytest.raises(ValueError):
        mix.quarantine([{**key, "component": 7}])
    with pytest.raises(ValueError):
        mix.quarantine([{k: v for k, v in key.items() if k != "component"}])
    mix.quarantine([(key["component"], key["path"], key["offset"], key["length"])])
    assert mix.explain(0, 1)[0].get("quarantined") is True
    # a leaf dataset takes (path, offset, length)
    ds = TokenWindows(sources[0], seq_len=SEQ, dtype="uint32", batch_size=4)
    path, offset, length = ds.explain(0, 1)[0]
    ds.quarantine([(path, offset, length)])
    assert ds.explain(0, 1)[0] == (path, offset, length)
    assert len(next(ds.iter_batches())) == 3


def test_files_and_nested_mixtures(sources: list[list[str]], tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    for i in range(60):
        (tmp_path / f"r{i:03d}.rec").write_bytes(rng.bytes(int(rng.integers(1, 90))))
    files = FileSamples(tmp_path)
    inner = Mixture(components(sources)[:2], weights=[1, 1], seed=9)
    mix = Mixture([inner, files], weights=[3, 1], seed=4, batch_size=5)
    batches = list(mix.iter_batches())
    flat = [s for b in batches for s in b]
    keys = mix.explain(0, len(mix))
    assert len(flat) == len(keys) == len(mix)
    for sample, key in zip(flat, keys, strict=True):
        data = sample.tobytes() if isinstance(sample, np.ndarray) else sample
        assert data == read(key["path"], key["offset"], key["length"])
    assert {k["component"] for k in keys} == {0, 1}
    # quarantine inside the nested mixture and in the files
    bad = [
        next(k for k in keys if k["component"] == 0),
        next(k for k in keys if k["component"] == 1),
    ]
    mix.quarantine(bad)
    assert sum(len(b) for b in mix.iter_batches()) == len(mix) - 2


def test_bad_mixtures(sources: list[list[str]]) -> None:
    with pytest.raises(ValueError):
        Mixture(components(sources), weights=[1, 1])
    with pytest.raises(ValueError):
        Mixture(components(sources))
    with pytest.raises(ValueError):
        Mixture(components(sources), weights=[1, 1, 1], exhausted="never")
    with pytest.raises(TypeError):
        Mixture([object()], weights=[1])
