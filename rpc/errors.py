"""The one error model of shufflefs: a POSIX errno plus a human message.

Every layer raises `FsError`; it crosses the wire as ``[errno, message]`` and is
raised again on the calling side, so the storage daemon's ENOSPC arrives at the
FUSE boundary (where it becomes ``pyfuse3.FUSEError``) or at a native caller
(where it *is* an ``OSError``) unchanged.
"""

from __future__ import annotations

import errno
import os
from typing import Any

# Failures of a call that mean "the peer is not there" (refused, reset, timed
# out, unreachable), as opposed to an answer from it.
CONNECTION_FAILURES = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EPIPE,
        errno.ESHUTDOWN,
    }
)


class FsError(OSError):
    """An error with a POSIX errno; subclass of OSError so native callers can
    catch ``FileNotFoundError``-style conditions the ordinary way."""

    def __init__(self, code: int, message: str | None = None) -> None:
        super().__init__(code, message or os.strerror(code))

    @property
    def code(self) -> int:
        return int(self.errno or errno.EIO)

    @property
    def message(self) -> str:
        return str(self.strerror)

    def to_wire(self) -> list[Any]:
        return [self.code, self.message]

    @classmethod
    def from_wire(cls, value: Any) -> FsError:
        """Build from a reply's error field; a malformed field is itself an error."""
        if (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and isinstance(value[0], int)
            and not isinstance(value[0], bool)
            and isinstance(value[1], str)
            and value[0] > 0
        ):
            return cls(value[0], value[1])
        return cls(errno.EPROTO, f"malformed error in reply: {value!r:.200}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.code, self.message))


def err(code: int, message: str | None = None) -> FsError:
    """Shorthand used by servers: ``raise err(ENOENT, "no such entry 'x'")``."""
    return FsError(code, message)


def as_fs_error(exc: BaseException) -> FsError:
    """Map any exception to FsError: OSErrors keep their errno, anything else
    is an internal error (EIO) whose message names the exception type."""
    if isinstance(exc, FsError):
        return exc
    if isinstance(exc, OSError) and exc.errno:
        return FsError(exc.errno, exc.strerror or str(exc))
    return FsError(errno.EIO, f"internal error: {type(exc).__name__}: {exc}")


def first_fs_error(group: BaseExceptionGroup[FsError]) -> FsError:
    """The first FsError of a (nested) group, fresh: what a nursery of calls
    that each raise FsError raises as the error model's one error (an
    ``except* FsError`` clause re-raises it alone)."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, FsError)
    return FsError(exc.code, exc.message)
