"""``shufflefs://`` for fsspec: pandas, pyarrow, xarray... read without a mount.

    import fsspec, pandas as pd
    with fsspec.open("shufflefs://10.0.0.5:8000/tables/a.csv") as f: ...
    pd.read_csv("shufflefs://10.0.0.5:8000/tables/a.csv")
    fs = fsspec.filesystem("shufflefs", config="/etc/shufflefs/client.toml")

Registered through the ``fsspec.specs`` entry point (install the ``fsspec``
extra). ``host:port`` is mgmtd's address; the secret comes from the client
config (``config=`` storage option, else ``$SHUFFLEFS_CONFIG``, else
``./.shufflefs/client.toml``), which must be for that same mgmtd. Files are
the native client's own (buffered, seekable, positioned reads straight from
the storage daemons); everything else maps to one metadata call.
"""

from __future__ import annotations

import datetime
import os
import stat
from typing import Any

from fsspec.spec import AbstractFileSystem
from fsspec.utils import stringify_path

from shufflefs.client.data.urls import PREFIX, Url, check_cluster, client_for, parse_url
from shufflefs.client.native import Client
from shufflefs.client.paths import normalize
from shufflefs.metadata.protocol import Attr


def _info(path: str, attr: Attr) -> dict[str, Any]:
    mode = attr["mode"]
    kind = "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
    if stat.S_ISLNK(mode):
        kind = "link"
    return {
        "name": path,
        "size": attr["size"] if kind == "file" else 0,
        "type": kind,
        "mode": mode,
        "ino": attr["ino"],
        "nlink": attr["nlink"],
        "uid": attr["uid"],
        "gid": attr["gid"],
        "mtime": attr["mtime"] / 1e9,
        "ctime": attr["ctime"] / 1e9,
    }


class ShufflefsFileSystem(AbstractFileSystem):
    """A shufflefs cluster as an fsspec filesystem (native client, no mount)."""

    protocol = "shufflefs"
    root_marker = "/"

    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        config: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(host=host, port=port, config=config, **kwargs)
        self.mgmtd = f"{host}:{port}" if host else ""
        self.config = os.fspath(config) if config is not None else None
        self.config_path = str(check_cluster(Url(self.mgmtd, "/"), self.config))

    @property
    def client(self) -> Client:
        return client_for(self.config_path)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = stringify_path(path)
        if path.startswith(PREFIX):
            path = parse_url(path).path
        p = os.fsdecode(normalize(path))
        return p.rstrip("/") or "/"

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        if not path.startswith(PREFIX):
            return {}
        url = parse_url(path)
        if not url.mgmtd:
            return {}
        host, _, port = url.mgmtd.rpartition(":")
        return {"host": host.strip("[]"), "port": int(port)}

    def unstrip_protocol(self, name: str) -> str:
        return f"{PREFIX}{self.mgmtd}{self._strip_protocol(name)}"

    # ---- metadata ----------------------------------------------------------

    def _stat(self, path: str) -> Attr:
        fs = self.client

        async def resolve() -> Attr:
            assert fs.fs is not None
            return await fs.fs.resolve(os.fsencode(path))

        return fs._run(resolve)

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        p = self._strip_protocol(path)
        return _info(p, self._stat(p))

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        p = self._strip_protocol(path)
        client = self.client

        async def listing() -> tuple[Attr, list[tuple[bytes, Attr]]]:
            fs = client.fs
            assert fs is not None
            attr = await fs.resolve(os.fsencode(p))
            entries: list[tuple[bytes, Attr]] = []
            if not stat.S_ISDIR(attr["mode"]):
                return attr, entries
            after: bytes | None = None
            while True:
                page = await fs.readdir(attr["ino"], after, 1024)
                entries.extend(page["entries"])
                if not page["more"] or not page["entries"]:
                    return attr, entries
                after = page["entries"][-1][0]

        attr, entries = client._run(listing)
        if not stat.S_ISDIR(attr["mode"]):
            infos = [_info(p, attr)]
        else:
            base = p.rstrip("/")
            infos = [_info(f"{base}/{os.fsdecode(name)}", a) for name, a in entries]
        return infos if detail else [i["name"] for i in infos]

    def modified(self, path: Any) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.UTC)

    def created(self, path: Any) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.info(path)["ctime"], tz=datetime.UTC)

    # ---- files ---------------------------------------------------------------

    def _open(
        self,
        path: Any,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        buffering = block_size if block_size and block_size > 1 else -1
        return self.client.open(self._strip_protocol(path), mode, buffering=buffering)

    def cat_file(
        self, path: Any, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        p = self._strip_protocol(path)
        with self.client.open(p, "rb", buffering=0) as f:
            size = f.seek(0, os.SEEK_END)
            lo = 0 if start is None else (start if start >= 0 else max(0, size + start))
            hi = size if end is None else (end if end >= 0 else max(0, size + end))
            if hi <= lo:
                return b""
            return f.pread(lo, min(hi, size) - lo)

    def pipe_file(self, path: Any, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        p = self._strip_protocol(path)
        if mode == "create" and self.client.exists(p):
            raise FileExistsError(p)
        self.client.write_bytes(p, value)

    # ---- namespace -----------------------------------------------------------

    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        p = self._strip_protocol(path)
        if create_parents:
            self.client.makedirs(p, exist_ok=True)
        else:
            self.client.mkdir(p)

    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        self.client.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def rmdir(self, path: Any) -> None:
        self.client.rmdir(self._strip_protocol(path))

    def _rm(self, path: Any) -> None:
        p = self._strip_protocol(path)
        if self.isdir(p):
            self.client.rmdir(p)
        else:
            self.client.unlink(p)

    def mv(self, path1: Any, path2: Any, recursive: bool = False, **kwargs: Any) -> None:
        """A rename: one metadata operation, directories included."""
        self.client.rename(self._strip_protocol(path1), self._strip_protocol(path2))
