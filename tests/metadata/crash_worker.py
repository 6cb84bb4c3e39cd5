"""Random namespace mutations in a loop, until killed (test_crash.py kills it).

Usage: crash_worker.py NAMESPACE_DIR SEED

After every batch it bumps a progress counter (an xattr on the root) and
prints the value once committed, so the test can check that every mutation
acknowledged before the kill survived it.
"""

from __future__ import annotations

import contextlib
import os
import random
import stat
import sys

from shufflefs.metadata.protocol import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INODE, Layout
from shufflefs.metadata.store import NamespaceStore
from shufflefs.rpc.errors import FsError

NAMES = [b"%c" % c for c in b"abcdefgh"]
PROGRESS = b"user.progress"


def layout() -> Layout:
    return {"chunk_size": 65536, "chains": [1, 2, 3]}


def main() -> None:
    path, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    ns = NamespaceStore(path, map_size=256 << 20, sync=True, session_timeout=5.0)
    session = ns.session_open("crash-worker", "localhost", os.getpid())["session"]
    handles: list[tuple[int, int]] = []
    try:
        progress = int(ns.getxattr(ROOT_INODE, PROGRESS))
    except FsError:
        progress = 0
    dirs = tree(ns)
    print("ready", flush=True)
    while True:
        for _ in range(20):
            # random operations fail often (EEXIST, ENOENT, ...): fine
            with contextlib.suppress(FsError):
                step(ns, rng, dirs, handles, session)
        progress += 1
        ns.setxattr(ROOT_INODE, PROGRESS, b"%d" % progress)
        print(progress, flush=True)
        if progress % 10 == 0:
            dirs = tree(ns)


def tree(ns: NamespaceStore) -> list[int]:
    """Every directory reachable from the root."""
    found = [ROOT_INODE]
    todo = [ROOT_INODE]
    while todo:
        ino = todo.pop()
        for _, attr in ns.readdir(ino, None, 1024)["entries"]:
            if stat.S_ISDIR(attr["mode"]):
                found.append(attr["ino"])
                todo.append(attr["ino"])
    return found


def step(
    ns: NamespaceStore,
    rng: random.Random,
    dirs: list[int],
    handles: list[tuple[int, int]],
    session: int,
) -> None:
    parent = rng.choice(dirs)
    name = rng.choice(NAMES)
    op = rng.randrange(14)
    if op == 0:
        dirs.append(ns.mkdir(parent, name, 0o755, 0, 0)["ino"])
    elif op in (1, 2):
        ns.mknod(parent, name, stat.S_IFREG | 0o644, 0, 0, 0, layout)
    elif op == 3:
        result = ns.create(parent, name, 0o644, os.O_CREAT | os.O_RDWR, 0, 0, session, layout)
        handles.append((result["attr"]["ino"], result["handle"]))
        ns.update_length(result["attr"]["ino"], rng.randrange(1 << 24))
    elif op == 4:
        ns.unlink(parent, name)
    elif op == 5:
        ns.rmdir(parent, name)
    elif op in (6, 7):
        flags = rng.choice([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE])
        ns.rename(parent, name, rng.choice(dirs), rng.choice(NAMES), flags)
    elif op == 8:
        ns.link(ns.lookup(parent, name)["ino"], rng.choice(dirs), rng.choice(NAMES))
    elif op == 9:
        ns.symlink(parent, name, b"../" + rng.choice(NAMES), 0, 0)
    elif op == 10 and handles and rng.random() < 0.4:
        ino, handle = handles.pop(rng.randrange(len(handles)))
        ns.release(ino, handle, session)
    elif op == 11:
        ino = ns.lookup(parent, name)["ino"]
        ns.setattr(ino, size=rng.randrange(1 << 20))
        for job in ns.truncate_jobs():
            ns.truncate_done(job["ino"], job["seq"])
    elif op == 12:
        ns.setxattr(ns.lookup(parent, name)["ino"], b"user." + name, os.urandom(rng.randrange(64)))
    else:
        for job in ns.gc_jobs(limit=8):
            ns.gc_done(job["ino"])


if __name__ == "__main__":
    main()
