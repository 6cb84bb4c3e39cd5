"""The mount's fast READs (fuse/fast_reads.py), taken off the event loop and
answered by reply threads, through a real mount that reads through the
storage daemons (``-o no_local_reads``, as a reader off the storage hosts
does): exact bytes at chunk and block edges from many readers at once (their
READs drained from the kernel's queue and coalesced per node), a damaged
replica never served, a file's own writes read back while they are in flight,
the counters showing the path was taken, and ``no_fast_reads`` turning it off;
and on a cluster with a replica of everything on this host, the same READs
answered from the chunk files (the short circuit) by the same path."""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster, chain_places, chunk_files, wait_until
from harness import evict, flip
from opsworld import MeteredMount, metered_mount, total

from shufflefs.fuse.fast_reads import INLINE_PAUSE
from shufflefs.storage import uring

# they drop the kernel's caches, or count what those spare: one at a time on the machine
pytestmark = pytest.mark.usefixtures("kernel_caches")

MiB = 1 << 20
CHUNK = MiB  # the test cluster's chunk size
SIZE = 5 * MiB + 777
FAMILY = "shufflefs_client_fast_reads"


FastMount = MeteredMount


def mount(cluster: ProcessCluster, where: Path, options: str) -> Iterator[FastMount]:
    return metered_mount(cluster, where, options, FAMILY, "outcome")


@pytest.fixture(scope="module")
def fast(mounted: ProcessCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastMount]:
    yield from mount(mounted, tmp_path_factory.mktemp("fast-mount"), "no_local_reads")


def direct_reads(path: Path, ranges: list[tuple[int, int]]) -> list[bytes]:
    """O_DIRECT preads (every one reaches the mount process)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4 * MiB)
    try:
        out = []
        for off, n in ranges:
            got = os.preadv(fd, [memoryview(buf)[:n]], off)
            out.append(bytes(buf[:got]))
        return out
    finally:
        os.close(fd)
        buf.close()


EDGES = [
    (0, 4096),
    (1, 1),
    (511, 2),  # across a CRC block edge
    (4095, 8193),
    (CHUNK - 1, 1),  # the last byte of a chunk
    (CHUNK - 3, 6),  # across a chunk edge
    (CHUNK, 4096),
    (CHUNK - 100_000, 2 * CHUNK + 200_000),  # three chunks, the middle one whole
    (SIZE - 5, 100),  # past the end: short
    (SIZE + 10, 4096),  # beyond the end: nothing
]


def read_concurrently(path: Path, per_reader: list[list[tuple[int, int]]]) -> list[list[bytes]]:
    """Each list of ranges read by its own thread, all at once (their READs
    meet in the kernel's queue and are drained and coalesced together)."""
    results: list[list[bytes]] = [[] for _ in per_reader]
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        try:
            results[i] = direct_reads(path, per_reader[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(len(per_reader))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    return results


def test_many_readers_get_exact_bytes_at_every_edge(fast: FastMount) -> None:
    data = os.urandom(SIZE)
    path = fast.mountpoint / "edges.bin"
    path.write_bytes(data)
    direct_reads(path, [(0, 4096)])  # connections to the daemons open meanwhile
    taken = fast.count("taken")
    rng = random.Random(7)
    per_reader = [
        EDGES + [(rng.randrange(SIZE), rng.choice([512, 4096, 5000, 65536])) for _ in range(150)]
        for _ in range(8)
    ]
    results = read_concurrently(path, per_reader)
    for ranges, got in zip(per_reader, results, strict=True):
        for (off, n), b in zip(ranges, got, strict=True):
            assert b == data[off : off + n], (off, n)
    assert fast.count("taken") - taken >= sum(len(r) for r in per_reader) * 0.9
    assert fast.count("fell_back") == 0


def test_a_damaged_replica_is_never_served(fast: FastMount, mounted: ProcessCluster) -> None:
    data = os.urandom(3 * CHUNK)
    path = fast.mountpoint / "damaged.bin"
    path.write_bytes(data)
    ino = path.stat().st_ino
    files = chunk_files(mounted.data_dir, ino)
    assert len(files) == 9  # three chunks, three replicas
    by_chunk: dict[str, list[Path]] = {}
    for f in files:
        by_chunk.setdefault(f.name[:24], []).append(f)
    for replicas in by_chunk.values():
        for f in sorted(replicas)[:2]:  # two of the three replicas of every chunk
            flip(f, 70_000)
    fell_back = fast.count("fell_back")
    # concurrent READs are spread over the replicas: most meet a damaged one
    ranges = [(off + 69_632, 8192) for off in (0, CHUNK, 2 * CHUNK)] * 10
    for got in read_concurrently(path, [ranges] * 6):
        for (off, n), b in zip(ranges, got, strict=True):
            assert b == data[off : off + n], (off, n)
    assert fast.count("fell_back") > fell_back  # met a damaged block, read another replica


def test_a_files_own_writes_are_read_back_while_in_flight(fast: FastMount) -> None:
    path = fast.mountpoint / "inflight.bin"
    data = os.urandom(3 * MiB)
    with open(path, "w+b", buffering=0) as f:
        f.write(data)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 3 * MiB)
            n = os.preadv(fd, [buf], 0)
            assert bytes(buf[:n]) == data
        finally:
            os.close(fd)
    assert path.read_bytes() == data


def test_no_fast_reads_reads_the_same_bytes_the_usual_way(
    mounted: ProcessCluster, tmp_path: Path
) -> None:
    (tmp_path / "slow-mount").mkdir()
    for slow in mount(mounted, tmp_path / "slow-mount", "no_local_reads,no_fast_reads"):
        data = os.urandom(2 * MiB + 3)
        path = slow.mountpoint / "slow.bin"
        path.write_bytes(data)
        assert direct_reads(path, [(0, len(data)), (MiB - 1, 2)]) == [data, data[MiB - 1 : MiB + 1]]
        assert slow.count("taken") == 0


def test_beside_every_replica_the_fast_path_reads_the_chunk_files(
    mounted: ProcessCluster, tmp_path: Path
) -> None:
    """On a one-host cluster every chain has a replica here: the fast path
    answers READs from the chunk files, the page cache's bytes in the
    callback and the disk's through the loop's io_uring (in threads where
    there is none), exact at every edge from many readers; a damaged block
    is never served (the loop reads another replica)."""
    (tmp_path / "local-mount").mkdir()
    for local in mount(mounted, tmp_path / "local-mount", "rw"):
        data = os.urandom(SIZE)
        path = local.mountpoint / "local.bin"
        path.write_bytes(data)
        files = chunk_files(mounted.data_dir, path.stat().st_ino)
        assert len(files) == 18  # six chunks, three replicas
        direct_reads(path, [(0, 4096)])  # past the first READs (their handle is checked)
        taken, declined = local.count("local"), local.count("declined")
        rng = random.Random(11)
        per_reader = [
            EDGES + [(rng.randrange(SIZE), rng.choice([512, 4096, 5000, 65536])) for _ in range(40)]
            for _ in range(6)
        ]
        for cold in (True, False):
            if cold:
                evict(files)
            results = read_concurrently(path, per_reader)
            for ranges, got in zip(per_reader, results, strict=True):
                for (off, n), b in zip(ranges, got, strict=True):
                    assert b == data[off : off + n], (cold, off, n)
        reads = 2 * sum(len(r) for r in per_reader)
        assert local.count("local") - taken >= reads * 0.9
        assert local.count("declined") == declined
        assert local.count("fell_back") == 0
        ring = local.count("ring")
        assert ring > 0 or not uring.available()  # cold READs of many readers at once
        # with several waiting for the disk at once, the kernel's workers copy their bytes
        assert local.count("offloaded") > 0 or not uring.available()
        read_alone_until_inline(local, path, lambda f=files: f, EDGES, data)
        assert local.count("fell_back") == 0

        # two of the three replicas of every whole chunk: the one the fast
        # path reads (the first of its chain here) and the next; the last
        # stays whole for the loop
        for f, place in chain_places(mounted, "/local.bin", files).items():
            if place < 2 and f.stat().st_size == CHUNK:
                flip(f, 70_000)
        evict(files)
        ranges = [(off + 69_632, 8192) for off in range(0, 5 * CHUNK, CHUNK)] * 3
        fell_back = local.count("fell_back")
        for got in read_concurrently(path, [ranges] * 3):
            for (off, n), b in zip(ranges, got, strict=True):
                assert b == data[off : off + n], (off, n)
        if uring.available():  # damaged blocks read through the ring went to the loop
            assert local.count("fell_back") > fell_back
        # the same alone (the damaged replicas are being repaired into new
        # chunk files meanwhile)
        ino = path.stat().st_ino
        read_alone_until_inline(
            local, path, lambda i=ino: chunk_files(mounted.data_dir, i), ranges, data
        )
        # every replica of a chunk damaged: an error, never the bytes
        # (whichever replica the fast path reads, it hands the READ to the loop)
        ruined = local.mountpoint / "ruined.bin"
        ruined.write_bytes(data[:CHUNK])
        for f in chunk_files(mounted.data_dir, ruined.stat().st_ino):
            flip(f, 70_000)
        with pytest.raises(OSError) as failed:
            direct_reads(ruined, [(69_632, 8192)])
        assert failed.value.errno == errno.EIO
        assert local.count("fell_back") > 0


def read_alone_until_inline(
    local: FastMount,
    path: Path,
    chunk_files_now: Callable[[], list[Path]],
    ranges: list[tuple[int, int]],
    data: bytes,
) -> None:
    """One reader alone, the file's chunk files evicted before each round,
    exact bytes every round, until one of its READs waited for the disk on
    the loop's thread (nothing else waits on the mount; a slow wait of the
    earlier readers may have paused that for INLINE_PAUSE)."""
    inline = local.count("inline")

    def round_went_inline() -> bool:
        evict(chunk_files_now(), missing_ok=True)
        for (off, n), b in zip(ranges, direct_reads(path, ranges), strict=True):
            assert b == data[off : off + n], (off, n)
        return local.count("inline") > inline

    wait_until("a lone reader's READ waiting inline", round_went_inline, INLINE_PAUSE + 10)


def read_whole(root: Path, files: dict[str, bytes], readers: int) -> None:
    """Every file read whole and checked, the names dealt over *readers* threads."""
    errors: list[BaseException] = []

    def reader(names: list[str]) -> None:
        try:
            for name in names:
                assert (root / name).read_bytes() == files[name], name
        except BaseException as exc:
            errors.append(exc)

    names = sorted(files)
    threads = [threading.Thread(target=reader, args=(names[i::readers],)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors


def test_an_immutable_mounts_first_reads_open_then_take_the_fast_path(
    mounted: ProcessCluster, tmp_path: Path
) -> None:
    """cache=immutable READs name no handle: a file's first READ opens it on
    the loop, then is read by the fast path like the next ones (short circuit
    here); exact bytes, each of many files read whole by several readers."""
    (tmp_path / "rw").mkdir()
    (tmp_path / "imm").mkdir()
    files = {f"f{i}.bin": os.urandom(110_000 + i) for i in range(24)}
    for rw in mount(mounted, tmp_path / "rw", "rw"):
        for name, data in files.items():
            (rw.mountpoint / name).write_bytes(data)
    for imm in mount(mounted, tmp_path / "imm", "ro,cache=immutable"):
        local, declined = imm.count("local"), imm.count("declined")
        read_whole(imm.mountpoint, files, 3)
        assert imm.count("local") - local >= len(files)
        assert imm.count("declined") == declined


ANSWERS = "shufflefs_client_fast_answers"
OPEN_CACHE = "shufflefs_client_open_cache"


@pytest.mark.parametrize("mode", ["rw", "ro"])
def test_what_the_caches_answer_is_answered_in_libfuses_callback(
    mounted: ProcessCluster, fast: FastMount, tmp_path: Path, mode: str
) -> None:
    """A read-only open that the mount's open cache answers with no round
    trip, and its close, are answered in libfuse's callback
    (fuse/fast_answers.py): counted, no metadata call, the bytes right. On the
    read-write mount so is a LOOKUP of a name the watch keeps; an open for
    writing and its close go the usual way, and the next cached open reads
    what they wrote; with ``no_fast_answers`` none is answered there."""
    data = os.urandom(300_000)
    (fast.mountpoint / f"opens-{mode}.bin").write_bytes(data)
    for options, counted in ((mode, True), (f"{mode},no_fast_answers", False)):
        where = tmp_path / options.replace(",", "-")
        where.mkdir()
        for m in mount(mounted, where, options):
            path = m.mountpoint / f"opens-{mode}.bin"
            assert path.read_bytes() == data  # (its first open asks the metadata server)
            before = mounted.meta_calls()
            for _ in range(20):
                assert path.read_bytes() == data
            after = mounted.meta_calls()
            for method in ("open", "lookup_open", "release", "release_many"):
                assert after.get(method, 0) == before.get(method, 0), method
            opens = total(m.metrics, ANSWERS, op="open")
            releases = total(m.metrics, ANSWERS, op="release")
            if not counted:
                assert opens == releases == 0
                continue
            # (the first opens are the usual way's, until the file info's
            # handle offset was checked against pyfuse3's reading)
            assert opens >= 15 and releases >= 15
            if mode == "rw":
                # the kernel's entry gone (expired after the watch's lease,
                # or evicted): the LOOKUP is answered from the watch, here
                lookups = total(m.metrics, ANSWERS, op="lookup")
                Path("/proc/sys/vm/drop_caches").write_text("2\n")
                assert path.stat().st_size == len(data)
                assert total(m.metrics, ANSWERS, op="lookup") > lookups
                new = os.urandom(200_000)
                with open(path, "r+b") as f:  # an open for writing: not taken
                    f.write(new)
                assert total(m.metrics, ANSWERS, op="open") == opens
                assert total(m.metrics, ANSWERS, op="release") == releases
                assert path.read_bytes() == new + data[len(new) :]
                path.write_bytes(data)


def dataset_files(d: Path, count: int) -> dict[str, bytes]:
    """*count* files of a few KB in a new directory *d*: name -> bytes."""
    d.mkdir()
    files = {f"s{i}": os.urandom(5000 + i) for i in range(count)}
    for name, data in files.items():
        (d / name).write_bytes(data)
    return files


def dataset_mount(
    cluster: ProcessCluster, tmp_path: Path, name: str, files: dict[str, bytes]
) -> Iterator[tuple[MeteredMount, Path]]:
    """A fresh cache=immutable mount and directory *name* in it, whose first
    file was read (its lookup asked, listed the directory and opened the
    others ahead, fuse/dir_ahead.py)."""
    (tmp_path / "imm").mkdir()
    for m in mount(cluster, tmp_path / "imm", "ro,cache=immutable"):
        here = m.mountpoint / name
        assert (here / "s0").read_bytes() == files["s0"]
        yield m, here


def test_a_dataset_mounts_cached_lookups_are_answered_in_libfuses_callback(
    mounted: ProcessCluster, fast: FastMount, tmp_path: Path
) -> None:
    """cache=immutable: once a directory's first lookup listed it and opened
    its files ahead (fuse/dir_ahead.py), the LOOKUPs of its other names are
    answered in libfuse's callback: counted, no metadata call (nor for their
    READs, which take their handles from the open cache), the bytes right;
    and a LOOKUP the caches cannot answer goes the usual way."""
    files = dataset_files(fast.mountpoint / "imm-lookups", 12)
    for m, here in dataset_mount(mounted, tmp_path, "imm-lookups", files):
        lookups = total(m.metrics, ANSWERS, op="lookup")
        before = mounted.meta_calls()
        for name, data in files.items():
            if name != "s0":
                assert (here / name).read_bytes() == data
        after = mounted.meta_calls()
        for method in ("open", "lookup", "lookup_open", "getattr"):
            assert after.get(method, 0) == before.get(method, 0), method
        assert total(m.metrics, ANSWERS, op="lookup") >= lookups + len(files) - 1
        with pytest.raises(FileNotFoundError):  # not cached: the usual way, ENOENT
            (here / "missing").stat()
        assert mounted.meta_calls().get("lookup_open", 0) > after.get("lookup_open", 0)


def test_a_dataset_mounts_lookup_takes_no_handle_its_first_read_does(
    mounted: ProcessCluster, fast: FastMount, tmp_path: Path
) -> None:
    """cache=immutable: a stat of a name the caches hold takes no file handle
    (a stat that no read follows costs none); the first READ of the file
    takes its handle from the open cache with no metadata call and is
    answered off the loop; the bytes are right."""
    files = dataset_files(fast.mountpoint / "imm-handles", 10)
    for m, here in dataset_mount(mounted, tmp_path, "imm-handles", files):
        taken = total(m.metrics, OPEN_CACHE, result="trusted")
        for name, data in files.items():
            assert (here / name).stat().st_size == len(data)
        assert total(m.metrics, OPEN_CACHE, result="trusted") == taken
        before = mounted.meta_calls()
        for name, data in files.items():
            if name != "s0":
                assert (here / name).read_bytes() == data
        after = mounted.meta_calls()
        for method in ("open", "open_read_only", "lookup", "lookup_open", "getattr"):
            assert after.get(method, 0) == before.get(method, 0), method
        assert total(m.metrics, OPEN_CACHE, result="trusted") == taken + len(files) - 1


SPINS = "shufflefs_client_fuse_spins"


def test_the_fuse_thread_polls_its_empty_queue_for_spin_us(
    mounted: ProcessCluster, fast: FastMount, tmp_path: Path
) -> None:
    """Once the kernel's queue is empty the loop thread polls it for
    ``spin_us`` before sleeping (fuse/libfuse.py): a reader's next request
    that comes meanwhile is taken then (counted ``caught``), answered as
    ever; with ``spin_us=0`` there is no such poll. A READ handed to a
    storage node while the thread polls (no_local_reads) is answered too.
    An IOCTL met while draining (libfuse answers it) does not end the drain."""
    data = os.urandom(200_000)
    (fast.mountpoint / "spins.bin").write_bytes(data)
    # 10 ms: the next open of a reader looping over a cached file comes well within
    for options, spinning in (("ro,spin_us=10000", True), ("ro,spin_us=0", False)):
        where = tmp_path / options.replace(",", "-").replace("=", "")
        where.mkdir()
        for m in mount(mounted, where, options):
            path = m.mountpoint / "spins.bin"
            # a loaded machine can deschedule the reader past every poll of a
            # round: read in rounds until one was caught (bounded in count
            # and time; without spinning, the rounds all run and count none)
            deadline = time.monotonic() + 60
            for _ in range(40):
                for _ in range(50):
                    assert path.read_bytes() == data
                caught = total(m.metrics, SPINS, outcome="caught")
                if caught or not spinning or time.monotonic() > deadline:
                    break
            idle = total(m.metrics, SPINS, outcome="idle")
            if spinning:
                assert caught > 0
                # each buffered open asks whether the file is a terminal (an
                # IOCTL libfuse answers): taken in the drain, which goes on
                assert total(m.metrics, ANSWERS, op="ioctl") > 0
            else:
                assert caught == idle == 0
    where = tmp_path / "remote-spin"
    where.mkdir()
    for m in mount(mounted, where, "no_local_reads,spin_us=10000"):
        ranges = [(random.randrange(0, len(data) - 4096) & ~4095, 4096) for _ in range(64)]
        got = direct_reads(m.mountpoint / "spins.bin", ranges)
        assert got == [data[o : o + n] for o, n in ranges]
