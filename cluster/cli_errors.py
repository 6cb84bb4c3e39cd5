"""How the ``shufflefs`` command fails: one line on stderr and an exit code
that says what kind of failure it was.

A script driving the CLI must be able to tell "the cluster is down" from
"you typed it wrong" from "the secret is wrong" without parsing English, and
a user must never have to read a traceback. So every exception a command
raises ends here: an `FsError` becomes its message and an exit code chosen by
its kind; an `OSError` becomes its file name and reason; anything else is an
internal error whose traceback goes to a log file that the one line names.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shufflefs.rpc.errors import FsError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4
EXIT_AUTH = 5
EXIT_VERSION = 6
EXIT_START_FAILED = 7
EXIT_INTERNAL = 70  # EX_SOFTWARE
EXIT_INTERRUPTED = 130

EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success"),
    (EXIT_FAILED, "the command ran and failed (an error answer, damage scrub could not repair)"),
    (EXIT_USAGE, "bad argument or config value; nothing was started, written or changed"),
    (EXIT_UNREACHABLE, "a service is not reachable at its address (connection refused)"),
    (EXIT_TIMEOUT, "a service did not answer in time (hung, overloaded, or filtered)"),
    (EXIT_AUTH, "a service refused our cluster secret (wrong secret file)"),
    (EXIT_VERSION, "a service speaks another protocol version (or is not shufflefs)"),
    (EXIT_START_FAILED, "`up`: a service exited or never became ready; what it started is stopped"),
    (EXIT_INTERNAL, "internal error (a bug): the details are in the log file it names"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)


def exit_codes_epilog() -> str:
    rows = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES)
    return f"exit codes:\n{rows}"


class UsageError(FsError):
    """A bad argument or config value, refused before anything was done."""

    def __init__(self, message: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, message)


class StartFailed(FsError):
    """`up` could not bring a service up; it stopped what it had started."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ECHILD, message)


REFUSED = "refused"
TIMEOUT = "timeout"
AUTH = "auth"
VERSION = "version"

_KIND_EXIT = {
    REFUSED: EXIT_UNREACHABLE,
    TIMEOUT: EXIT_TIMEOUT,
    AUTH: EXIT_AUTH,
    VERSION: EXIT_VERSION,
}
_KIND_ERRNO = {
    REFUSED: errno.ECONNREFUSED,
    TIMEOUT: errno.ETIMEDOUT,
    AUTH: errno.EACCES,
    VERSION: errno.EPROTO,
}
_KIND_TEXT = {
    REFUSED: "is not reachable",
    TIMEOUT: "did not answer",
    AUTH: "refused our cluster secret",
    VERSION: "speaks another protocol",
}
_KIND_HINT = {
    REFUSED: "is it running? `shufflefs up` starts a local cluster",
    TIMEOUT: "is it hung or overloaded?",
    AUTH: "the client config's secret_file must hold this cluster's secret",
    VERSION: "run the same shufflefs version on every host",
}

# What rpc's framing says when a peer's frames are not ours (the reader turns
# it into a closed connection, so the words are all that is left of it).
_VERSION_MARKERS = ("protocol version", "bad frame magic", "not a shufflefs server")
_NOT_THERE = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})


class Unreachable(FsError):
    """A service the command needs could not be talked to; *kind* says why."""

    def __init__(self, kind: str, service: str, address: str, detail: str) -> None:
        self.kind = kind
        self.service = service
        self.address = address
        super().__init__(
            _KIND_ERRNO[kind],
            f"{service} at {address} {_KIND_TEXT[kind]} ({detail}); {_KIND_HINT[kind]}",
        )

    @property
    def exit_code(self) -> int:
        return _KIND_EXIT[self.kind]


def connection_kind(exc: FsError, *, handshake: bool) -> str | None:
    """Which kind of unreachable *exc* is, or None if it is an answer.
    *handshake*: it happened while connecting, where a server that closes
    the connection is one that refused our secret."""
    if exc.code == errno.EPROTO or any(m in exc.message for m in _VERSION_MARKERS):
        return VERSION
    if exc.code in _NOT_THERE or (handshake and exc.code == errno.EHOSTDOWN):
        return REFUSED
    if exc.code == errno.ETIMEDOUT:
        return TIMEOUT
    if exc.code == errno.EACCES or (handshake and exc.code == errno.ECONNRESET):
        return AUTH
    return None


def explain_connection_error(
    exc: FsError, service: str, address: str, *, handshake: bool
) -> FsError:
    """*exc* as an `Unreachable` naming the service, if it is one. After the
    handshake only errors that name *address* are about this service."""
    if isinstance(exc, Unreachable) or (not handshake and address not in exc.message):
        return exc
    kind = connection_kind(exc, handshake=handshake)
    if kind is None:
        return exc
    detail = exc.message
    if kind == REFUSED and exc.code == errno.ECONNREFUSED:
        detail = "connection refused"
    elif kind == AUTH and exc.code == errno.ECONNRESET:
        detail = "it closed the connection during authentication"
    return Unreachable(kind, service, address, detail)


async def connect(rpc: Any, service: str, address: str) -> None:
    """Open *rpc*'s connection to *service*, so that a failure to reach it
    is told apart from an error answer of the call that follows."""
    try:
        await rpc.connection(address)
    except FsError as exc:
        raise explain_connection_error(exc, service, address, handshake=True) from None


def innermost(exc: BaseException) -> BaseException:
    """The exception that matters inside trio's exception groups: the first
    FsError among the leaves, else the first leaf that is not a cancellation."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves: list[BaseException] = []
    # an exception group comes from trio, so trio is imported by now (this
    # module does not import it: a CLI call that fails on its arguments never needs it)
    trio = sys.modules.get("trio")
    cancelled: type[BaseException] | tuple[()] = trio.Cancelled if trio is not None else ()

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        elif not isinstance(e, cancelled):
            leaves.append(e)

    walk(exc)
    for leaf in leaves:
        if isinstance(leaf, FsError):
            return leaf
    return leaves[0] if leaves else exc


def exit_code(exc: FsError) -> int:
    if isinstance(exc, Unreachable):
        return exc.exit_code
    if isinstance(exc, UsageError) or exc.code == errno.EINVAL:
        return EXIT_USAGE
    if isinstance(exc, StartFailed):
        return EXIT_START_FAILED
    kind = connection_kind(exc, handshake=False)
    if kind is not None and kind != AUTH:
        return _KIND_EXIT[kind]
    if exc.code == errno.ECONNRESET:
        return EXIT_UNREACHABLE
    return EXIT_FAILED


def one_line(message: str) -> str:
    """The first line of a message: details belong in the log it names."""
    lines = [line for line in message.splitlines() if line.strip()]
    return lines[0].strip() if lines else message


def describe_os_error(exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    if exc.filename is not None and exc.filename2 is not None:
        return f"{exc.filename} -> {exc.filename2}: {reason}"
    return f"{exc.filename}: {reason}" if exc.filename is not None else reason


def internal_error_log(args: argparse.Namespace) -> Path:
    """Where an internal error's details go: the local cluster's logs if the
    command names one, else the temp dir."""
    data_dir = getattr(args, "data_dir", None)
    if data_dir and (Path(data_dir) / "cluster.toml").is_file():
        return Path(data_dir).absolute() / "logs" / "cli.log"
    return Path(tempfile.gettempdir()) / "shufflefs-cli.log"


def log_internal_error(path: Path, exc: BaseException) -> Path | None:
    """Append *exc*'s traceback to *path* (owner-only, never through a link)."""
    text = (
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} pid {os.getpid()} "
        f"argv {sys.argv!r}\n{''.join(traceback.format_exception(exc))}\n"
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(text)
    except OSError:
        return None
    return path


def run_reporting(label: str, args: argparse.Namespace, body: Callable[[], int]) -> int:
    """Run a command; turn whatever it raises into one line and an exit code."""
    try:
        return body()
    except SystemExit:
        raise
    except BrokenPipeError:  # `shufflefs status | head`: the reader left, not an error
        quiet_stdout()
        return EXIT_OK
    except BaseException as raised:
        exc = innermost(raised)
        if isinstance(exc, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        if isinstance(exc, BrokenPipeError):
            quiet_stdout()
            return EXIT_OK
        if isinstance(exc, FsError):
            print(f"{label}: {one_line(exc.message)}", file=sys.stderr)
            return exit_code(exc)
        if isinstance(exc, OSError):
            print(f"{label}: {describe_os_error(exc)}", file=sys.stderr)
            return EXIT_FAILED
        logged = log_internal_error(internal_error_log(args), raised)
        where = f"details in {logged}" if logged else "its details could not be logged"
        print(
            f"{label}: internal error {type(exc).__name__}: {one_line(str(exc))} ({where})",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def quiet_stdout() -> None:
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (flags: off), unless the
    help already says what it is. Descriptions and epilogs are wrapped by
    paragraph; indented lines (tables) are kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        paragraph: list[str] = []

        def flush() -> None:
            if paragraph:
                out.append(
                    super(HelpFormatter, self)._fill_text(" ".join(paragraph), width, indent)
                )
                paragraph.clear()

        for line in text.splitlines():
            if line.startswith(" ") or not line.strip():
                flush()
                out.append(indent + line)
            else:
                paragraph.append(line.strip())
        flush()
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or not action.option_strings or action.required:
            return text
        if action.default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            return text
        if isinstance(action, argparse._VersionAction):
            return text
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)".strip()
        if action.default is None or action.default == []:
            return text
        return f"{text} (default: %(default)s)".strip()


class Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are one line, like every other error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:
        print(f"{self.prog}: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
