"""The directory listings that resolve prefetch hints (fuse/prefetch_hints.py,
`HintResolver`) against the real metadata server in this process: an
expired listing of a directory whose change counter did not move is kept
(one resolve, no listing), a name created, removed or replaced since makes
a new listing, several hints naming one directory at once list it once, and
the listings least recently used are the ones dropped past MAX_LISTED."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.fuse import prefetch_hints
from shufflefs.fuse.prefetch_hints import HintResolver
from shufflefs.metadata import stub
from shufflefs.metadata.protocol import ROOT_INODE

OpenFs = Callable[[ClientOptions], Awaitable[FileSystem]]  # the `open_fs` fixture


async def make_dir(fs: FileSystem, name: bytes, files: int) -> int:
    d = await fs.mkdir(ROOT_INODE, name, 0o755, 0, 0)
    for i in range(files):
        await new_file(fs, d["ino"], f"f{i:02d}".encode())
    return int(d["ino"])


async def new_file(fs: FileSystem, parent: int, name: bytes) -> int:
    f, _ = await fs.create(parent, name, 0o644, os.O_WRONLY, 0, 0)
    await fs.release(f.fh)
    return int(f.ino)


def counting_listings(fs: FileSystem) -> list[int]:
    """Counts the listing requests *fs* makes (directory inodes)."""
    calls: list[int] = []
    listing = fs.readdir_rows

    async def counted(ino: int, *args: Any) -> Any:
        calls.append(ino)
        return await listing(ino, *args)

    fs.readdir_rows = counted  # type: ignore[method-assign]
    return calls


async def test_an_expired_listing_is_kept_while_its_directory_is_unchanged(
    fs: FileSystem, open_fs: OpenFs, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = await open_fs(ClientOptions(local_reads=False))  # another client changes it
    d = await make_dir(fs, b"d", 5)
    calls = counting_listings(fs)
    resolver = HintResolver(fs)
    monkeypatch.setattr(prefetch_hints, "LISTING_TTL", 0.0)  # every listing has expired
    first = await resolver.resolve([(b"d/f01", 0, None)])
    assert len(calls) == 1
    for _ in range(3):
        assert await resolver.resolve([(b"d/f01", 0, None)]) == first
    assert len(calls) == 1  # kept: one resolve of the directory each time
    assert (resolver.listings_made, resolver.revalidated) == (1, 3)

    await new_file(other, d, b"new")  # a name came
    (hint,) = await resolver.resolve([(b"d/f02", 0, None)])
    assert len(calls) == 2
    assert b"new" in resolver.listings[b"/d"].files

    replacement = await new_file(other, d, b"tmp")
    await other.rename(d, b"tmp", d, b"f02")  # a name replaced: another inode now
    (replaced,) = await resolver.resolve([(b"d/f02", 0, None)])
    assert len(calls) == 3
    assert (hint.ino, replaced.ino) != (replacement, replacement)
    assert replaced.ino == replacement

    await other.unlink(d, b"f03")  # a name went
    await resolver.resolve([(b"d/f01", 0, None)])
    assert len(calls) == 4
    assert b"f03" not in resolver.listings[b"/d"].files
    assert resolver.listings_made == 4


async def test_hints_naming_one_directory_at_once_list_it_once(fs: FileSystem) -> None:
    await make_dir(fs, b"d", 8)
    calls = counting_listings(fs)
    resolver = HintResolver(fs)
    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(resolver.resolve, [(f"d/f{i:02d}".encode(), 0, None)])
    assert len(calls) == 1
    assert resolver.listings_made == 1


async def test_the_least_recently_used_listings_are_dropped_first(
    fs: FileSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (b"a", b"b", b"c"):
        await make_dir(fs, name, 4)
    monkeypatch.setattr(prefetch_hints, "MAX_LISTED", 8)  # two directories' names
    monkeypatch.setattr(prefetch_hints, "LISTING_TTL", 0.0)  # (every listing unused since)
    resolver = HintResolver(fs)
    await resolver.resolve([(b"a/f00", 0, None)])
    await resolver.resolve([(b"b/f00", 0, None)])
    await resolver.resolve([(b"a/f01", 0, None)])  # a used again: b is the oldest now
    await resolver.resolve([(b"c/f00", 0, None)])
    assert list(resolver.listings) == [b"/a", b"/c"]
    assert resolver.listed == 8


async def test_listings_in_use_are_not_dropped_for_another_whose_names_are_looked_up(
    fs: FileSystem,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dataset larger than MAX_LISTED hinted in a random order: the
    listings in use stay, and the names of a directory there is no room for
    are looked up (listing it would push out one in use, listed again soon)."""
    for name in (b"a", b"b", b"c"):
        await make_dir(fs, name, 4)
    monkeypatch.setattr(prefetch_hints, "MAX_LISTED", 8)
    inos = {
        (d, n): (await fs.resolve(d + b"/" + n))["ino"]
        for d in (b"a", b"b", b"c")
        for n in (b"f00", b"f03")
    }
    resolver = HintResolver(fs)
    calls = counting_listings(fs)
    for _ in range(3):
        for d in (b"a", b"b", b"c"):
            hints = await resolver.resolve([(d + b"/f00", 0, None), (d + b"/f03", 0, None)])
            assert [h.ino for h in hints] == [inos[(d, b"f00")], inos[(d, b"f03")]]
    assert len(calls) == 2  # a and b, once each
    assert list(resolver.listings) == [b"/a", b"/b", b"/c"]
    assert not resolver.listings[b"/c"].whole
    assert (resolver.listings_made, resolver.unlisted, resolver.listed) == (2, 1, 8)


class Everyone(set[str]):
    def __contains__(self, item: object) -> bool:
        return True


async def test_a_metadata_server_of_before_rows_lists_by_maps(
    fs: FileSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_dir(fs, b"d", 3)
    monkeypatch.setattr(stub, "ROWS_REFUSED", Everyone())  # every server refuses rows
    resolver = HintResolver(fs)
    hints = await resolver.resolve([(b"d/f00", 0, None), (b"d/f02", 0, None)])
    assert [h.ino for h in hints] == [
        (await fs.resolve(b"/d/f00"))["ino"],
        (await fs.resolve(b"/d/f02"))["ino"],
    ]
    assert len(resolver.listings[b"/d"].files) == 3
    assert resolver.listings_made == 1
