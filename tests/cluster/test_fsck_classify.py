"""How `shufflefs fsck` places each listed chunk (cluster/fsck.py), on a
made-up routing map: 2 chains of 2 targets, chunk k on chains[k % 2]."""

from __future__ import annotations

from typing import Any

from shufflefs.cluster.fsck import Scan, classify, find_missing
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.protocol import Layout
from shufflefs.storage.protocol import chunk_id

CS = 1 << 20
LAYOUT: Layout = {"chunk_size": CS, "chains": [1, 2]}


def routing() -> Routing:
    target: dict[str, Any] = {"path": "/t", "capacity": 1, "free": 1, "used": 0, "chunks": 0}
    info: Any = {
        "version": 1,
        "cluster_id": "x",
        "config": {},
        "nodes": [],
        "targets": [{**target, "id": t, "node": 1, "state": "serving"} for t in (1, 2, 3, 4)],
        "chains": [
            {"id": 1, "version": 1, "targets": [1, 2]},
            {"id": 2, "version": 1, "targets": [3, 4]},
        ],
    }
    return Routing(info)


def test_chunks_are_placed_and_problems_found() -> None:
    r = routing()
    scan = Scan(listed={1, 2, 3, 4})
    scan.files = {10: (3 * CS - 5, LAYOUT), 11: (CS, LAYOUT)}
    scan.jobs[12].append({"ino": 12, "size": 0, "layout": LAYOUT})  # freed, GC pending
    scan.jobs[11].append({"ino": 11, "size": CS, "layout": LAYOUT})  # shrunk, cut pending
    listing = [
        (1, chunk_id(10, 0), CS),
        (2, chunk_id(10, 0), CS),
        (3, chunk_id(10, 1), CS),  # under-replicated: not on target 4
        (1, chunk_id(10, 2), CS),  # longer than the file allows
        (2, chunk_id(10, 2), CS - 5),
        (3, chunk_id(10, 3), 10),  # past the end
        (3, chunk_id(10, 4), 10),  # chunk 4 belongs on chain 1
        (1, chunk_id(99, 0), 10),  # no such file
        (3, chunk_id(12, 1), 10),  # GC pending: not an orphan
        (3, chunk_id(11, 1), 10),  # past the end, but a cut is pending
        (1, chunk_id(11, 0), CS),
        (2, chunk_id(11, 0), CS),
    ]
    for target, cid, length in listing:
        classify(scan, r, target, cid, length)
    find_missing(scan, r)
    whys = sorted((o["ino"], o["index"], o["target"], o["why"]) for o in scan.orphans)
    assert whys == [
        (10, 3, 3, f"past the file's end (size {3 * CS - 5})"),
        (10, 4, 3, "not on the file's chain 1"),
        (99, 0, 1, "no such file"),
    ]
    assert [(x["target"], x["index"], x["allowed"]) for x in scan.length_mismatches] == [
        (1, 2, CS - 5)
    ]
    assert scan.under_replicated == [{"ino": 10, "index": 1, "chain": 2, "missing_on": [4]}]
    assert scan.missing == []


def test_absent_everywhere_is_missing_and_unlisted_targets_do_not_count() -> None:
    r = routing()
    scan = Scan(listed={1, 2, 3})  # target 4 could not be listed
    scan.files = {10: (2 * CS, LAYOUT)}
    classify(scan, r, 3, chunk_id(10, 1), CS)
    find_missing(scan, r)
    assert scan.missing == [{"ino": 10, "index": 0, "chain": 1}]
    assert scan.under_replicated == [] and scan.orphans == []
