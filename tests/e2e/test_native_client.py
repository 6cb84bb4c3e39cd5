"""The native client (no mount): the same files seen through it and the mount."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from clusters import ProcessCluster


def run_script(script: str, cluster: ProcessCluster, *args: str) -> list[str]:
    """*script* run in a process of its own (given the cluster's client
    config and *args*): the words it printed."""
    out = subprocess.run(
        [sys.executable, "-c", script, str(cluster.client_config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split()


def test_native_file_api(native: Any, mounted: ProcessCluster) -> None:
    fs = native
    fs.makedirs("/native/sub", exist_ok=True)
    data = os.urandom(3 * (1 << 20) + 123)
    assert fs.write_bytes("/native/sub/a.bin", data) == len(data)
    assert fs.read_bytes("/native/sub/a.bin") == data
    assert (
        fs.pread("/native/sub/a.bin", (1 << 20) - 10, 100) == data[(1 << 20) - 10 : (1 << 20) + 90]
    )
    st = fs.stat("/native/sub/a.bin")
    assert st.st_size == len(data)
    # the mount sees what the native client wrote, and the other way round
    assert (mounted.mountpoint / "native" / "sub" / "a.bin").read_bytes() == data
    (mounted.mountpoint / "native" / "from-mount").write_bytes(b"hello")
    assert fs.read_bytes("/native/from-mount") == b"hello"
    assert sorted(fs.listdir("/native")) == ["from-mount", "sub"]

    with fs.open("/native/text.txt", "w") as f:
        f.write("line one\nline two\n")
    with fs.open("/native/text.txt", "a") as f:
        f.write("three\n")
    with fs.open("/native/text.txt") as f:
        assert f.read().splitlines() == ["line one", "line two", "three"]
    with fs.open("/native/sub/a.bin", "rb") as f:
        f.seek(-3, os.SEEK_END)
        assert f.read() == data[-3:]

    fs.rename("/native/text.txt", "/native/renamed.txt")
    assert not fs.exists("/native/text.txt") and fs.exists("/native/renamed.txt")
    fs.symlink("renamed.txt", "/native/link")
    assert fs.readlink("/native/link") == "renamed.txt"
    fs.truncate("/native/renamed.txt", 4)
    assert fs.read_bytes("/native/link") == b"line"
    fs.unlink("/native/link")
    fs.unlink("/native/renamed.txt")
    fs.unlink("/native/from-mount")


@pytest.mark.parametrize(
    "call,code",
    [
        (lambda fs: fs.stat("/no/such/file"), errno.ENOENT),
        (lambda fs: fs.listdir("/native-errors/file"), errno.ENOTDIR),
        (lambda fs: fs.mkdir("/native-errors"), errno.EEXIST),
        (lambda fs: fs.rmdir("/native-errors"), errno.ENOTEMPTY),
        (lambda fs: fs.open("/native-errors", "wb"), errno.EISDIR),
        (lambda fs: fs.write_bytes("/native-errors/" + "n" * 256, b""), errno.ENAMETOOLONG),
        (lambda fs: fs.open("/native-errors/file", "xb"), errno.EEXIST),
    ],
)
def test_native_errors_are_oserrors(native: Any, call: Any, code: int) -> None:
    if not native.exists("/native-errors"):
        native.mkdir("/native-errors")
        native.write_bytes("/native-errors/file", b"x")
    with pytest.raises(OSError) as info:
        call(native)
    assert info.value.errno == code


def test_native_client_survives_fork(native: Any) -> None:
    native.write_bytes("/forked.bin", b"parent wrote this")
    pid = os.fork()
    if pid == 0:  # the child reconnects on its first call
        try:
            ok = native.read_bytes("/forked.bin") == b"parent wrote this"
            native.write_bytes("/forked-child.bin", b"child")
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert native.read_bytes("/forked-child.bin") == b"child"


def test_config_not_found_is_a_clear_error(tmp_path: Path) -> None:
    from shufflefs.client import Client

    with pytest.raises(OSError) as info:
        Client(tmp_path / "missing.toml")
    assert info.value.errno == errno.ENOENT and "missing.toml" in str(info.value)


def test_native_reads_see_writes_still_in_flight(native: Any) -> None:
    data = os.urandom(6 * (1 << 20))
    with native.open("/inflight.bin", "w+b", buffering=0) as f:
        f.write(data)
        assert f.pread(5 * (1 << 20) + 7, 100) == data[5 * (1 << 20) + 7 : 5 * (1 << 20) + 107]
        assert (
            bytes(f.pread_batch([(0, 10), (3 << 20, 10)]))
            == data[:10] + data[3 << 20 : (3 << 20) + 10]
        )


# A reader process: batched reads of 64 x 4 KiB (a 256 KiB result buffer per
# call), then its minor page faults per call. The client is made with
# local_reads off so every batch goes through the storage daemons.
BATCH_READER = """
import random, resource, sys
from shufflefs.client import Client
from shufflefs.client.fs import ClientOptions

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

options = ClientOptions(local_reads=False)
with Client(sys.argv[1], options) as c, c.open(sys.argv[2], "rb", buffering=0) as f:
    rng = random.Random(1)
    batch = lambda: f.pread_batch([(rng.randrange(0, 1020) * 4096, 4096) for _ in range(64)])
    for _ in range(20):
        batch()
    before = faults()
    for _ in range(200):
        batch()
    print((faults() - before) / 200)
"""


def test_batched_reads_reuse_freed_heap_pages(native: Any, mounted: ProcessCluster) -> None:
    """The native client keeps its process's freed heap pages (rpc/heap.py):
    a batch's result buffer is fresh heap every call, which with glibc's
    defaults faulted its 64 pages in again each time (a fifth of a batched
    4 KiB read's time)."""
    native.write_bytes("/heap-reads.bin", os.urandom(4 << 20))
    out = run_script(BATCH_READER, mounted, "/heap-reads.bin")
    assert float(out[-1]) < 16


# A reader process (one process opens a target's chunk table once, so not
# this one, whose earlier clients hold them): 24 files written, then read
# whole through the short circuit; prints how many chunk files its open-file
# caches opened and how often they were looked into without a hit meanwhile.
ONCE_READER = """
import os, sys
from shufflefs.client import Client

with Client(sys.argv[1]) as c:
    files = {f"/once/f{k:02d}.bin": os.urandom(50_000 + k) for k in range(24)}
    c.makedirs("/once", exist_ok=True)
    for path, data in files.items():
        c.write_bytes(path, data)
    storage = c._fs.storage
    readers = [storage.local.target(storage.routing.current, t) for t in (1, 2, 3)]
    assert all(r is not None for r in readers), "no short circuit on this host"
    def counts():
        return sum(r._fds.lookups.misses for r in readers), sum(r._fds.opened for r in readers)
    misses, opened = counts()
    for path, data in files.items():
        assert c.read_bytes(path) == data
    after = counts()
    print(len(files), after[0] - misses, after[1] - opened)
"""


def test_a_local_read_plans_and_opens_each_chunk_file_once(mounted: ProcessCluster) -> None:
    """On a storage host the native client reads a file's chunk files itself
    (the short circuit). A chunk file not open yet is opened by the first
    attempt, so that a warm read costs one plan, one open and one read: one
    look into the open-file cache per chunk, not one by a first attempt that
    gives up (the file not open yet) and another by the read that follows
    (which could also open it on another replica). The bytes are exactly the
    file's (checked in the reader)."""
    files, misses, opened = (int(x) for x in run_script(ONCE_READER, mounted)[-3:])
    assert opened == files  # one chunk file each, opened once
    assert misses == files  # (the file's later reads find it open: hits)


# A process with two clients of one cluster: each reads the same file; prints
# how many local targets each could read (the short circuit).
TWO_CLIENTS = """
import sys
from shufflefs.client import Client

a, b = Client(sys.argv[1]), Client(sys.argv[1])
data = b"sample" * 10_000
a.write_bytes("/two-clients.bin", data)
for c in (a, b):
    assert c.read_bytes("/two-clients.bin") == data
print(*(sum(t is not None for t in c._fs.storage.local._targets.values()) for c in (a, b)))
# each reader's share of the open-file limit is for this host's number of targets
from shufflefs.storage.local_read import fd_budget
storage = a._fs.storage
host = len(storage.replicas.local_targets(storage.routing.current))
shares = {t._fds.capacity for t in storage.local._targets.values() if t is not None}
print(int(shares == {fd_budget(host)}))
a.close()
b.close()
"""


def test_two_clients_in_one_process_both_read_locally(mounted: ProcessCluster) -> None:
    """LMDB opens a target's chunk table once per process: the clients made
    in one process (a second `Client`, a dataset's beside the user's own)
    share one reader per target (`local_reads.shared_target`). Before, the
    second client got no short circuit from the targets the first had
    opened and read everything through the daemons."""
    first, second, budgeted = (int(x) for x in run_script(TWO_CLIENTS, mounted)[-3:])
    assert first >= 1 and second >= 1
    assert budgeted  # (tests/storage/test_local_read.py: the budget itself)
