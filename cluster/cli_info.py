"""`shufflefs info PATH`: a file's inode, layout, chains, and where each chunk's replicas are.

For a regular file it lists the first ``--chunks`` chunks: the chain each
lives on (chunk k on ``chains[k % len(chains)]``, `client/layout.py`) and,
for every member of that chain, the target, its state, node and address,
and what the storage daemon holds there (version and length, or nothing: a
hole, or a replica still missing it). A replica that does not answer is
reported as such, not as a failure of the command.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import sys
from typing import Any, TextIO

import trio

from shufflefs.client.fs import FileSystem
from shufflefs.cluster.cli_files import cluster_path, with_filesystem
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.cluster.routing import Routing
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import StorageStub, chunk_id

REPLICA_TIMEOUT = 3.0


def kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
    ):
        if test(mode):
            return name
    return "special"


async def replica(
    rpc: RpcClient, routing: Routing, target: int, cid: bytes, out: dict[str, Any]
) -> None:
    t = routing.targets.get(target)
    node = routing.nodes.get(t["node"]) if t else None
    out.update(
        {
            "target": target,
            "state": t["state"] if t else "unknown",
            "node": t["node"] if t else None,
            "address": node["address"] if node else None,
        }
    )
    if node is None or node["state"] != "online":
        out["holds"] = None
        out["error"] = "node offline"
        return
    try:
        info = await StorageStub(rpc, node["address"], timeout=REPLICA_TIMEOUT).chunk_info(
            target, cid
        )
    except FsError as exc:
        out["holds"] = False if exc.code == errno.ENOENT else None
        if exc.code != errno.ENOENT:
            out["error"] = exc.message
        return
    out.update({"holds": True, "version": info["version"], "length": info["length"]})


async def describe(fs: FileSystem, rpc: RpcClient, path: str, max_chunks: int) -> dict[str, Any]:
    attr = await fs.resolve(path, follow=False)
    result: dict[str, Any] = {
        "path": path,
        "ino": attr["ino"],
        "type": kind_of(attr["mode"]),
        "mode": oct(stat.S_IMODE(attr["mode"])),
        "size": attr["size"],
        "nlink": attr["nlink"],
        "uid": attr["uid"],
        "gid": attr["gid"],
        "mtime": attr["mtime"] / 1e9,
    }
    if not stat.S_ISREG(attr["mode"]):
        return result
    f, attr = await fs.open(attr["ino"], os.O_RDONLY)
    try:
        layout = f.layout
    finally:
        await fs.release(f.fh)
    assert layout is not None
    routing = fs.routing.current
    size = layout["chunk_size"]
    total = -(-attr["size"] // size)
    chains = layout["chains"]
    result["layout"] = {"chunk_size": size, "chains": chains}
    result["chunk_count"] = total
    result["chains"] = [
        {
            "id": c,
            "version": routing.chains[c]["version"] if c in routing.chains else None,
            "targets": routing.chains[c]["targets"] if c in routing.chains else [],
        }
        for c in chains
    ]
    chunks: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        for index in range(min(total, max_chunks)):
            chain = chains[index % len(chains)]
            cid = chunk_id(attr["ino"], index)
            members = routing.chains[chain]["targets"] if chain in routing.chains else []
            replicas: list[dict[str, Any]] = [{} for _ in members]
            chunks.append(
                {"index": index, "chunk": cid.hex(), "chain": chain, "replicas": replicas}
            )
            for target, slot in zip(members, replicas, strict=True):
                nursery.start_soon(replica, rpc, routing, target, cid, slot)
    result["chunks"] = chunks
    result["chunks_listed"] = len(chunks)
    return result


def render(info: dict[str, Any], out: TextIO) -> None:
    print(
        f"{info['path']}: {info['type']}, inode {info['ino']}, {info['size']} bytes, "
        f"mode {info['mode']}, links {info['nlink']}, uid {info['uid']} gid {info['gid']}",
        file=out,
    )
    if "layout" not in info:
        return
    layout = info["layout"]
    print(
        f"layout: chunk size {layout['chunk_size']}, {info['chunk_count']} chunks striped over "
        f"chains {', '.join(map(str, layout['chains']))}",
        file=out,
    )
    for chunk in info["chunks"]:
        where = []
        for r in chunk["replicas"]:
            held = (
                f"v{r['version']} {r['length']}B"
                if r.get("holds")
                else "absent"
                if r.get("holds") is False
                else r.get("error", "?")
            )
            where.append(f"target {r['target']}@node {r['node']} ({r['state']}, {held})")
        print(f"  chunk {chunk['index']:>5} chain {chunk['chain']}: " + "; ".join(where), file=out)
    if info["chunks_listed"] < info["chunk_count"]:
        print(f"  ... {info['chunk_count'] - info['chunks_listed']} more (--chunks N)", file=out)


def cli_info(args: argparse.Namespace) -> int:
    """``shufflefs info PATH [--chunks N] [--json]``."""
    path = cluster_path(args.path)

    async def run(fs: FileSystem, mgmtd: MgmtdStub, rpc: RpcClient) -> dict[str, Any]:
        return await describe(fs, rpc, path, args.chunks)

    info = with_filesystem(args, run)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        render(info, sys.stdout)
    return 0
