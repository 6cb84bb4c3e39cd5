"""Where the samples are: token files, their windows, collections of files.

Token files are flat arrays of token ids: nanoGPT-style ``.bin`` files (raw
little-endian integers, the dtype given by the user) or ``.npy`` files (the
dtype and the data offset come from the header). One or many files form one
dataset. A sample is a *window* of ``seq_len + 1`` consecutive tokens (the
inputs and, shifted by one, the targets) starting at a multiple of
``stride`` inside one file; windows never cross a file boundary, so a window
is always one contiguous byte range of one file.

`WindowIndex` numbers the windows of all files consecutively (file 0's,
then file 1's, ...) and maps window numbers back to (file, byte offset) with
a cumulative count per file: O(number of files) memory, whatever the
number of windows, and vectorized over a batch.

Paths are local (any mounted filesystem) or ``shufflefs://`` URLs; `Namespace`
answers the few metadata questions building a dataset needs (sizes, a
header, a directory listing) for either kind.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from shufflefs.client.data.urls import Url, check_cluster, client_for, is_url, parse_url
from shufflefs.client.paths import normalize
from shufflefs.metadata.protocol import READDIR_MAX, Layout
from shufflefs.rpc.errors import FsError, first_fs_error

IntArray = npt.NDArray[np.int64]

NPY_MAGIC = b"\x93NUMPY"
HEADER_PROBE = 4096
DEFAULT_BIN_DTYPE = "uint16"  # nanoGPT's
MAX_PARALLEL_STATS = 64


@dataclass(frozen=True)
class TokenFile:
    path: str  # as given: a local path or a shufflefs:// URL
    data_offset: int  # bytes before the first token (a .npy header; 0 for .bin)
    num_tokens: int
    dtype: str  # numpy dtype string with byte order, e.g. "<u2"


# ---- metadata of local paths and URLs ----------------------------------------


WALK_PARALLEL = 8  # directories a native walk lists at once


class Namespace:
    """Sizes, headers and listings of local paths or of ``shufflefs://`` URLs
    (one kind per dataset), for building a dataset's index."""

    def __init__(self, paths: Sequence[str], config: str | None = None) -> None:
        kinds = {is_url(p) for p in paths}
        if len(kinds) > 1:
            raise ValueError("a dataset's paths must be all local paths or all shufflefs:// URLs")
        self.native = kinds == {True}
        self.config = config
        # (inode, layout) of the files a native `walk` listed: read without opening
        self.layouts: dict[str, tuple[int, Layout]] = {}
        if self.native:
            for mgmtd in {parse_url(p).mgmtd for p in paths}:
                check_cluster(Url(mgmtd, "/"), config)

    def sizes(self, paths: Sequence[str]) -> list[int]:
        if not self.native:
            out = []
            for p in paths:
                st = os.stat(p)
                if not stat.S_ISREG(st.st_mode):
                    raise IsADirectoryError(errno.EISDIR, f"{p} is not a regular file")
                out.append(st.st_size)
            return out
        client = client_for(self.config)
        fs_paths = [parse_url(p).path for p in paths]

        async def stat_all() -> list[int]:
            fs = client.fs
            assert fs is not None
            sizes = [0] * len(fs_paths)
            limit = trio.CapacityLimiter(MAX_PARALLEL_STATS)

            async def one(i: int) -> None:
                async with limit:
                    attr = await fs.resolve(fs_paths[i])
                if not stat.S_ISREG(attr["mode"]):
                    raise FsError(errno.EISDIR, f"{paths[i]} is not a regular file")
                sizes[i] = attr["size"]

            async with trio.open_nursery() as nursery:
                for i in range(len(fs_paths)):
                    nursery.start_soon(one, i)
            return sizes

        return client._run(stat_all)

    def read_prefix(self, path: str, size: int) -> bytes:
        if not self.native:
            with open(path, "rb") as f:
                return f.read(size)
        return client_for(self.config).pread(parse_url(path).path, 0, size)

    def walk(self, root: str) -> list[tuple[str, int]]:
        """(path, size) of every regular file under *root*, sorted by path
        (symlinks to files are followed, to directories not). Natively, one
        `readdir_layouts` request per directory (per 1024 entries), which
        also gives every file's layout (kept in `layouts`), `WALK_PARALLEL`
        directories at a time (one after the other, the walk waited for
        each round trip in turn, and the metadata server and this client
        took turns)."""
        if not self.native:
            found: list[tuple[str, int]] = []
            for dirpath, dirs, names in os.walk(root):
                dirs.sort()
                for name in names:
                    full = os.path.join(dirpath, name)
                    try:
                        st = os.stat(full)
                    except FileNotFoundError:
                        continue  # a dangling symlink
                    if stat.S_ISREG(st.st_mode):
                        found.append((full, st.st_size))
            return sorted(found)
        url = parse_url(root)
        client = client_for(self.config)

        async def walk_native() -> list[tuple[str, int]]:
            fs = client.fs
            assert fs is not None
            out: list[tuple[str, int]] = []
            top = normalize(url.path)
            attr = await fs.resolve(top)
            if stat.S_ISREG(attr["mode"]):
                return [(root, attr["size"])]
            room = trio.Semaphore(WALK_PARALLEL)

            async def list_dir(nursery: trio.Nursery, path: bytes, ino: int) -> None:
                async with room:
                    after: bytes | None = None
                    while True:
                        page = await fs.readdir_layouts(ino, after, READDIR_MAX)
                        for name, a, layout in page["entries"]:
                            child = path.rstrip(b"/") + b"/" + name
                            if stat.S_ISDIR(a["mode"]):
                                nursery.start_soon(list_dir, nursery, child, a["ino"])
                            elif stat.S_ISREG(a["mode"]) and layout is not None:
                                found = f"shufflefs://{url.mgmtd}{os.fsdecode(child)}"
                                out.append((found, a["size"]))
                                self.layouts[found] = (a["ino"], layout)
                        if not page["more"] or not page["entries"]:
                            break
                        after = page["entries"][-1][0]

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(list_dir, nursery, top, attr["ino"])
            except* FsError as group:
                raise first_fs_error(group) from None
            return sorted(out)

        return client._run(walk_native)

    def isdir(self, path: str) -> bool:
        if not self.native:
            return os.path.isdir(path)
        return client_for(self.config).isdir(parse_url(path).path)


# ---- token files -------------------------------------------------------------


def npy_header(prefix: bytes, path: str) -> tuple[int, np.dtype[Any], tuple[int, ...]]:
    """(data offset, dtype, shape) from the start of a .npy file."""
    f = io.BytesIO(prefix)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
    except (ValueError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable .npy file ({exc})") from None
    if fortran and len(shape) > 1:
        raise ValueError(f"{path}: a Fortran-ordered array is not a flat token sequence")
    if dtype.kind not in "iu" or dtype.hasobject:
        raise ValueError(f"{path}: token files hold integers, not {dtype}")
    return f.tell(), dtype, shape


def _npy_header_length(prefix: bytes) -> int:
    """Bytes the header of a .npy file occupies, from its first 12 bytes."""
    major = prefix[6]
    if major == 1:
        return 10 + int.from_bytes(prefix[8:10], "little")
    return 12 + int.from_bytes(prefix[8:12], "little")


def token_files(
    paths: Sequence[str], dtype: str | np.dtype[Any] | None, config: str | None = None
) -> list[TokenFile]:
    """Describe the token files of a dataset. ``.npy`` files carry their dtype;
    ``.bin`` (and any other) files are raw arrays of *dtype*; when it is not
    given, of the dtype of the dataset's ``.npy`` files, or else uint16
    (nanoGPT's). Every file of a dataset must have the same dtype."""
    if not paths:
        raise ValueError("a dataset needs at least one file")
    ns = Namespace(paths, config)
    sizes = ns.sizes(paths)
    wanted = np.dtype(dtype) if dtype is not None else None
    if wanted is not None and (wanted.kind not in "iu" or wanted.hasobject):
        raise ValueError(f"token dtype must be an integer type, not {wanted}")
    headers: dict[int, tuple[int, np.dtype[Any], int]] = {}  # .npy: offset, dtype, count
    for i, (path, size) in enumerate(zip(paths, sizes, strict=True)):
        if not path.endswith(".npy"):
            continue
        prefix = ns.read_prefix(path, HEADER_PROBE)
        if prefix[:6] == NPY_MAGIC and len(prefix) >= 12:
            need = _npy_header_length(prefix)
            if need > len(prefix):
                prefix = ns.read_prefix(path, need)
        offset, dt, shape = npy_header(prefix, path)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if offset + count * dt.itemsize > size:
            raise ValueError(f"{path}: the header promises more data than the file holds")
        if wanted is not None and dt != wanted:
            raise ValueError(f"{path} holds {dt}, not the dataset's {wanted}")
        headers[i] = (offset, dt, count)
    if wanted is None:
        found = {dt.str for _, dt, _ in headers.values()}
        wanted = np.dtype(found.pop() if len(found) == 1 else DEFAULT_BIN_DTYPE)
    files: list[TokenFile] = []
    for i, (path, size) in enumerate(zip(paths, sizes, strict=True)):
        if i in headers:
            offset, dt, count = headers[i]
        else:
            offset, dt, count = 0, wanted, size // wanted.itemsize
        files.append(TokenFile(path, offset, count, dt.str))
    dtypes = {f.dtype for f in files}
    if len(dtypes) > 1:
        raise ValueError(f"the files of a dataset must share one dtype, found {sorted(dtypes)}")
    return files


class WindowIndex:
    """Windows of ``seq_len + 1`` tokens at every ``stride`` tokens of each
    file, numbered across files. Window ``w`` of file ``f`` starts at token
    ``(w - first[f]) * stride`` of that file."""

    def __init__(self, files: Sequence[TokenFile], seq_len: int, stride: int) -> None:
        if seq_len < 1:
            raise ValueError("seq_len must be at least 1")
        if stride < 1:
            raise ValueError("stride must be at least 1")
        self.files = list(files)
        self.seq_len = seq_len
        self.stride = stride
        self.window = seq_len + 1
        self.dtype = np.dtype(self.files[0].dtype)
        self.itemsize = self.dtype.itemsize
        counts = [
            (f.num_tokens - self.window) // stride + 1 if f.num_tokens >= self.window else 0
            for f in self.files
        ]
        self.counts = np.asarray(counts, dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.num_windows = int(self.first[-1])
        self.data_offsets = np.asarray([f.data_offset for f in self.files], dtype=np.int64)
        self.paths = [f.path for f in self.files]

    @property
    def window_bytes(self) -> int:
        return self.window * self.itemsize

    def locate(self, windows: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """(file index, byte offset in that file) of each window."""
        w = np.asarray(windows, dtype=np.int64)
        if w.size and (w.min() < 0 or w.max() >= self.num_windows):
            raise IndexError(f"window outside [0, {self.num_windows})")
        f = np.searchsorted(self.first, w, side="right").astype(np.int64) - 1
        token = (w - self.first[f]) * self.stride
        return f, self.data_offsets[f] + token * self.itemsize
