"""Python's buffered open asks each file whether it is a terminal: an
ioctl the kernel hands to the mount every time. What opens unbuffered
asks nothing: `shufflefs bench files --unbuffered`'s read rows and
`shufflefs.client.data.read_sample` / `pil_loader`, with the same bytes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from clusters import ProcessCluster, mount_metrics_url
from opsworld import total

from shufflefs.client import bench_files_work as work
from shufflefs.client.data import pil_loader, read_sample


def ioctl_count(mounted: ProcessCluster) -> float:
    """IOCTLs the mount took in its queue drain (libfuse answers them; one
    that comes while the mount's loop is not draining is not counted)."""
    url = mount_metrics_url(mounted, mounted.mountpoint)
    return total(url, "shufflefs_client_fast_answers", op="ioctl")


def buffered_opens_counted(mounted: ProcessCluster, path: Path, data: bytes) -> bool:
    """The control: buffered opens of *path* until the mount counts an
    IOCTL (most come right behind their OPEN, in a drain), 200 at most."""
    before = ioctl_count(mounted)
    for _ in range(20):
        for _ in range(10):
            with open(path, "rb") as f:  # as torchvision's default loader opens
                assert f.read() == data
        if ioctl_count(mounted) > before:
            return True
    return False


def test_bench_read_rows_unbuffered_ask_no_ioctl(mounted: ProcessCluster, mnt: Path) -> None:
    size = 3000
    names = []
    for i in range(12):
        names.append(f"{i:07d}.bin")
        (mnt / names[-1]).write_bytes(work.header(i) + os.urandom(size - work.HEADER))
    assert work.OPERATIONS["read"](str(mnt), names, size) == len(names)
    assert buffered_opens_counted(mounted, mnt / names[0], (mnt / names[0]).read_bytes())
    before = ioctl_count(mounted)
    assert work.OPERATIONS["read-unbuffered"](str(mnt), names, size) == len(names)
    assert work.OPERATIONS["prefetch-read-unbuffered"](str(mnt), names, size) == len(names)
    assert ioctl_count(mounted) == before


def test_read_sample_and_pil_loader_ask_no_ioctl(mounted: ProcessCluster, mnt: Path) -> None:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(mnt / "s.png")
    Image.fromarray(pixels[:, :, 0]).save(mnt / "grey.png")  # one channel: made RGB
    blob = os.urandom(70_000)
    (mnt / "s.bin").write_bytes(blob)
    before = ioctl_count(mounted)
    for _ in range(8):
        assert read_sample(mnt / "s.bin") == blob
        image = pil_loader(str(mnt / "s.png"))
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), pixels)
        grey = np.asarray(pil_loader(mnt / "grey.png"))
        assert grey.shape == (24, 32, 3) and np.array_equal(grey[:, :, 1], pixels[:, :, 0])
    assert ioctl_count(mounted) == before
    assert buffered_opens_counted(mounted, mnt / "s.bin", blob)
