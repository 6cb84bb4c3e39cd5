"""`mount -a -T FSTAB` mounts shufflefs through mount.fuse.shufflefs (a test
fstab file, never /etc/fstab), with options passed through."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusters import ProcessCluster

from shufflefs.cluster.preflight import mounted_fstype

HELPER = Path("/sbin/mount.fuse.shufflefs")


@pytest.fixture
def helper() -> Iterator[Path]:
    """mount(8) finds helpers in /sbin only: link ours there for the test
    (and remove the link again), unless this very helper is installed."""
    ours = Path(sys.prefix) / "bin" / "mount.fuse.shufflefs"
    assert ours.exists(), "pip install -e . installs mount.fuse.shufflefs"
    if HELPER.is_symlink() or HELPER.exists():
        if HELPER.resolve() != ours.resolve():
            pytest.fail(f"{HELPER} is another installation's helper; not replacing it")
        yield HELPER
        return
    HELPER.symlink_to(ours)
    try:
        yield HELPER
    finally:
        HELPER.unlink()


def umount(point: Path) -> None:
    if mounted_fstype(point) == "fuse.shufflefs":
        subprocess.run(["fusermount3", "-u", str(point)], check=False)


def test_mount_a_from_a_test_fstab(
    ops_cluster: ProcessCluster, helper: Path, tmp_path: Path
) -> None:
    (ops_cluster.mountpoint / "via-fstab").write_bytes(b"mounted from fstab\n")
    ro_point, skipped = tmp_path / "ro", tmp_path / "skipped"
    ro_point.mkdir()
    skipped.mkdir()
    fstab = tmp_path / "fstab"
    config = ops_cluster.client_config
    fstab.write_text(
        "# a test fstab\n"
        f"{config} {ro_point} fuse.shufflefs _netdev,nofail,ro,attr_timeout=2 0 0\n"
        f"{config} {skipped} fuse.shufflefs noauto,_netdev 0 0\n"
    )
    try:
        r = subprocess.run(
            ["mount", "-a", "-T", str(fstab)], capture_output=True, text=True, timeout=90
        )
        assert r.returncode == 0, r.stderr + r.stdout
        assert mounted_fstype(ro_point) == "fuse.shufflefs"
        assert mounted_fstype(skipped) is None  # noauto: left alone by mount -a
        assert (ro_point / "via-fstab").read_bytes() == b"mounted from fstab\n"
        with pytest.raises(OSError) as info:
            (ro_point / "new").write_bytes(b"x")
        assert info.value.errno == errno.EROFS  # `ro` reached the mount
        # mount -t with a bad option of ours: one clear refusal, nothing mounted
        bad = subprocess.run(
            ["mount", "-t", "fuse.shufflefs", "-o", "attr_timeout=soon", str(config), str(skipped)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and "attr_timeout" in bad.stderr + bad.stdout
        assert mounted_fstype(skipped) is None
    finally:
        umount(ro_point)
        umount(skipped)
    assert not os.path.ismount(ro_point)
