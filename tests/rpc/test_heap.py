"""Every shufflefs process keeps its freed heap pages (rpc/heap.py): large read
buffers allocated one after another do not fault their pages in each time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from shufflefs.rpc.heap import UNINITIALIZED_MIN, uninitialized

# A service (run_service, as every daemon and the mount start) that allocates
# and frees read-sized buffers, then prints its minor page faults per buffer.
SERVICE = textwrap.dedent(
    """
    import resource, sys
    from shufflefs.rpc.runtime import run_service

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    async def main():
        for _ in range(3):
            bytearray(512 << 10)
        before = faults()
        for _ in range(200):
            buf = bytearray(512 << 10)  # a read's buffer
            copy = bytes(buf)  # its checksum's copy
            del buf, copy
        print((faults() - before) / 200)

    sys.exit(run_service("heaptest", main))
    """
)


def faults_per_buffer(code: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return float(out.stdout.split()[-1])


def test_services_reuse_freed_heap_pages() -> None:
    # 2 x 512 KiB = 256 pages per round with glibc's defaults; reused pages: ~0
    assert faults_per_buffer(SERVICE) < 16


def test_the_check_fails_without_the_tuning() -> None:
    """The measure above is sound: the same loop outside run_service (the
    allocator's defaults) faults in most pages of every buffer."""
    started = 'sys.exit(run_service("heaptest", main))'
    plain = SERVICE.replace(started, "import trio; trio.run(main)")
    assert plain != SERVICE
    assert faults_per_buffer(plain) > 64


def test_uninitialized_buffers_are_writable_bytearrays_of_the_size_asked() -> None:
    for n in (0, 1, UNINITIALIZED_MIN - 1, UNINITIALIZED_MIN, 1 << 20):
        buf = uninitialized(n)
        assert type(buf) is bytearray and len(buf) == n
        memoryview(buf)[-1:] = b"x" if n else b""
        if n < UNINITIALIZED_MIN:  # small ones are zeroed as bytearray(n) does
            assert buf[:-1] == bytes(max(n - 1, 0))
        buf.extend(b"yz")
        del buf[n:]
        assert len(buf) == n
