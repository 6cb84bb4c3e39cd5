"""`shufflefs fsck`: check the namespace against the chunks on every storage target.

The metadata server lists every regular file's (inode, size, layout)
(`MetaStub.list_files`, read-only) and the GC and truncate jobs it still owes
storage (`pending_jobs`); every serving target lists its chunks
(`StorageStub.list_chunks`). A chunk id is (inode, index) and chunk k of a
file lives on ``chains[k % len(chains)]`` (client/layout.py), so each chunk
has one place it may be. Found:

* orphans: a chunk no file accounts for (no such file, past the file's end,
  or on a chain the layout does not put it on), unless a pending GC or
  truncate job is about to remove it;
* missing: a chunk within the file's length absent on every serving replica
  of its chain (a hole left by a truncate that extended the file, or a write
  past the end, looks the same: shufflefs keeps no record of holes);
* under-replicated: present on some serving replicas of its chain, not all;
* length mismatches: a chunk holding bytes past the file's length.

``--repair`` removes orphans with the storage daemons' chain calls the GC
uses (`remove_file` of the inode on a chain the file has no chunk on, else
`truncate_file` to the file's length, re-read just before), carried out on
every replica, and re-copies under-replicated chunks by having the lacking
replica scrub that one chunk against the chain's head (storage/scrub.py). It
then checks again: the exit code is 1 if problems remain (or a target could
not be listed). Run it while the cluster is quiet: a write in flight (chunk
data ahead of its length update) is reported as a length mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO

from shufflefs.cluster.admin import with_mgmtd
from shufflefs.cluster.cli_errors import explain_connection_error
from shufflefs.cluster.progress import Progress
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.protocol import Layout, PendingJob
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import CHUNK_ID, StorageStub, chain_call_timeout

LIST_PAGE = 1000  # chunks per list_chunks call
FILES_PAGE = 1024  # files per list_files call
CALL_TIMEOUT = 30.0
SCRUB_TIMEOUT = 120.0  # a scrub page may copy a chunk from the head


@dataclass
class Scan:
    """One look at the cluster: what was found where."""

    files: dict[int, tuple[int, Layout]] = field(default_factory=dict)
    jobs: dict[int, list[PendingJob]] = field(default_factory=lambda: defaultdict(list))
    # (ino, index) -> {target: chunk length}, for chunks where the file puts them
    present: dict[tuple[int, int], dict[int, int]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    listed: set[int] = field(default_factory=set)  # targets whose listing is complete
    chunks: int = 0
    orphans: list[dict[str, Any]] = field(default_factory=list)
    missing: list[dict[str, Any]] = field(default_factory=list)
    under_replicated: list[dict[str, Any]] = field(default_factory=list)
    length_mismatches: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def problems(self) -> int:
        return (
            len(self.orphans)
            + len(self.missing)
            + len(self.under_replicated)
            + len(self.length_mismatches)
        )


def chain_targets(routing: Routing, chain: int) -> list[int]:
    try:
        return list(routing.chain(chain)["targets"])
    except FsError:
        return []


def excused(scan: Scan, routing: Routing, target: int, ino: int, index: int, length: int) -> bool:
    """A pending GC or truncate job of *ino* is about to remove (or cut) this
    chunk: its removal is owed already, not lost."""
    for job in scan.jobs.get(ino, []):
        layout = job["layout"]
        on_chain = any(target in chain_targets(routing, c) for c in layout["chains"])
        if on_chain and index * layout["chunk_size"] + length > job["size"]:
            return True
    return False


def classify(scan: Scan, routing: Routing, target: int, cid: bytes, length: int) -> None:
    """Place one listed chunk: where its file says it belongs, or a problem."""
    ino, index = CHUNK_ID.unpack(cid)
    entry: dict[str, Any] = {"target": target, "chunk": cid.hex(), "ino": ino, "index": index}
    if excused(scan, routing, target, ino, index, length):
        return
    file = scan.files.get(ino)
    if file is None:
        scan.orphans.append({**entry, "why": "no such file"})
        return
    size, layout = file
    chunk_size, chains = layout["chunk_size"], layout["chains"]
    chain = chains[index % len(chains)]
    if target not in chain_targets(routing, chain):
        scan.orphans.append({**entry, "why": f"not on the file's chain {chain}"})
        return
    start = index * chunk_size
    if start >= size:
        scan.orphans.append({**entry, "why": f"past the file's end (size {size})"})
        return
    if start + length > size:
        scan.length_mismatches.append(
            {**entry, "length": length, "allowed": size - start, "size": size}
        )
    scan.present[(ino, index)][target] = length


def find_missing(scan: Scan, routing: Routing) -> None:
    """Every chunk each file's length says it has, on its chain's serving
    replicas (only those listed completely count)."""
    for ino, (size, layout) in sorted(scan.files.items()):
        chunk_size, chains = layout["chunk_size"], layout["chains"]
        for index in range((size + chunk_size - 1) // chunk_size):
            chain = chains[index % len(chains)]
            try:
                serving = [t["id"] for t in routing.serving_targets(chain)]
            except FsError:
                scan.errors.append(f"file {ino}: unknown chain {chain}")
                break
            holders = scan.present.get((ino, index), {})
            looked = [t for t in serving if t in scan.listed]
            lacking = [t for t in looked if t not in holders]
            if not lacking:
                continue
            entry = {"ino": ino, "index": index, "chain": chain}
            if len(lacking) == len(serving):
                scan.missing.append(entry)
            else:
                scan.under_replicated.append({**entry, "missing_on": lacking})


async def list_target(
    stub: StorageStub, target: int, progress: Progress, scan: Scan, total: int
) -> list[tuple[bytes, int]]:
    out: list[tuple[bytes, int]] = []
    after: bytes | None = None
    while True:
        page = await stub.list_chunks(target, after, LIST_PAGE)
        out.extend((c["chunk"], c["length"]) for c in page["chunks"])
        scan.chunks += len(page["chunks"])
        if progress.tty:  # a log gets the result only, as `scrub` does
            progress.show(scan.chunks, max(total, scan.chunks), f"target {target}")
        if not page["more"] or not page["chunks"]:
            return out
        after = page["chunks"][-1]["chunk"]


async def scan_cluster(mgmtd: MgmtdStub, rpc: RpcClient, progress_out: TextIO) -> Scan:
    routing = Routing(await mgmtd.status())
    meta = MetaStub(rpc, routing.meta_address(), timeout=CALL_TIMEOUT)
    scan = Scan()
    try:
        # files, then jobs: a file freed between the two is in both lists (a file
        # created meanwhile has chunks no listed file accounts for: run fsck quiet)
        after = 0
        while True:
            page = await meta.list_files(after, FILES_PAGE)
            for ino, size, layout in page["files"]:
                scan.files[ino] = (size, layout)
            if not page["more"] or not page["files"]:
                break
            after = page["files"][-1][0]
        for kind in ("gc", "truncate"):
            after = 0
            while True:
                jobs = await meta.pending_jobs(kind, after, 1024)
                for job in jobs:
                    scan.jobs[job["ino"]].append(job)
                if len(jobs) < 1024:
                    break
                after = jobs[-1]["ino"]
    except FsError as exc:  # one line naming the metadata server, if it is unreachable
        raise explain_connection_error(
            exc, "metadata server", meta.address, handshake=False
        ) from None
    online = {n["id"] for n in routing.nodes.values() if n["state"] == "online"}
    targets = [
        t
        for t in sorted(routing.targets.values(), key=lambda t: t["id"])
        if t["state"] == "serving"
    ]
    total = sum(t["chunks"] for t in targets)
    with Progress("fsck", "chunks", progress_out) as progress:
        for t in targets:
            if t["node"] not in online:
                scan.errors.append(f"target {t['id']}: its node {t['node']} is not online")
                continue
            stub = StorageStub(rpc, routing.target_address(t["id"]), timeout=CALL_TIMEOUT)
            try:
                listing = await list_target(stub, t["id"], progress, scan, total)
            except FsError as exc:
                scan.errors.append(f"target {t['id']}: {exc.message}")
                continue
            scan.listed.add(t["id"])
            for cid, length in listing:
                classify(scan, routing, t["id"], cid, length)
    find_missing(scan, routing)
    return scan


@dataclass
class Repairs:
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def chain_of_target(routing: Routing, target: int) -> int | None:
    for chain in routing.chains.values():
        if target in chain["targets"]:
            return chain["id"]
    return None


async def remove_orphans(
    scan: Scan, routing: Routing, rpc: RpcClient, meta: MetaStub, repairs: Repairs
) -> None:
    """One chain call per (inode, chain) with orphans, at the chain's head:
    `remove_file` where the file has no chunk on that chain (or no file
    exists), else `truncate_file` to the file's length."""
    todo: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for orphan in scan.orphans:
        chain = chain_of_target(routing, orphan["target"])
        if chain is None:
            repairs.failed.append(
                f"orphan {orphan['chunk']} on target {orphan['target']}: the target is in no chain"
            )
            continue
        todo[(orphan["ino"], chain)].append(orphan)
    for (ino, chain), orphans in sorted(todo.items()):
        ids = sorted({o["chunk"] for o in orphans})
        what = f"orphan chunk(s) {', '.join(ids)} of inode {ino} on chain {chain}"
        serving = routing.serving_targets(chain)
        if not serving:
            repairs.failed.append(f"{what}: the chain has no serving target")
            continue
        head = serving[0]["id"]
        version = routing.chain(chain)["version"]
        stub = StorageStub(
            rpc, routing.target_address(head), timeout=chain_call_timeout(len(serving))
        )
        try:
            file = scan.files.get(ino)
            if file is None:
                await stub.remove_file(head, chain, version, ino)
                repairs.done.append(f"removed {what} (no such file)")
                continue
            size, layout = file
            if chain not in layout["chains"]:
                await stub.remove_file(head, chain, version, ino)
                repairs.done.append(f"removed {what} (not a chain of the file)")
                continue
            if any(o["why"].startswith("not on") for o in orphans):
                repairs.failed.append(f"{what}: on the wrong chain of the file, no call removes it")
                continue
            now = await meta.getattr(ino)
            if now["size"] != size:
                repairs.failed.append(f"{what}: the file's size changed during fsck; rerun")
                continue
            await stub.truncate_file(head, chain, version, ino, size, layout["chunk_size"])
            repairs.done.append(f"cut {what} to the file's size {size}")
        except FsError as exc:
            repairs.failed.append(f"{what}: {exc.message}")


async def recopy(scan: Scan, routing: Routing, rpc: RpcClient, repairs: Repairs) -> None:
    """Each lacking replica scrubs the one chunk against the chain's head,
    which copies it from there (only if the head holds it: else the scrub
    would remove the other replicas' copies)."""
    for entry in scan.under_replicated:
        cid = CHUNK_ID.pack(entry["ino"], entry["index"])
        what = f"chunk {cid.hex()} (inode {entry['ino']} index {entry['index']})"
        serving = routing.serving_targets(entry["chain"])
        head = serving[0]["id"] if serving else None
        if head is None or head not in scan.present.get((entry["ino"], entry["index"]), {}):
            repairs.failed.append(f"{what}: the chain's head lacks it, no copy to make from it")
            continue
        n = int.from_bytes(cid, "big")  # the scrub page starts after its predecessor
        before = (n - 1).to_bytes(len(cid), "big") if n else None
        for target in entry["missing_on"]:
            stub = StorageStub(rpc, routing.target_address(target), timeout=SCRUB_TIMEOUT)
            try:
                result = await stub.scrub(target, before, 1)
            except FsError as exc:
                repairs.failed.append(f"{what} on target {target}: {exc.message}")
                continue
            if result["repaired"]:
                repairs.done.append(f"copied {what} to target {target} from target {head}")
            else:
                repairs.failed.append(f"{what} on target {target}: scrub copied nothing")


def as_json(scan: Scan) -> dict[str, Any]:
    return {
        "orphans": scan.orphans,
        "missing": scan.missing,
        "under_replicated": scan.under_replicated,
        "length_mismatches": scan.length_mismatches,
        "files": len(scan.files),
        "chunks": scan.chunks,
        "targets": len(scan.listed),
        "errors": scan.errors,
    }


def render(scan: Scan, seconds: float, out: TextIO) -> None:
    print(
        f"checked {len(scan.files)} files, {scan.chunks} chunks on {len(scan.listed)} targets "
        f"in {seconds:.1f}s: {len(scan.orphans)} orphan, {len(scan.missing)} missing, "
        f"{len(scan.under_replicated)} under-replicated, "
        f"{len(scan.length_mismatches)} length mismatches",
        file=out,
    )
    for o in scan.orphans:
        print(f"  orphan: chunk {o['chunk']} on target {o['target']}: {o['why']}", file=out)
    for m in scan.missing:
        print(f"  missing: inode {m['ino']} chunk {m['index']} (chain {m['chain']})", file=out)
    for u in scan.under_replicated:
        print(
            f"  under-replicated: inode {u['ino']} chunk {u['index']} (chain {u['chain']}), "
            f"absent on targets {u['missing_on']}",
            file=out,
        )
    for x in scan.length_mismatches:
        print(
            f"  length mismatch: chunk {x['chunk']} on target {x['target']} holds {x['length']} "
            f"bytes, the file's size {x['size']} allows {x['allowed']}",
            file=out,
        )
    for error in scan.errors:
        print(f"  error: {error}", file=out)


def cli_fsck(args: argparse.Namespace) -> int:
    """``shufflefs fsck [--repair] [--json] [--config FILE]``."""
    started = time.monotonic()

    async def run(mgmtd: MgmtdStub, rpc: RpcClient) -> tuple[Scan, Repairs | None, Scan | None]:
        scan = await scan_cluster(mgmtd, rpc, sys.stderr)
        if not args.repair or not (scan.orphans or scan.under_replicated):
            return scan, None, None
        routing = Routing(await mgmtd.status())
        meta = MetaStub(rpc, routing.meta_address(), timeout=CALL_TIMEOUT)
        repairs = Repairs()
        await remove_orphans(scan, routing, rpc, meta, repairs)
        await recopy(scan, routing, rpc, repairs)
        return scan, repairs, await scan_cluster(mgmtd, rpc, sys.stderr)

    scan, repairs, after = with_mgmtd(args, run)
    seconds = time.monotonic() - started
    remaining = after or scan
    if args.json:
        report = as_json(scan)
        report["repaired"] = repairs.done if repairs else []
        report["not_repaired"] = repairs.failed if repairs else []
        if after is not None:
            report["remaining"] = as_json(after)
        report["seconds"] = round(seconds, 3)
        print(json.dumps(report))
    else:
        render(scan, seconds, sys.stdout)
        if repairs is not None:
            for line in repairs.done:
                print(f"  repaired: {line}")
            for line in repairs.failed:
                print(f"  not repaired: {line}")
        if after is not None:
            print("after repair:")
            render(after, seconds, sys.stdout)
    return 1 if remaining.problems() or remaining.errors else 0
