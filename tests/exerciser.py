"""An fsx-like file exerciser, run as its own process on a mount during fault
tests (a storage daemon or a metadata server killed mid-run).

    python exerciser.py FILE SEED OPS SECONDS REPORT

Random writes, reads, truncates (shrinking and extending, by ftruncate),
reads through a shared mmap, fsyncs, close + reopen and O_TRUNC reopens of
FILE, each checked against an in-memory model of the bytes the file must
hold. Like fsx it stops at the first error or wrong byte and says which
operation it was, with the operations before it. Bounded by OPS operations
and SECONDS (or SIGUSR2: stop now). REPORT.progress holds the operations done so far (so a test can
wait until it is under way); REPORT gets the JSON result: `ops`, `errors`
(at most one: the failure that stopped it), `wrong`, `longest_s` (the
slowest operation: the stall a fault caused), `counts` per kind, `size`.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MAX_SIZE = 3 << 20  # spans several chunks (and so chains) at 1 MiB chunks
MAX_IO = 128 << 10
KINDS = (
    ("write", 30),
    ("read", 25),
    ("truncate", 15),
    ("mapread", 12),
    ("fsync", 6),
    ("reopen", 8),
    ("otrunc", 2),
)
HISTORY = 12  # operations (and states of the model) kept to explain a failure
MUTATIONS = {"write", "truncate", "otrunc"}


class Mismatch(Exception):
    """The file disagrees with the model."""

    def __init__(self, text: str, offset: int = 0, got: bytes = b"") -> None:
        super().__init__(text)
        self.offset = offset
        self.got = got


class Exerciser:
    def __init__(self, path: str, seed: int) -> None:
        self.path = path
        self.rng = random.Random(seed)
        self.model = bytearray()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.counts = {kind: 0 for kind, _ in KINDS}
        self.history: list[str] = []
        # the model before each of the last mutations, newest last: what a
        # wrong read returned, if it is an older state of the file
        self.past: list[bytes] = []
        # the model when a SIGUSR1 came (a test sends one when it kills a server)
        self.marked: bytes | None = None
        self.mark_wanted = False
        self._kinds = [k for k, _ in KINDS]
        self._weights = [w for _, w in KINDS]

    def close(self) -> None:
        os.close(self.fd)

    def step(self) -> None:
        kind = self.rng.choices(self._kinds, self._weights)[0]
        if self.mark_wanted:
            self.marked, self.mark_wanted = bytes(self.model), False
        if kind in MUTATIONS:
            self.past.append(bytes(self.model))
            del self.past[:-HISTORY]
        getattr(self, f"do_{kind}")()
        self.counts[kind] += 1

    def _note(self, text: str) -> None:
        self.history.append(text)
        del self.history[:-HISTORY]

    def _range(self) -> tuple[int, int]:
        offset = self.rng.randrange(0, MAX_SIZE)
        length = self.rng.randint(1, min(MAX_IO, MAX_SIZE - offset))
        return offset, length

    def _check(self, what: str, offset: int, got: bytes) -> None:
        want = bytes(self.model[offset : offset + len(got)])
        expected_len = max(0, min(len(self.model) - offset, len(got)))
        if got != want or len(want) != expected_len:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None
            )
            raise Mismatch(
                f"{what}: {len(got)} bytes at {offset} differ from the model "
                f"(model size {len(self.model)}, first bad byte at {first})",
                offset,
                got,
            )

    def do_write(self) -> None:
        offset, length = self._range()
        data = self.rng.randbytes(length)
        self._note(f"write {offset}+{length}")
        n = os.pwrite(self.fd, data, offset)
        if n != length:
            raise OSError(f"short write {n} of {length}")
        if offset > len(self.model):
            self.model.extend(bytes(offset - len(self.model)))
        self.model[offset : offset + length] = data

    def do_read(self) -> None:
        offset, length = self._range()
        self._note(f"read {offset}+{length}")
        got = os.pread(self.fd, length, offset)
        if len(got) != max(0, min(length, len(self.model) - offset)):
            raise Mismatch(
                f"read {offset}+{length}: got {len(got)} bytes, model size {len(self.model)}",
                offset,
                got,
            )
        self._check("read", offset, got)

    def do_truncate(self) -> None:
        size = self.rng.randrange(0, MAX_SIZE)
        self._note(f"ftruncate {size} (from {len(self.model)})")
        os.ftruncate(self.fd, size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model.extend(bytes(size - len(self.model)))

    def do_mapread(self) -> None:
        size = len(self.model)
        if size == 0:
            return
        offset = self.rng.randrange(0, size)
        length = self.rng.randint(1, min(MAX_IO, size - offset))
        self._note(f"mapread {offset}+{length} (size {size})")
        with mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            got = m[offset : offset + length]
        self._check("mapread", offset, got)

    def do_fsync(self) -> None:
        self._note("fsync")
        os.fsync(self.fd)

    def do_reopen(self) -> None:
        self._note("close, reopen")
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR)
        size = os.fstat(self.fd).st_size
        if size != len(self.model):
            raise Mismatch(f"reopened: size {size}, model size {len(self.model)}")

    def do_otrunc(self) -> None:
        self._note("close, reopen with O_TRUNC")
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR | os.O_TRUNC)
        del self.model[:]

    def diagnose(self, exc: Mismatch) -> dict[str, Any]:
        """What kind of wrong a mismatch is: which bytes, whether they are
        zeros or an older state of the file, and whether reading again (the
        same descriptor, a new one, O_DIRECT past every cache) still sees them."""
        offset, got = exc.offset, exc.got
        want = bytes(self.model[offset : offset + len(got)])
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b]
        out: dict[str, Any] = {"offset": offset, "length": len(got), "model_size": len(self.model)}
        if bad:
            out.update(
                first_bad=offset + bad[0],
                last_bad=offset + bad[-1],
                bad_bytes=len(bad),
                bad_are_zero=all(got[i] == 0 for i in bad),
            )
        for back, old in enumerate(reversed(self.past), start=1):
            if old[offset : offset + len(got)] == got:
                out["equals_model_ops_ago"] = back  # mutations ago
                break
        if self.marked is not None:
            out["equals_model_at_signal"] = self.marked[offset : offset + len(got)] == got
        try:
            out["reread_same_fd_ok"] = os.pread(self.fd, len(got), offset) == want
            fd = os.open(self.path, os.O_RDONLY)
            try:
                out["reread_new_fd_ok"] = os.pread(fd, len(got), offset) == want
            finally:
                os.close(fd)
            start = offset & ~4095
            end = (offset + len(got) + 4095) & ~4095
            buf = mmap.mmap(-1, end - start)
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            try:
                n = os.preadv(fd, [buf], start)
            finally:
                os.close(fd)
            direct = bytes(buf[offset - start : min(n, offset - start + len(got))])
            out["reread_direct_ok"] = direct == want
        except OSError as read_exc:
            out["reread_error"] = str(read_exc)
        return out

    def verify_all(self) -> None:
        """The whole file, once at the end."""
        self._note("final read of the whole file")
        size = os.fstat(self.fd).st_size
        if size != len(self.model):
            raise Mismatch(f"final size {size}, model size {len(self.model)}")
        self._check("final read", 0, os.pread(self.fd, size + 1, 0))


def _progress(report: str, ops: int) -> None:
    tmp = f"{report}.progress.tmp"
    Path(tmp).write_text(str(ops))
    os.replace(tmp, f"{report}.progress")


def run(path: str, seed: int, max_ops: int, seconds: float, report: str) -> dict[str, Any]:
    ex = Exerciser(path, seed)

    stop = False

    def mark(signum: int, frame: object) -> None:
        ex.mark_wanted = True

    def finish(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGUSR1, mark)
    signal.signal(signal.SIGUSR2, finish)  # stop after this op (then the final check)
    ops = wrong = 0
    longest = 0.0
    errors: list[str] = []
    diagnosis: dict[str, Any] = {}
    deadline = time.monotonic() + seconds
    next_progress = 0.0
    try:
        while ops < max_ops and time.monotonic() < deadline and not stop:
            if time.monotonic() >= next_progress:
                _progress(report, ops)
                next_progress = time.monotonic() + 0.2
            t0 = time.monotonic()
            try:
                ex.step()
            except Mismatch as exc:
                wrong += 1
                errors.append(f"op {ops}: {exc}")
                diagnosis = ex.diagnose(exc)
                break
            except OSError as exc:
                errors.append(f"op {ops}: {ex.history[-1]}: {exc}")
                break
            longest = max(longest, time.monotonic() - t0)
            ops += 1
        if not errors:
            try:
                ex.verify_all()
            except Mismatch as exc:
                wrong += 1
                errors.append(str(exc))
                diagnosis = ex.diagnose(exc)
            except OSError as exc:
                errors.append(f"final read: {exc}")
    finally:
        ex.close()
    _progress(report, ops)
    result = {
        "ops": ops,
        "errors": errors,
        "wrong": wrong,
        "longest_s": round(longest, 3),
        "counts": ex.counts,
        "size": len(ex.model),
        "history": ex.history if errors else [],
        "diagnosis": diagnosis,
    }
    Path(report).write_text(json.dumps(result))
    return result


# ---- for tests: run it as a process --------------------------------------------------


def start(path: Path, seed: int, ops: int, seconds: float, report: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, __file__, str(path), str(seed), str(ops), str(seconds), str(report)]
    )


def finish(procs: list[subprocess.Popen[bytes]]) -> None:
    """Ask running exercisers to stop after their current op (SIGUSR2): a
    test ends them once what it waited for has happened, not at a fixed time."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR2)


def ops_so_far(report: Path) -> int:
    try:
        return int(Path(f"{report}.progress").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def result(report: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(report.read_text())
    return out


if __name__ == "__main__":
    file, seed_arg, ops_arg, seconds_arg, report_arg = sys.argv[1:6]
    outcome = run(file, int(seed_arg), int(ops_arg), float(seconds_arg), report_arg)
    sys.exit(1 if outcome["errors"] else 0)
