"""Every shufflefs service runs Python's cyclic collector less often
(rpc/gc_tuning.py): what was alive at start is frozen out of its sight, and
a burst of short-lived containers (a request's) triggers few collections."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# A service (run_service, as every daemon and the mount start) that allocates
# short-lived containers, then reports the collections they triggered and
# what the collector had frozen.
SERVICE = textwrap.dedent(
    """
    import gc, json, sys
    from shufflefs.rpc.runtime import run_service

    async def main():
        before = [g["collections"] for g in gc.get_stats()]
        for _ in range(20):  # a decoded listing's containers, held a moment each
            listing = [{"ino": i, "attrs": [i, i + 1]} for i in range(10_000)]
            del listing
        after = [g["collections"] for g in gc.get_stats()]
        print(json.dumps({
            "collections": [b - a for a, b in zip(before, after)],
            "frozen": gc.get_freeze_count(),
        }))

    sys.exit(run_service("gctest", main))
    """
)


def run(code: str) -> dict[str, list[int] | int]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    result: dict[str, list[int] | int] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_services_freeze_what_they_start_with_and_collect_rarely() -> None:
    tuned = run(SERVICE)
    assert isinstance(tuned["frozen"], int) and tuned["frozen"] > 10_000  # the imports
    counts = tuned["collections"]  # young, middle, full
    assert isinstance(counts, list) and counts[2] == 0  # no full collection


def test_the_check_fails_without_the_tuning() -> None:
    """The measure above is sound: the same loop outside run_service (the
    collector's defaults) collects often and freezes nothing."""
    started = 'sys.exit(run_service("gctest", main))'
    plain = SERVICE.replace(started, "import trio; trio.run(main)")
    assert plain != SERVICE
    untuned = run(plain)
    assert untuned["frozen"] == 0
    tuned = run(SERVICE)
    assert isinstance(untuned["collections"], list) and isinstance(tuned["collections"], list)
    assert sum(untuned["collections"]) > 10 * max(1, sum(tuned["collections"]))
