"""What every shufflefs process shares: logging and a clean stop on signals.

Log lines are single-line, timestamped in UTC, and name the service and the
logger, so that logs from many hosts can be merged and searched after a failed
training job; details are logged as ``key=value`` pairs in the message.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from shufflefs.rpc.errors import FsError
from shufflefs.rpc.gc_tuning import collect_less
from shufflefs.rpc.heap import keep_freed_pages

log = logging.getLogger("shufflefs.runtime")


class UtcFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        t = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{t}.{int(record.msecs):03d}Z"


def setup_logging(service: str, log_file: str | None = None, level: str = "INFO") -> None:
    """Send the root logger to *log_file* (or stderr), one line per record."""
    fmt = UtcFormatter(f"%(asctime)s %(levelname)s {service}[{os.getpid()}] %(name)s: %(message)s")
    handler: logging.Handler
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(fmt)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def final_error(raised: BaseException) -> FsError | None:
    """The one FsError a service stopped with (the nurseries it went through
    wrap it in groups), or None if it stopped with anything else."""
    while isinstance(raised, BaseExceptionGroup) and len(raised.exceptions) == 1:
        raised = raised.exceptions[0]
    return raised if isinstance(raised, FsError) else None


def run_service(
    name: str,
    main: Callable[[], Awaitable[None]],
    *,
    graceful: Callable[[], None] | None = None,
    grace: float = 5.0,
) -> int:
    """Run a service's main coroutine until it returns or SIGTERM/SIGINT
    arrives (then it is cancelled, so its ``finally`` blocks run: clean
    unregistration, closed databases). Returns a process exit code.

    With *graceful*, a signal first calls it (the mount: end the FUSE loop,
    so ``main`` closes its files and session with its connections still
    running) and cancels only if ``main`` has not returned within *grace*
    seconds or a second signal comes."""

    async def runner() -> None:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    asked = False
                    async for signum in signals:
                        log.info("%s received %s, stopping", name, signal.Signals(signum).name)
                        if graceful is None or asked:
                            nursery.cancel_scope.cancel()
                            return
                        asked = True
                        graceful()
                        nursery.cancel_scope.deadline = trio.current_time() + grace

            nursery.start_soon(stop_on_signal)
            await main()
            nursery.cancel_scope.cancel()

    keep_freed_pages()
    collect_less()
    try:
        trio.run(runner)
    except (FsError, BaseExceptionGroup) as raised:
        exc = final_error(raised)
        if exc is None:
            log.exception("%s crashed", name)
            raise
        log.error("%s stopped: %s", name, exc.message)
        print(f"shufflefs {name}: {exc.message}", file=sys.stderr)
        return 1
    except BaseException:
        log.exception("%s crashed", name)
        raise
    log.info("%s stopped", name)
    return 0
