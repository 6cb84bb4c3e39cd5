"""mount(8)'s call of mount.fuse.shufflefs turned into `shufflefs mount` arguments."""

from __future__ import annotations

import pytest

from shufflefs.fuse.mount_helper import mount_argv


def test_fstab_options_pass_through_and_mount_only_ones_are_dropped() -> None:
    fstab = "rw,_netdev,noauto,attr_timeout=5,nosuid"
    argv = mount_argv(
        ["/etc/shufflefs/client.toml", "/mnt/s", "-o", fstab, "-o", "x-systemd.automount,ro"]
    )
    assert argv == [
        "mount",
        "--config",
        "/etc/shufflefs/client.toml",
        "-o",
        "rw,attr_timeout=5,ro",
        "/mnt/s",
    ]


def test_default_source_flags_and_fake_mounts() -> None:
    assert mount_argv(["shufflefs", "/mnt/s", "-n", "-s", "-t", "fuse.shufflefs"]) == [
        "mount",
        "/mnt/s",
    ]
    assert mount_argv(["-odefaults", "default", "/mnt/s"]) == ["mount", "/mnt/s"]
    assert mount_argv(["/c.toml", "/mnt/s", "-fv"]) is None


@pytest.mark.parametrize("argv", [[], ["/c.toml"], ["/c.toml", "/m", "extra"], ["/c", "/m", "-o"]])
def test_a_call_mount_would_not_make_is_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        mount_argv(argv)
    assert info.value.code not in (0, None)
