"""Progress of a background job a command waits for (`node drain --wait`,
`rebalance --wait`): a tqdm bar on stderr when it is a terminal, else one
plain line on stderr per change, so logs of scripted runs stay readable and
stdout keeps only the result (`--json`)."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TextIO, TypeVar

from tqdm import tqdm

from shufflefs.rpc.errors import CONNECTION_FAILURES, FsError

T = TypeVar("T")


async def poll(look: Callable[[], Awaitable[T]]) -> T | None:
    """One look at a job's progress; None while mgmtd is unreachable (a
    restart or failover: the job is in its persisted state and goes on, so a
    wait keeps looking until its timeout)."""
    try:
        return await look()
    except FsError as exc:
        if exc.code in CONNECTION_FAILURES:
            return None
        raise


class Progress:
    def __init__(self, desc: str, unit: str, out: TextIO | None = None) -> None:
        self.desc, self.unit = desc, unit
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.bar = tqdm(
            total=0,
            desc=desc,
            unit=unit,
            file=self.out,
            disable=not self.tty,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} "
            "[{elapsed}] {postfix}",
        )
        self.last: tuple[int, int, str] | None = None

    def show(self, done: int, total: int, note: str = "") -> None:
        """The job is at *done* of *total* (which may change as it goes)."""
        now = (done, total, note)
        if now == self.last:
            return
        self.last = now
        if self.tty:
            self.bar.total = total
            self.bar.n = done
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.refresh()
        else:
            tail = f" ({note})" if note else ""
            print(f"{self.desc}: {done}/{total} {self.unit}{tail}", file=self.out, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.bar.close()
