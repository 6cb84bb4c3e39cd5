"""explain(step) names exactly the bytes that step delivered, from the API and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokendata import shufflefs_cli, write_tokens

from shufflefs.client.data.files import FileSamples
from shufflefs.client.data.tokens import TokenWindows

SEQ = 48


def read(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_tokens(tmp_path_factory.mktemp("tokens"), dtype="uint16")


@pytest.mark.parametrize("stride", [None, 1, 7])
def test_explain_names_the_bytes_each_step_delivered(paths: list[str], stride: int | None) -> None:
    batch = 10
    for rank in range(2):
        ds = TokenWindows(
            paths, seq_len=SEQ, stride=stride, seed=8, rank=rank, world_size=2, batch_size=batch
        )
        ds.set_epoch(3)
        for step, got in enumerate(ds.iter_batches()):
            named = ds.explain(step * batch, batch)
            assert len(named) == len(got)
            for row, (path, offset, length) in zip(got, named, strict=True):
                assert length == (SEQ + 1) * 2
                assert read(path, offset, length) == row.tobytes()
            if step > 40:
                break


def test_explain_step_is_every_ranks_batch(paths: list[str]) -> None:
    world, batch = 3, 5
    ranks = [
        TokenWindows(paths, seq_len=SEQ, seed=2, rank=r, world_size=world, batch_size=batch)
        for r in range(world)
    ]
    for step in (0, 4, 9):
        everyone = ranks[0].explain_step(step, epoch=1)
        assert [(s.path, s.byte_offset, s.byte_length) for s in everyone] == [
            x for r in ranks for x in r.explain(step * batch, batch, epoch=1)
        ]
        assert [s.rank for s in everyone] == [r for r in range(world) for _ in range(batch)]
    # past the epoch's end: nothing
    last = len(ranks[0]) // batch + 1
    assert ranks[0].explain_step(last) == []


def test_cli_explain_matches_the_run(paths: list[str]) -> None:
    batch, step, world = 6, 11, 2
    result = shufflefs_cli(
        "sample", "explain", "--seed", "4", "--epoch", "2", "--step", str(step),
        "--batch-size", str(batch), "--seq-len", str(SEQ), "--dtype", "uint16",
        "--world-size", str(world), "--json", *paths,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["step"] == step and len(report["samples"]) == batch * world
    # what each rank's run actually delivered at that step
    for rank in range(world):
        ds = TokenWindows(paths, seq_len=SEQ, seed=4, rank=rank, world_size=world, batch_size=batch)
        ds.set_epoch(2)
        delivered = next(b for i, b in enumerate(ds.iter_batches()) if i == step)
        named = [s for s in report["samples"] if s["rank"] == rank]
        assert [read(s["path"], s["byte_offset"], s["byte_length"]) for s in named] == [
            row.tobytes() for row in delivered
        ]

    text = shufflefs_cli(
        "sample", "explain", "--seed", "4", "--epoch", "2", "--step", str(step),
        "--batch-size", str(batch), "--seq-len", str(SEQ), "--dtype", "uint16",
        "--world-size", str(world), "--rank", "1", *paths,
    )  # fmt: skip
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[1].split()[:3] == ["rank", "position", "window"]
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == batch
    mine = [s for s in report["samples"] if s["rank"] == 1]
    assert [(r[0], int(r[3]), int(r[4]), r[5]) for r in rows] == [
        ("1", s["byte_offset"], s["byte_length"], s["path"]) for s in mine
    ]


def test_cli_reports_mistakes_in_one_line(paths: list[str], tmp_path: Path) -> None:
    bad = shufflefs_cli(
        "sample", "explain", "--seed", "0", "--epoch", "0", "--step", "0",
        "--batch-size", "4", str(tmp_path / "missing.bin"),
    )  # fmt: skip
    assert bad.returncode == 1
    assert "missing.bin" in bad.stderr and "Traceback" not in bad.stderr
    zero = shufflefs_cli(
        "sample", "explain", "--seed", "0", "--epoch", "0", "--step", "0",
        "--batch-size", "0", *paths,
    )  # fmt: skip
    assert zero.returncode == 2


def test_files_explain(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for i in range(40):
        (tmp_path / f"{i:03d}.rec").write_bytes(rng.bytes(int(rng.integers(1, 200))))
    ds = FileSamples(tmp_path, seed=3, rank=1, world_size=2, batch_size=4)
    ds.set_epoch(5)
    for step, got in enumerate(ds.iter_batches()):
        named = ds.explain(step * 4, 4)
        assert [Path(p).read_bytes() for p, _, _ in named] == got
        assert all(off == 0 and n == Path(p).stat().st_size for p, off, n in named)
    result = shufflefs_cli(
        "sample", "explain", "--files", "--seed", "3", "--epoch", "5", "--step", "2",
        "--batch-size", "4", "--world-size", "2", "--rank", "1", "--json", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    named = [
        (s["path"], s["byte_offset"], s["byte_length"])
        for s in json.loads(result.stdout)["samples"]
    ]
    assert named == ds.explain(8, 4)
