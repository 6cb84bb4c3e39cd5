"""Concurrent creates, renames and unlinks through the group-committing
`Writer`, until killed (test_crash.py kills it).

Usage: storm_worker.py NAMESPACE_DIR ROUND TASKS

Task i works in directory R<round>t<i>: for n = 0, 1, ... it creates f<n>,
renames it to r<n> and unlinks r<n-2>, one at a time, and after each is
acknowledged prints "i n stage" (1 created, 2 renamed, 3 unlinked). Each
round a create of an existing name must fail alone with EEXIST inside the
same groups ("bad ..." is printed otherwise).
"""

from __future__ import annotations

import errno
import os
import sys

import trio

from shufflefs.metadata.protocol import ROOT_INODE, Layout
from shufflefs.metadata.store import NamespaceStore
from shufflefs.metadata.writer import Writer
from shufflefs.rpc.errors import FsError

CREATE = os.O_CREAT | os.O_EXCL | os.O_RDWR


def layout() -> Layout:
    return {"chunk_size": 65536, "chains": [1, 2, 3]}


def say(line: str) -> None:
    print(line, flush=True)


async def task(ns: NamespaceStore, write: Writer, session: int, d: int, i: int) -> None:
    n = 0
    while True:
        f, r = b"f%d" % n, b"r%d" % n
        made = await write(ns.create, d, f, 0o644, CREATE, 0, 0, session, layout)
        say(f"{i} {n} 1")
        await write(ns.release, made["attr"]["ino"], made["handle"], session)
        try:
            await write(ns.create, d, f, 0o644, CREATE, 0, 0, session, layout)
            say(f"bad {i} {n}: a second O_EXCL create succeeded")
        except FsError as exc:
            if exc.code != errno.EEXIST:
                say(f"bad {i} {n}: {exc}")
        await write(ns.rename, d, f, d, r)
        say(f"{i} {n} 2")
        if n >= 2:
            await write(ns.unlink, d, b"r%d" % (n - 2))
            say(f"{i} {n - 2} 3")
        n += 1


async def main() -> None:
    path, round_, tasks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ns = NamespaceStore(path, map_size=256 << 20, sync=True, session_timeout=60.0)
    write = Writer(ns.txns)
    session = (await write(ns.session_open, "storm", "localhost", os.getpid()))["session"]
    dirs = [
        (await write(ns.mkdir, ROOT_INODE, b"R%dt%d" % (round_, i), 0o755, 0, 0))["ino"]
        for i in range(tasks)
    ]
    say("ready")
    async with trio.open_nursery() as nursery:
        for i, d in enumerate(dirs):
            nursery.start_soon(task, ns, write, session, d, i)


if __name__ == "__main__":
    trio.run(main)
