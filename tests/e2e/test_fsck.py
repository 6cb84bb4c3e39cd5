"""`shufflefs fsck` on a real cluster (2 storage nodes, 2 replicas): an
orphan chunk planted through the storage write RPC, a chunk cut from every
replica and one cut from a single replica are found, exactly; `--repair`
removes the orphan and re-copies the under-replicated chunk but cannot make
the lost one (exit 1); once that file is deleted the cluster is clean. With
the metadata server down, fsck fails in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from clusters import ProcessCluster
from harness import shufflefs

from shufflefs.client import Client
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.protocol import MetaStub
from shufflefs.rpc.client import open_rpc_client
from shufflefs.storage.protocol import StorageStub, chunk_id

MiB = 1 << 20
ORPHAN_INO = 987_654_321  # no file has it


def fsck(c: ProcessCluster, *extra: str) -> tuple[int, dict[str, Any]]:
    result = shufflefs("fsck", "--json", "--config", str(c.config), *extra, check=False)
    assert result.stdout.count("\n") == 1, result.stdout + result.stderr
    return result.returncode, json.loads(result.stdout)


def damage(c: ProcessCluster, lost: int, thin: int) -> list[int]:
    """Plant an orphan; cut chunk 2 of *lost* on every replica and chunk 0
    of *thin* on its chain's tail only. Returns the orphan chain's targets."""
    routing = Routing(c.routing())
    _, secret = load_client_config(c.config)
    chains = sorted(routing.chains)

    def head(chain: int) -> tuple[str, int, int]:
        info = routing.chain(chain)
        return routing.target_address(info["targets"][0]), info["targets"][0], info["version"]

    async def run() -> list[int]:
        async with open_rpc_client(secret) as rpc:
            page = await MetaStub(rpc, routing.meta_address()).list_files(0, 1000)
            layouts = {ino: layout for ino, _, layout in page["files"]}
            address, target, version = head(chains[0])
            stub = StorageStub(rpc, address, timeout=30)
            await stub.write(
                target, chains[0], version, chunk_id(ORPHAN_INO, 0), 0, MiB, b"x" * 100
            )
            layout = layouts[lost]
            chain = layout["chains"][2 % len(layout["chains"])]
            address, target, version = head(chain)
            await StorageStub(rpc, address, timeout=30).truncate_file(
                target, chain, version, lost, 2 * MiB, MiB
            )
            layout = layouts[thin]
            chain = layout["chains"][0]
            tail = routing.chain(chain)["targets"][-1]
            await StorageStub(rpc, routing.target_address(tail), timeout=30).replicate_truncate(
                tail, chain, routing.chain(chain)["version"], thin, 0, MiB
            )
            return list(routing.chain(chains[0])["targets"])

    return trio.run(run)


def test_fsck_finds_orphans_missing_and_under_replicated_chunks(tmp_path: Path) -> None:
    c = ProcessCluster(tmp_path / "data", storage_nodes=2, replicas=2)
    c.up(mount=False)
    try:
        with Client(c.config) as fs:
            for name, size in (("a", 3 * MiB), ("lost", 3 * MiB), ("thin", MiB), ("empty", 0)):
                fs.write_bytes(f"/{name}", bytes([len(name)]) * size)
            lost, thin = fs.stat("/lost").st_ino, fs.stat("/thin").st_ino
        code, clean = fsck(c)
        assert code == 0 and clean["files"] == 4 and clean["targets"] == 2, clean
        assert clean["chunks"] == 2 * 7  # 3 + 3 + 1 chunks, on both replicas
        for kind in ("orphans", "missing", "under_replicated", "length_mismatches", "errors"):
            assert clean[kind] == [], clean

        orphan_targets = damage(c, lost, thin)
        code, found = fsck(c)
        print(f"fsck found: {found}")
        assert code == 1
        orphan = chunk_id(ORPHAN_INO, 0).hex()
        assert sorted((o["target"], o["chunk"]) for o in found["orphans"]) == sorted(
            (t, orphan) for t in orphan_targets
        )
        assert [(m["ino"], m["index"]) for m in found["missing"]] == [(lost, 2)]
        [under] = found["under_replicated"]
        assert (under["ino"], under["index"], len(under["missing_on"])) == (thin, 0, 1)
        assert found["length_mismatches"] == [] and found["errors"] == []

        code, repaired = fsck(c, "--repair")
        print(f"fsck --repair: {repaired}")
        assert code == 1  # the lost chunk has no copy anywhere
        assert len(repaired["repaired"]) == 2, repaired  # the orphan (one chain call), the copy
        left = repaired["remaining"]
        assert left["orphans"] == [] and left["under_replicated"] == []
        assert [(m["ino"], m["index"]) for m in left["missing"]] == [(lost, 2)]
        with Client(c.config) as fs:
            assert fs.read_bytes("/thin") == bytes([4]) * MiB
            fs.unlink("/lost")  # its GC job or its removal: either way not an orphan
        code, after = fsck(c)
        assert code == 0, after
        assert after["files"] == 3 and after["orphans"] == [] and after["missing"] == []
        c.kill("meta")  # an unreachable metadata server: one line, no traceback
        result = shufflefs("fsck", "--config", str(c.config), check=False, timeout=60)
        print(f"fsck, metadata server down: {result.returncode} {result.stderr!r}")
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
    finally:
        c.down()
