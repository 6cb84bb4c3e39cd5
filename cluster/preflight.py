"""What a command checks before it starts, writes or changes anything.

A mistake found after the first process started or the first file was
written leaves something behind to clean up; found before, it costs one line.
So every command first checks its arguments (argparse types here), the
directories it will create or write (not a file, not /proc, not read-only),
and every config it will read or start a service with, through the same
``validate(where)`` the service runs (`load_checked`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shufflefs.cluster.cli_errors import UsageError
from shufflefs.cluster.config import ClientConfig, find_client_config, load_client_config
from shufflefs.rpc.config import config_from_dict, load_config
from shufflefs.rpc.errors import FsError

T = TypeVar("T")

# ---- argument types ----------------------------------------------------------------


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in low..high."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small (must be at least {low})")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} is too large (must be at most {high})")
        return value

    parse.__name__ = "integer"
    return parse


positive_int = int_in(1)
nonnegative_int = int_in(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'1M', '512K', '4096' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in SIZE_UNITS else ""
    try:
        value = int(t[: len(t) - len(unit)]) * SIZE_UNITS[unit]
    except ValueError:
        raise FsError(errno.EINVAL, f"bad size {text!r} (try 1M, 4M, 512K)") from None
    if value <= 0:
        raise FsError(errno.EINVAL, f"bad size {text!r}: must be positive")
    return value


def size(text: str) -> str:
    """An argparse type for sizes: checked here, kept as typed (the command parses it)."""
    try:
        parse_size(text)
    except FsError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def comma_list(allowed: Callable[[], tuple[str, ...]], what: str) -> Callable[[str], str]:
    """An argparse type: comma-separated names out of *allowed()* (looked up
    only when used, so the module that defines them loads only then)."""

    def parse(text: str) -> str:
        names = [n.strip() for n in text.split(",") if n.strip()]
        known = allowed()
        bad = [n for n in names if n not in known]
        if not names or bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad)) or '(none given)'} "
                f"(allowed: {', '.join(known)})"
            )
        return text

    parse.__name__ = what
    return parse


def int_list(text: str) -> str:
    for part in text.split(","):
        try:
            ok = int(part) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not a positive integer")
    return text


# ---- directories -------------------------------------------------------------------

PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "mqueue",
        "efivarfs",
        "binfmt_misc",
        "nsfs",
        "autofs",
    }
)


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: frozenset[str]  # the mount's own and its superblock's options


def mounts() -> list[Mount]:
    """The mount table, in mount order (a later mount on a point hides an earlier)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        sep = fields.index("-")
        point = fields[4].encode().decode("unicode_escape")
        options = set(fields[5].split(",")) | set(fields[-1].split(","))
        out.append(Mount(point, fields[sep + 1], frozenset(options)))
    return out


def mount_of(path: str | os.PathLike[str]) -> Mount | None:
    """The mount a path is on (the last mount on the longest matching point)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts():
        inside = real == m.point or real.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def check_dir_for_writing(path: str | os.PathLike[str], what: str) -> Path:
    """*path* as an absolute directory this command may create or write into."""
    p = Path(path).absolute()
    try:
        if p.exists() and not p.is_dir():
            raise UsageError(f"{what} {p} is not a directory", errno.ENOTDIR)
        existing = p
        while not existing.exists():
            if existing.is_symlink():
                raise UsageError(f"{what} {p}: {existing} is a broken symbolic link", errno.ENOENT)
            existing = existing.parent
    except UsageError:
        raise
    except OSError as exc:  # a dead mount (ENOTCONN), EACCES, ELOOP...
        raise UsageError(f"{what} {p}: {exc.strerror or exc}", exc.errno or errno.EIO) from None
    if not existing.is_dir():
        raise UsageError(f"{what} {p}: {existing} is not a directory", errno.ENOTDIR)
    m = mount_of(existing)
    if m is not None and m.fstype in PSEUDO_FILESYSTEMS:
        raise UsageError(f"{what} {p} is on {m.point}, a {m.fstype} pseudo-filesystem, not storage")
    if m is not None and "ro" in m.options:
        raise UsageError(f"{what} {p} is on a read-only filesystem ({m.point})", errno.EROFS)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {p}: {existing} is not writable", errno.EACCES)
    return p


def check_existing_dir(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path).absolute()
    if not p.is_dir():
        reason = "does not exist" if not p.exists() else "is not a directory"
        raise UsageError(f"{what} {p} {reason}", errno.ENOTDIR)
    return p


# ---- configs -----------------------------------------------------------------------


@contextlib.contextmanager
def as_usage_error(path: str | os.PathLike[str]) -> Iterator[None]:
    """Any failure to read or accept a config (or the secret it names) is
    the user's to fix: a `UsageError` naming the file."""
    try:
        yield
    except UsageError:
        raise
    except FsError as exc:
        raise UsageError(exc.message, exc.code) from None
    except UnicodeDecodeError:
        raise UsageError(f"config file {path} is not text (TOML in UTF-8)") from None
    except IsADirectoryError as exc:
        raise UsageError(f"{exc.filename or path} is a directory, not a file") from None
    except OSError as exc:
        raise UsageError(f"{exc.filename or path}: {exc.strerror or exc}") from None


def load_checked(path: str | os.PathLike[str], cls: type[T]) -> T:
    """A service's config, exactly as the service would accept it."""
    with as_usage_error(path):
        return load_config(path, cls)  # which runs the class's validate(where)


def checked_dict(data: dict[str, Any], cls: type[T], where: str) -> T:
    """A config about to be written, as its service would accept it."""
    with as_usage_error(where):
        return config_from_dict(dict(data), cls, where)


def load_client(explicit: str | os.PathLike[str] | None) -> tuple[ClientConfig, bytes]:
    """The client config (--config, $SHUFFLEFS_CONFIG, ./.shufflefs/client.toml)
    and its secret."""
    path = find_client_config(explicit)
    with as_usage_error(path):
        return load_client_config(path)


def check_service_paths(config: Any, where: str) -> None:
    """The directories a service will create: data_dir, targets, log_file's."""
    dirs = [("data_dir", getattr(config, "data_dir", None))]
    dirs += [("targets", t) for t in getattr(config, "targets", None) or []]
    log_file = getattr(config, "log_file", None)
    if log_file:
        dirs.append(("log_file", str(Path(log_file).parent)))
    for key, value in dirs:
        if value:
            check_dir_for_writing(value, f"{where}: {key}")


def service_config_class(kind: str) -> type[Any]:
    """The config dataclass of a service kind (imported only when needed)."""
    if kind == "mgmtd":
        from shufflefs.cluster.config import MgmtdConfig

        return MgmtdConfig
    if kind == "meta":
        from shufflefs.metadata.config import MetaConfig

        return MetaConfig
    if kind == "storage":
        from shufflefs.storage.config import StorageConfig

        return StorageConfig
    raise ValueError(f"not a service: {kind!r}")


def mounted_fstype(mountpoint: str | os.PathLike[str]) -> str | None:
    """The filesystem type mounted exactly at *mountpoint*, if any."""
    target = str(Path(mountpoint).absolute())
    found = None
    for m in mounts():
        if m.point == target:
            found = m.fstype
    return found


def check_mountpoint(path: str | os.PathLike[str], what: str = "--mountpoint") -> Path:
    """A directory to mount shufflefs on: free, or shufflefs already."""
    p = Path(path).absolute()
    fstype = mounted_fstype(p)  # from the mount table: a dead FUSE mount cannot be stat'ed
    if fstype == "fuse.shufflefs":  # ours: `up` remounts it if its process died
        return p
    if fstype is not None:
        raise UsageError(f"{what} {p} already has a {fstype} filesystem mounted", errno.EBUSY)
    return check_dir_for_writing(p, what)


# ---- per command -------------------------------------------------------------------

TOKEN_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")


def _check_service(args: argparse.Namespace) -> None:
    if getattr(args, "meta_command", None):  # `meta add`: checks its data dir itself
        return
    config = load_checked(args.config, service_config_class(args.command))
    check_service_paths(config, str(args.config))


def _check_client(args: argparse.Namespace) -> None:
    load_client(args.config)


def _check_mount(args: argparse.Namespace) -> None:
    load_client(args.config)
    check_existing_dir(args.mountpoint, "mountpoint")
    if args.log_file:
        check_dir_for_writing(Path(args.log_file).absolute().parent, "--log-file")
    from shufflefs.fuse.mount_options import parse_options

    parse_options(args.options)
    _check_cluster_answers(args)


def _check_cluster_answers(args: argparse.Namespace) -> None:
    """The client config, and that its mgmtd answers: the client library
    would retry a missing cluster for half a minute before it gave up."""
    from shufflefs.cluster.admin import with_mgmtd

    async def nothing(*_: Any) -> None:
        return None

    with_mgmtd(args, nothing)


def _check_sample(args: argparse.Namespace) -> None:
    if any(str(p).startswith("shufflefs://") for p in getattr(args, "paths", None) or []):
        _check_cluster_answers(args)


def _check_bench_files(args: argparse.Namespace) -> None:
    """`bench files` may measure any mount (MooseFS too): a cluster is
    asked only when one is named or none is mounted to measure (``--remote``
    and ``--embedded`` start their own: $SHUFFLEFS_CONFIG, or the
    ./.shufflefs of a `make demo`, naming a cluster that is down must not
    stop them)."""
    for option in ("mount", "ro_mount", "prefetch_mount", "local_dir"):
        if getattr(args, option):
            check_existing_dir(getattr(args, option), "--" + option.replace("_", "-"))
    named = args.config or not (args.mount or args.embedded or getattr(args, "remote", False))
    if named and (args.config or find_client_config(None).exists()):
        _check_cluster_answers(args)


def _check_bench(args: argparse.Namespace) -> None:
    if getattr(args, "bench_mode", None) == "files":
        _check_bench_files(args)
        return
    if not args.embedded and not getattr(args, "remote", False):  # those start their own
        _check_cluster_answers(args)
    if args.mountpoint:
        check_existing_dir(args.mountpoint, "--mountpoint")
    if args.local_dir and getattr(args, "bench_mode", None) == "loader":  # it makes the dir
        check_dir_for_writing(args.local_dir, "--local-dir")
    elif args.local_dir:  # the io bench makes its temp dir inside it
        check_dir_for_writing(check_existing_dir(args.local_dir, "--local-dir"), "--local-dir")
    plot = getattr(args, "plot", None)
    if plot:
        check_dir_for_writing(Path(plot).absolute().parent, "--plot")
    remote = getattr(args, "remote_dir", None)
    if remote is not None and not remote.startswith("/"):
        raise UsageError(f"--remote-dir {remote!r} must be an absolute path on the cluster")


CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "mgmtd": _check_service,
    "meta": _check_service,
    "storage": _check_service,
    "status": _check_client,
    "scrub": _check_client,
    "target": _check_client,
    "mount": _check_mount,
    "sample": _check_sample,
    "bench": _check_bench,
}


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments and configs before the command does anything.
    (`format`, `up` and `down` check theirs in the launcher, which their
    Python callers use too.)"""
    check = CHECKS.get(args.command)
    if check is not None:
        check(args)
