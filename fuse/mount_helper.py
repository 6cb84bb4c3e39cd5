"""``mount.fuse.shufflefs``: what mount(8) runs for ``mount -t fuse.shufflefs`` and fstab.

mount(8) calls ``/sbin/mount.fuse.shufflefs SOURCE DIR [-sfnv] [-o OPTIONS]``
(link it there: ``ln -s "$(command -v mount.fuse.shufflefs)" /sbin/``).
SOURCE is the client config (``/etc/shufflefs/client.toml``; ``shufflefs``
or ``default`` for the usual lookup). Our own mount options are passed
through to `shufflefs mount` (`fuse.mount.parse_options` checks them);
the ones meant for mount(8) itself or systemd (``_netdev``, ``noauto``,
``nofail``, ``x-systemd.*``, ``defaults``, ...) are dropped here, and the
VFS flags FUSE mounts always have (``nosuid``, ``nodev``) too. An fstab line::

    /etc/shufflefs/client.toml  /mnt/shufflefs  fuse.shufflefs  _netdev,ro,attr_timeout=5  0 0
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# understood by mount(8), systemd or fstab conventions, not by the filesystem
FOR_MOUNT = frozenset(
    {
        "defaults",
        "auto",
        "noauto",
        "nofail",
        "_netdev",
        "user",
        "users",
        "nouser",
        "owner",
        "group",
        "nosuid",
        "nodev",
        "suid",
        "dev",
        "exec",
        "noexec",
        "async",
        "atime",
        "noatime",
        "relatime",
    }
)
DEFAULT_SOURCES = frozenset({"shufflefs", "default", "none"})


def filesystem_options(options: str) -> list[str]:
    kept = []
    for item in options.split(","):
        item = item.strip()
        key = item.partition("=")[0]
        if not item or key in FOR_MOUNT or key.startswith(("x-", "comment=")):
            continue
        kept.append(item)
    return kept


def mount_argv(argv: Sequence[str]) -> list[str] | None:
    """`shufflefs` arguments for mount(8)'s call, None for a fake mount (-f).
    Raises SystemExit(2) on a call mount(8) would not make."""
    positional: list[str] = []
    options: list[str] = []
    fake = False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "-o":
            if not args:
                raise SystemExit("mount.fuse.shufflefs: -o needs a value")
            options += filesystem_options(args.pop(0))
        elif arg.startswith("-o") and len(arg) > 2:
            options += filesystem_options(arg[2:])
        elif arg in ("-t", "-N"):  # the type (fuse.shufflefs) and a namespace: not ours
            args = args[1:]
        elif arg.startswith("-") and len(arg) > 1:
            fake = fake or "f" in arg[1:]  # -s sloppy, -n no mtab, -v verbose: nothing to do
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise SystemExit("usage: mount.fuse.shufflefs CONFIG MOUNTPOINT [-o OPTIONS]")
    source, mountpoint = positional
    if fake:
        return None
    config = [] if source in DEFAULT_SOURCES else ["--config", source]
    opts = ["-o", ",".join(options)] if options else []
    return ["mount", *config, *opts, mountpoint]


def main(argv: Sequence[str] | None = None) -> int:
    from shufflefs.cluster.cli import main as shufflefs

    args = mount_argv(sys.argv[1:] if argv is None else argv)
    return 0 if args is None else shufflefs(args)


if __name__ == "__main__":
    sys.exit(main())
