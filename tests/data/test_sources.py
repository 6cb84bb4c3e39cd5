"""Token files (.bin with a user dtype, .npy via its header), windows, file collections."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from tokendata import window_starts, write_tokens

from shufflefs.client.data.files import FileSamples
from shufflefs.client.data.readers import LocalReader
from shufflefs.client.data.sources import WindowIndex, token_files
from shufflefs.client.data.tokens import TokenWindows


def all_windows(ds: TokenWindows) -> np.ndarray:
    ds.batch_size = 64
    return np.concatenate(list(ds.iter_batches()))


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "uint8"])
@pytest.mark.parametrize("npy_version", [(1, 0), (2, 0)])
def test_bin_and_npy_windows_are_file_slices(
    tmp_path: Path, dtype: str, npy_version: tuple[int, int]
) -> None:
    files = {"x.bin": 301, "y.npy": 97, "z.bin": 17, "w.npy": 250}
    paths = write_tokens(tmp_path, files, dtype=dtype, npy_version=npy_version)
    seq, stride = 16, 1  # every window at every token: the boundary cases all occur
    ds = TokenWindows(paths, seq_len=seq, stride=stride, dtype=dtype, seed=1)
    windows = all_windows(ds)
    starts = window_starts(files, seq, stride)
    assert len(windows) == ds.num_windows == len(starts)
    assert windows.dtype == np.dtype(dtype)
    # a window is seq_len + 1 consecutive tokens of ONE file (the counter never
    # jumps inside a window, and % 256 wraps only for uint8)
    steps = np.diff(windows.astype(np.int64), axis=1) % (256 if dtype == "uint8" else 2**32)
    assert (steps == 1).all()
    if dtype != "uint8":
        assert sorted(windows[:, 0].tolist()) == starts


def test_dtype_comes_from_npy_headers_and_must_agree(tmp_path: Path) -> None:
    a = write_tokens(tmp_path / "a", {"a.npy": 100, "b.bin": 100}, dtype="uint32")
    assert {f.dtype for f in token_files(a, None)} == {"<u4"}  # .bin follows the .npy
    with pytest.raises(ValueError, match="not the dataset's"):
        token_files(a, "uint16")
    b = write_tokens(tmp_path / "b", {"c.npy": 100}, dtype="uint16")
    with pytest.raises(ValueError, match="share one dtype"):
        token_files([a[0], b[0]], None)
    with pytest.raises(ValueError, match="integer"):
        token_files(a[1:], "float32")
    with pytest.raises(ValueError):
        token_files([], None)
    with pytest.raises(ValueError, match="all local paths or all"):
        token_files([a[1], "shufflefs://127.0.0.1:1/x.bin"], "uint32")
    with pytest.raises(FileNotFoundError):
        token_files([str(tmp_path / "nope.bin")], "uint16")


def test_npy_header_variants(tmp_path: Path) -> None:
    grid = (np.arange(600, dtype=np.int64) + 5).astype(">u2").reshape(20, 30)  # big-endian, 2-D
    np.save(tmp_path / "g.npy", grid)
    ds = TokenWindows([str(tmp_path / "g.npy")], seq_len=9, seed=0)
    got = all_windows(ds)
    assert got.dtype.isnative
    assert sorted(got[:, 0].tolist()) == [5 + s for s in range(0, 600 - 9, 9)]
    np.save(tmp_path / "f.npy", np.asfortranarray(grid))
    with pytest.raises(ValueError, match="Fortran"):
        TokenWindows([str(tmp_path / "f.npy")], seq_len=9)
    np.save(tmp_path / "fl.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(ValueError, match="integers"):
        TokenWindows([str(tmp_path / "fl.npy")], seq_len=3)
    (tmp_path / "bad.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match=r"not a readable \.npy"):
        TokenWindows([str(tmp_path / "bad.npy")], seq_len=3)
    with open(tmp_path / "cut.npy", "wb") as f:
        np.lib.format.write_array(f, np.arange(100, dtype=np.uint16))
    os.truncate(tmp_path / "cut.npy", 150)
    with pytest.raises(ValueError, match="promises more"):
        TokenWindows([str(tmp_path / "cut.npy")], seq_len=3)


def test_window_index_counts_and_locations(tmp_path: Path) -> None:
    paths = write_tokens(tmp_path, {"a.bin": 100, "b.bin": 10, "c.npy": 33}, dtype="uint16")
    files = token_files(paths, "uint16")
    idx = WindowIndex(files, seq_len=10, stride=4)
    # a: starts 0..89 step 4 -> 23; b: 10 tokens < 11 -> 0; c: 0..22 step 4 -> 6
    assert idx.counts.tolist() == [23, 0, 6]
    f, off = idx.locate([0, 22, 23, 28])
    assert f.tolist() == [0, 0, 2, 2]
    header = files[2].data_offset
    assert off.tolist() == [0, 22 * 4 * 2, header, header + 5 * 4 * 2]
    with pytest.raises(IndexError):
        idx.locate([29])
    with pytest.raises(ValueError):
        WindowIndex(files, seq_len=0, stride=1)
    with pytest.raises(ValueError):
        WindowIndex(files, seq_len=4, stride=0)


def test_overlapping_windows_count_n_over_stride(tmp_path: Path) -> None:
    n, seq = 100_000, 1024
    paths = write_tokens(tmp_path, {"t.bin": n}, dtype="uint16")
    for stride in (1, 8, 256, seq):
        ds = TokenWindows(paths, seq_len=seq, stride=stride, dtype="uint16")
        assert ds.num_windows == (n - seq - 1) // stride + 1
    assert TokenWindows(paths, seq_len=seq, dtype="uint16").stride == seq


def test_local_reader_survives_pickle_and_fork(tmp_path: Path) -> None:
    import pickle

    paths = write_tokens(tmp_path, {"a.bin": 1000}, dtype="uint32")
    reader = LocalReader(paths, threads=2)
    out = np.empty(8, dtype=np.uint8)
    files = np.array([0, 0]), np.array([0, 400]), np.array([4, 4])
    reader.read_into(*files, out.data)
    assert out.view("<u4").tolist() == [0, 100]
    clone = pickle.loads(pickle.dumps(reader))
    clone.submit(*files, out.data).result()
    assert out.view("<u4").tolist() == [0, 100]
    pid = os.fork()
    if pid == 0:  # the child gets its own descriptors and threads
        try:
            child = np.zeros(8, dtype=np.uint8)
            reader.submit(*files, child.data).result(timeout=10)
            os._exit(0 if child.view("<u4").tolist() == [0, 100] else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    reader.close()
    clone.close()
    with pytest.raises(OSError, match="shrank"):
        LocalReader(paths).read_into(np.array([0]), np.array([3990]), np.array([20]), out.data)


def test_file_collection(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    content = {}
    for sub in ("b", "a", "a/deep"):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        for i in range(7):
            data = rng.bytes(int(rng.integers(0, 5000)))
            name = f"{sub}/{i}.jpg" if i % 3 else f"{sub}/{i}.txt"
            (tmp_path / name).write_bytes(data)
            content[str(tmp_path / name)] = data
    os.symlink(tmp_path / "gone", tmp_path / "dangling.jpg")
    ds = FileSamples(tmp_path, seed=1, batch_size=5)
    assert ds.files == sorted(content)
    assert len(ds) == len(content)
    assert ds[3] == content[ds.files[3]]
    assert ds.__getitems__([5, 0, 5]) == [content[ds.files[i]] for i in (5, 0, 5)]
    got = [x for batch in ds.iter_batches() for x in batch]
    assert sorted(got) == sorted(content.values())
    only = FileSamples(str(tmp_path), suffixes=[".txt"], transform=len)
    assert len(only) == 9
    assert sorted(only) == sorted(len(v) for k, v in content.items() if k.endswith(".txt"))
    listed = FileSamples(sorted(content)[:4], seed=0)
    assert len(listed) == 4
    with pytest.raises(ValueError, match="no files"):
        FileSamples(str(tmp_path), suffixes=[".png"])
    with pytest.raises(IndexError):
        ds[len(ds)]
