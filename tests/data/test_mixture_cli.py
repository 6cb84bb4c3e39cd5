"""The mixture config, `shufflefs sample explain --mixture` and `shufflefs sample quarantine`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokendata import shufflefs_cli, write_tokens

from shufflefs.client.data.config import load_mixture

SEQ = 16


@pytest.fixture
def run(tmp_path: Path) -> Path:
    write_tokens(tmp_path / "web", {"w0.bin": 2001, "w1.bin": 1501})
    write_tokens(tmp_path / "code", {"c0.npy": 1201})
    files = tmp_path / "img"
    files.mkdir()
    for i in range(40):
        (files / f"{i:03d}.rec").write_bytes(f"record {i}".encode() * (i + 1))
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        """
seed = 7
seq_len = 16
dtype = "uint32"
global_batch_size = 12
exhausted = "repeat"
samples_per_epoch = 600
quarantine = "quarantine.json"

[[source]]
name = "web"
paths = ["web/*.bin"]

[[source]]
name = "code"
paths = ["code/c0.npy"]

[[source]]
name = "images"
files = true
paths = ["img"]

[[schedule]]
step = 0
weights = [0.8, 0.1, 0.1]

[[schedule]]
step = 10
weights = [0.5, 0.3, 0.2]
"""
    )
    return cfg


def read(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_config_builds_the_mixture(run: Path) -> None:
    mix = load_mixture(run, rank=1, world_size=3, batch_size=4)
    assert len(mix.components) == 3 and mix.shard.n == 600
    assert mix.schedule.as_list() == [[0, [8, 1, 1]], [120, [5, 3, 2]]]
    assert mix.seed == 7 and mix.world_size == 3


@pytest.mark.e2e  # runs `shufflefs` processes
def test_explain_and_quarantine_from_the_shell(run: Path) -> None:
    base = ("sample", "explain", "--mixture", str(run), "--epoch", "1", "--step", "12",
            "--batch-size", "4", "--world-size", "3")  # fmt: skip
    out = shufflefs_cli(*base, "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["samples"]
    assert len(rows) == 12 and {r["rank"] for r in rows} == {0, 1, 2}
    # exactly what each rank delivers at that step
    for rank in range(3):
        mix = load_mixture(run, rank=rank, world_size=3, batch_size=4)
        mix.set_epoch(1)
        batch = next(b for i, b in enumerate(mix.iter_batches()) if i == 12)
        mine = [r for r in rows if r["rank"] == rank]
        got = [s if isinstance(s, bytes) else np.asarray(s).tobytes() for s in batch]
        assert got == [read(r["path"], r["offset"], r["length"]) for r in mine]

    bad = rows[5]
    key = f"{bad['component']}:{bad['path']}:{bad['offset']}:{bad['length']}"
    q = shufflefs_cli("sample", "quarantine", "--mixture", str(run), "--add", key)
    assert q.returncode == 0, q.stderr
    assert (
        json.loads((run.parent / "quarantine.json").read_text())["keys"][0]["offset"]
        == bad["offset"]
    )
    again = shufflefs_cli(*base, "--json")
    marked = [r for r in json.loads(again.stdout)["samples"] if r.get("quarantined")]
    assert [(r["path"], r["offset"]) for r in marked] == [(bad["path"], bad["offset"])]
    # the training side reads the same file: that sample is skipped, its batch is one shorter
    mix = load_mixture(run, rank=bad["rank"], world_size=3, batch_size=4)
    mix.set_epoch(1)
    assert len(next(b for i, b in enumerate(mix.iter_batches()) if i == 12)) == 3
    text = shufflefs_cli(*base)
    assert "(quarantined)" in text.stdout
    # a key that names no sample is refused and the file stays as it was
    wrong = shufflefs_cli("sample", "quarantine", "--mixture", str(run), "--add", key[:-2] + "99")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    report = run.parent / "step.json"
    report.write_text(again.stdout)
    many = shufflefs_cli("sample", "quarantine", "--mixture", str(run), "--from", str(report),
                         "--rank", "2", "--json")  # fmt: skip
    assert many.returncode == 0, many.stderr
    assert len(json.loads(many.stdout)["keys"]) == 1 + sum(1 for r in rows if r["rank"] == 2) - (
        bad["rank"] == 2
    )
    gone = shufflefs_cli("sample", "quarantine", "--mixture", str(run), "--remove", key, "--json")
    assert key.split(":")[-2] not in [
        str(k["offset"]) for k in json.loads(gone.stdout)["keys"] if k["path"] == bad["path"]
    ]


@pytest.mark.e2e  # runs `shufflefs` processes
def test_cli_mistakes(run: Path) -> None:
    none = shufflefs_cli("sample", "explain", "--epoch", "0", "--step", "0", "--batch-size", "2")
    assert none.returncode == 2
    broken = run.parent / "broken.toml"
    broken.write_text("seed = 1\n[[source]]\npaths = []\n")
    out = shufflefs_cli("sample", "explain", "--mixture", str(broken), "--epoch", "0",
                        "--step", "0", "--batch-size", "2")  # fmt: skip
    assert out.returncode == 1 and "no paths" in out.stderr
