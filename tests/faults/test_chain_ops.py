"""Every chain operation rides through a replica's death, not only reads and
writes: truncates (ftruncate, O_TRUNC) and the removal of freed files too.

Two fsx-like exercisers (tests/exerciser.py: random writes, reads,
truncates, mmap reads, reopens, each checked against a model of the bytes)
run on the mount, on different files, while one storage daemon of three is
killed with kill -9 and later restarted: both finish with zero errors and
zero wrong bytes, and afterwards every replica of every chunk is identical.
"""

from __future__ import annotations

import signal
from pathlib import Path

import exerciser
from clusters import ProcessCluster, assert_replicas_identical, wait_until

SECONDS = 90.0  # at most: each exerciser is stopped once the resync is done and seen
MAX_OPS = 50_000  # bounded in count too
DEGRADED_OPS = 100  # each exerciser runs this many ops with a replica down


def test_kill9_storage_under_two_exercisers(fault_cluster: ProcessCluster, tmp_path: Path) -> None:
    c = fault_cluster
    work = c.mountpoint / "fsx"
    work.mkdir()
    reports = [tmp_path / f"fsx{i}.json" for i in range(2)]
    procs = [
        exerciser.start(work / f"file{i}", seed=100 + i, ops=MAX_OPS, seconds=SECONDS, report=r)
        for i, r in enumerate(reports)
    ]
    try:
        wait_until(
            "both exercisers under way", lambda: all(exerciser.ops_so_far(r) >= 50 for r in reports)
        )
        at_kill = [exerciser.ops_so_far(r) for r in reports]
        c.kill("storage2")
        for p in procs:  # the model at the kill, to tell stale bytes in a failure
            p.send_signal(signal.SIGUSR1)
        c.wait_for(
            "storage2's target offline",
            lambda s: any(t["state"] == "offline" for t in s["targets"]),
        )
        # the exercisers go on through the degraded chains for a while...
        degraded = [exerciser.ops_so_far(r) for r in reports]
        wait_until(
            "both exercisers working on degraded chains",
            lambda: all(
                exerciser.ops_so_far(r) >= n + DEGRADED_OPS
                for r, n in zip(reports, degraded, strict=True)
            ),
        )
        # ...and through the resync of the returning replica, and on after it
        c.restart_missing()
        c.all_serving()
        resynced = [exerciser.ops_so_far(r) for r in reports]
        wait_until(
            "both exercisers working on the resynced chains",
            lambda: (
                any(p.poll() is not None for p in procs)  # stopped early: an error
                or all(
                    exerciser.ops_so_far(r) >= n + DEGRADED_OPS
                    for r, n in zip(reports, resynced, strict=True)
                )
            ),
        )
        exerciser.finish(procs)
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [exerciser.result(r) for r in reports]
    for r in results:
        print(f"exerciser: {r}")
    c.all_serving()
    if any(r["errors"] for r in results):  # were the replicas apart, or the reader wrong?
        try:
            print(f"after the failure: {assert_replicas_identical(c)} chunks identical")
        except AssertionError as exc:
            print(f"after the failure the replicas differ: {exc}")
    for r, before in zip(results, at_kill, strict=True):
        assert r["errors"] == [] and r["wrong"] == 0, r
        assert r["ops"] > before + 50, "the exerciser did not run on after the kill"
        assert r["counts"]["truncate"] > 0 and r["counts"]["mapread"] > 0
    assert codes == [0, 0]
    longest = max(r["longest_s"] for r in results)
    print(f"STALL under kill -9 of a storage daemon: longest op {longest:.2f}s")
    chunks = assert_replicas_identical(c)
    # both may end holding no data: cut to nothing, or cut and extended (a hole)
    holds_data = any((work / f"file{i}").read_bytes().strip(b"\0") for i in range(2))
    assert chunks > 0 or not holds_data
