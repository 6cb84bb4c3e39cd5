"""Training-data reads through a real cluster: the FUSE mount and the native client
give exactly the batches of a local copy, with real DataLoader worker processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pandas as pd
import pytest
import torch
from clusters import ProcessCluster
from tokendata import write_tokens
from torch.utils.data import DataLoader

from shufflefs.client import Client
from shufflefs.client.data import FileDataset, ShuffleLoader, TokenWindowDataset
from shufflefs.client.data.urls import client_for
from shufflefs.client.read_engine import MAX_REQUEST_ITEMS
from shufflefs.cluster.config import load_client_config

SEQ = 256
BATCH = 32
# sizes chosen so files span several 1 MiB chunks and windows straddle chunk ends
FILES = {"a.bin": 1_300_001, "b.npy": 700_003, "c.bin": 90_001}


class Places:
    def __init__(self, local: Path, mount: Path, url: str, config: str) -> None:
        self.local = local
        self.mount = mount
        self.url = url
        self.config = config

    def paths(self, where: str, names: list[str]) -> list[str]:
        if where == "local":
            return [str(self.local / n) for n in names]
        if where == "fuse":
            return [str(self.mount / n) for n in names]
        return [f"{self.url}/{n}" for n in names]


@pytest.fixture(scope="module")
def places(mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Places:
    local = tmp_path_factory.mktemp("data-local")
    write_tokens(local, FILES, dtype="uint16")
    files = local / "files"
    files.mkdir()
    rng = np.random.default_rng(3)
    for i in range(90):
        (files / f"rec{i:03d}.bin").write_bytes(rng.bytes(int(rng.integers(0, 40_000))))
    mount = mounted.mountpoint / "data-tests"
    shutil.copytree(local, mount)
    mgmtd = load_client_config(mounted.client_config)[0].mgmtd
    return Places(local, mount, f"shufflefs://{mgmtd}/data-tests", str(mounted.client_config))


def tokens(places: Places, where: str, readahead: int = 0) -> TokenWindowDataset:
    return TokenWindowDataset(
        places.paths(where, list(FILES)),
        seq_len=SEQ,
        dtype="uint16",
        seed=11,
        batch_size=BATCH,
        readahead=readahead,
        config=places.config,
    )


def batches(ds: Any, epoch: int, workers: int = 2) -> list[bytes]:
    ds.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=workers)
    return [b.numpy().tobytes() for b in loader]


def test_dataloader_batches_identical_on_mount_native_and_local(places: Places) -> None:
    local = tokens(places, "local")
    n = -(-len(local) // BATCH)
    for epoch in (0, 1):
        expected = batches(local, epoch)
        assert len(expected) == n
        assert batches(tokens(places, "fuse"), epoch) == expected
        assert batches(tokens(places, "fuse", readahead=3), epoch) == expected
        assert batches(tokens(places, "native"), epoch) == expected
        # readahead along the shuffle, and a parent that is already connected
        # when the workers fork (they inherit the client and reconnect)
        native = tokens(places, "native", readahead=4)
        native.set_epoch(epoch)
        first = next(native.iter_batches())
        assert first.numpy().tobytes() == expected[0]
        assert batches(native, epoch) == expected


def test_native_readahead_in_one_process_and_resume(places: Places) -> None:
    expected = [b.numpy().tobytes() for b in tokens(places, "local").iter_batches()]
    native = tokens(places, "native", readahead=4)
    it = native.iter_batches()
    head = [next(it).numpy().tobytes() for _ in range(5)]
    it.close()
    state = native.state_dict()
    assert state["consumed"] == 5 * BATCH
    again = tokens(places, "native", readahead=2)
    again.load_state_dict(state)
    assert head + [b.numpy().tobytes() for b in again.iter_batches()] == expected
    native.close()
    again.close()


def test_explain_names_native_bytes(places: Places) -> None:
    ds = tokens(places, "native", readahead=2)
    ds.set_epoch(4)
    client = client_for(places.config)
    for step, batch in enumerate(ds.iter_batches()):
        if step == 40:
            break
        if step % 4:
            continue
        for row, (url, offset, length) in zip(batch, ds.explain(step * BATCH, BATCH), strict=True):
            assert url.startswith("shufflefs://")
            path = url.split("/", 3)[3]
            assert client.pread("/" + path, offset, length) == row.numpy().tobytes()
    ds.close()


def test_cli_explain_with_urls(places: Places) -> None:
    urls = places.paths("native", list(FILES))
    result = subprocess.run(
        [sys.executable, "-m", "shufflefs.cluster.cli", "sample", "explain",
         "--seed", "11", "--epoch", "1", "--step", "3", "--batch-size", str(BATCH),
         "--seq-len", str(SEQ), "--dtype", "uint16", "--config", places.config, "--json", *urls],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    named = [
        (s["path"], s["byte_offset"], s["byte_length"])
        for s in json.loads(result.stdout)["samples"]
    ]
    ds = tokens(places, "local")
    assert [(os.path.basename(p), o, n) for p, o, n in named] == [
        (os.path.basename(p), o, n) for p, o, n in ds.explain(3 * BATCH, BATCH, epoch=1)
    ]


def test_file_dataset_identical_everywhere(places: Places) -> None:
    def run(where: str, workers: int) -> list[list[bytes]]:
        root = {
            "local": str(places.local / "files"),
            "fuse": str(places.mount / "files"),
            "native": f"{places.url}/files",
        }[where]
        ds = FileDataset(root, seed=5, batch_size=8, config=places.config, readahead=2)
        assert len(ds) == 90
        ds.set_epoch(2)
        return [list(b) for b in ShuffleLoader(ds, num_workers=workers)]

    expected = run("local", 0)
    assert run("local", 2) == expected
    assert run("fuse", 2) == expected
    assert run("native", 2) == expected
    # iterating the dataset itself: the same order, read ahead
    native = FileDataset(f"{places.url}/files", seed=5, batch_size=8, config=places.config)
    native.set_epoch(2)
    assert [list(b) for b in native.iter_batches()] == expected
    native.close()


def test_batched_reads_across_files_split_per_request(places: Places) -> None:
    """More ranges than one request may carry, over three files and across
    chunk boundaries, read in one call: every byte matches a local pread."""
    client = client_for(places.config)
    names = list(FILES)
    local = [(places.local / n).read_bytes() for n in names]
    rng = np.random.default_rng(9)
    picks = []
    for _ in range(MAX_REQUEST_ITEMS + 500):
        f = int(rng.integers(0, len(names)))
        length = int(rng.integers(0, 64))
        offset = int(rng.integers(0, len(local[f]) - length))
        picks.append((f, offset, length))
    picks.append((0, (1 << 20) - 1000, 5000))  # straddles a chunk boundary

    async def go() -> list[bytes]:
        fs = client.fs
        assert fs is not None
        opened = [await fs.open_path(f"/data-tests/{n}".encode(), os.O_RDONLY) for n in names]
        try:
            extents = [(opened[f][0].ino, opened[f][0].layout, o, n) for f, o, n in picks]
            buf = bytearray(sum(n for _, _, n in picks))
            await fs.read_into(extents, memoryview(buf))
            out, pos = [], 0
            for _, _, n in picks:
                out.append(bytes(buf[pos : pos + n]))
                pos += n
            return out
        finally:
            for f, _ in opened:
                await fs.release(f.fh)

    got = client._run(go)
    assert got == [local[f][o : o + n] for f, o, n in picks]


def test_forked_child_reconnects_with_inherited_client(mounted: ProcessCluster) -> None:
    with Client(mounted.client_config) as client:
        client.write_bytes("/fork-probe.bin", b"inherited")
        assert client.listdir("/")  # connected in the parent
        pid = os.fork()
        if pid == 0:
            try:
                ok = client.pread("/fork-probe.bin", 0, 9) == b"inherited"
                ok = ok and "fork-probe.bin" in client.listdir("/")
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert client.pread("/fork-probe.bin", 0, 9) == b"inherited"  # the parent still works
        client.unlink("/fork-probe.bin")


def test_fsspec_and_pandas_read_without_a_mount(places: Places, mounted: ProcessCluster) -> None:
    opts = {"config": places.config}
    table = pd.DataFrame({"x": np.arange(500), "y": np.arange(500) * 0.5})
    table.to_csv(places.mount / "table.csv", index=False)
    assert pd.read_csv(f"{places.url}/table.csv", storage_options=opts).equals(table)

    url = f"{places.url}/a.bin"
    with fsspec.open(url, "rb", **opts) as f:
        f.seek(1_000_000)
        assert f.read(100) == (places.local / "a.bin").read_bytes()[1_000_000:1_000_100]
    fs, path = fsspec.core.url_to_fs(url, **opts)
    assert path == "/data-tests/a.bin"
    assert fs.info(path)["size"] == FILES["a.bin"] * 2
    listing = {Path(i["name"]).name: i for i in fs.ls("/data-tests")}
    assert {"a.bin", "b.npy", "c.bin", "files", "table.csv"} <= set(listing)
    assert listing["files"]["type"] == "directory"
    assert fs.cat_file(path, 10, 20) == (places.local / "a.bin").read_bytes()[10:20]
    fs.makedirs("/data-tests/out", exist_ok=True)
    fs.pipe_file("/data-tests/out/new.txt", b"written by fsspec")
    assert (places.mount / "out" / "new.txt").read_bytes() == b"written by fsspec"
    with fs.open("/data-tests/out/text.txt", "w") as t:
        t.write("line\n")
    assert fs.cat("/data-tests/out/text.txt") == b"line\n"
    fs.rm("/data-tests/out", recursive=True)
    assert not fs.exists("/data-tests/out")  # (the mount may cache the entry for 1 s)
    # a URL without an address means the config's cluster
    with fsspec.open("shufflefs:///data-tests/c.bin", "rb", **opts) as f:
        assert f.read(6) == (places.local / "c.bin").read_bytes()[:6]
    # a URL naming another cluster than the config's is refused
    host, port = places.url.split("/")[2].rsplit(":", 1)
    with pytest.raises(ValueError, match="client config"):
        fsspec.open(f"shufflefs://{host}:{int(port) + 1}/x", "rb", **opts).open()
    with pytest.raises(ValueError, match="client config"):
        TokenWindowDataset([f"shufflefs://{host}:{int(port) + 1}/x.bin"], config=places.config)
    with pytest.raises(FileNotFoundError):
        fs.info("/data-tests/missing")


@pytest.mark.usefixtures("kernel_caches")  # its cold rows drop them
def test_bench_loader_runs_every_row(mounted: ProcessCluster, tmp_path: Path) -> None:
    plot = tmp_path / "loader.png"
    result = subprocess.run(
        [sys.executable, "-m", "shufflefs.cluster.cli", "bench", "loader",
         "--config", str(mounted.client_config), "--mountpoint", str(mounted.mountpoint),
         "--local-dir", str(tmp_path / "local"), "--remote-dir", "/bench-test",
         "--dataset-size", "6M", "--files", "2", "--seq-len", "128",
         "--batch-sizes", "8,64", "--seconds", "0.05", "--readahead", "2",
         "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["dataset"]["bytes"] == 6 << 20
    rows = {(r["phase"], r["config"], r["batch_size"]) for r in report["results"]}
    configs = ("local", "local+ra", "fuse", "fuse+ra", "native", "native+ra")
    configs += tuple(f"{c} mix" for c in configs)  # each also read as a 3-component mixture
    assert rows == {(p, c, b) for p in ("cold", "warm") for c in configs for b in (8, 64)}
    for r in report["results"]:
        assert r["tokens_per_s"] > 0 and r["batches"] >= 1
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 128)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a rerun reuses the dataset and prints the tables
    again = subprocess.run(
        [sys.executable, "-m", "shufflefs.cluster.cli", "bench", "loader",
         "--config", str(mounted.client_config), "--mountpoint", str(mounted.mountpoint),
         "--local-dir", str(tmp_path / "local"), "--remote-dir", "/bench-test",
         "--dataset-size", "6M", "--files", "2", "--seq-len", "128", "--batch-sizes", "16",
         "--seconds", "0.1", "--configs", "local,native+ra", "--no-cold"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "wrote" not in again.stderr
    assert "warm: the same windows read again" in again.stdout
    assert "native+ra" in again.stdout and "cold:" not in again.stdout


def test_tensor_types(places: Places) -> None:
    ds = tokens(places, "native")
    sample = next(iter(ds))
    assert isinstance(sample, torch.Tensor) and sample.dtype == torch.uint16
    assert sample.shape == (SEQ + 1,)
    wide = TokenWindowDataset(
        places.paths("native", list(FILES)), seq_len=SEQ, config=places.config, out_dtype="int64"
    )
    assert next(iter(wide)).dtype == torch.int64
    ds.close()
    wide.close()
