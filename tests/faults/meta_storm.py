"""A namespace storm on a mount, for metadata failover tests.

Usage: meta_storm.py DIR SECONDS REPORT

Creates files (O_EXCL, with content), renames and unlinks them in DIR for
SECONDS (or until SIGUSR2: a test stops it once it has run on), keeping a
model of what must be there. An operation applied twice
shows as an error (a retried create answering EEXIST, a retried rename or
unlink ENOENT). Writes REPORT (JSON): the model, every error, how many
operations ran and the longest one took (the stall), and REPORT.progress
with the count so far.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path


def content(i: int) -> bytes:
    return (b"%08d" % i) * (64 + i % 200)


_stop = False


def _stop_now(signum: int, frame: object) -> None:
    global _stop
    _stop = True


def main() -> int:
    signal.signal(signal.SIGUSR2, _stop_now)
    directory, seconds, report = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    directory.mkdir(exist_ok=True)
    rng = random.Random(str(directory))
    model: dict[str, int] = {}  # name -> the content number it holds
    errors: list[str] = []
    stall, ops = 0.0, 0
    progress = Path(f"{report}.progress")
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end and len(errors) < 20 and not _stop:
        i += 1
        t0 = time.monotonic()
        try:
            if model and i % 5 == 0:
                name = rng.choice(sorted(model))
                os.unlink(directory / name)
                del model[name]
            elif model and i % 3 == 0:
                name = rng.choice(sorted(model))
                new = f"r{i}"
                os.rename(directory / name, directory / new)
                model[new] = model.pop(name)
            else:
                name = f"f{i}"
                fd = os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                try:
                    os.write(fd, content(i))
                finally:
                    os.close(fd)
                model[name] = i
        except OSError as exc:
            errors.append(f"op {i}: {exc}")
        ops += 1
        stall = max(stall, time.monotonic() - t0)
        if ops % 10 == 0:  # replaced whole: a reader never sees it empty or half written
            tmp = progress.with_name(progress.name + ".tmp")
            tmp.write_text(str(ops))
            os.replace(tmp, progress)
    report.write_text(json.dumps({"model": model, "errors": errors, "ops": ops, "stall": stall}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
