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
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.client import open_rpc_client
from shufflefs.storage.protocol import StorageStub, chunk_id

MiB = 1 << 20
ORPHAN_INO = 987_654_321  # no file has it


def fsck(c: ProcessCluster, *extra: str) -> tuple[int, dict[str, Any]]:
    result = shufflefs("fsck", "--json", "--config", str(c.config), *extra, check=False)
    assert result.stdout.count("\n") == 1, result.stdout + result.stderr
    return result.returncode, json.loads(result.stdout)


def damage(c: ProcessCluster, short: int, lost: int, thin: int) -> list[tuple[int, str]]:
    """Plant an orphan of no file and one past the end of *short* (chunk 3
    of a 3-chunk file, on the chain it would live on); cut chunk 2 of *lost*
    on every replica and chunk 0 of *thin* on its chain's tail only. Returns
    the orphans: (target, chunk)."""
    routing = Routing(c.routing())
    _, secret = load_client_config(c.config)
    chains = sorted(routing.chains)

    def head(chain: int) -> tuple[str, int, int]:
        info = routing.chain(chain)
        return routing.target_address(info["targets"][0]), info["targets"][0], info["version"]

    async def run() -> list[tuple[int, str]]:
        async with open_rpc_client(secret) as rpc:
            page = await MetaStub(rpc, routing.meta_address()).list_files(0, 1000)
            layouts = {ino: layout for ino, _, layout in page["files"]}
            address, target, version = head(chains[0])
            stub = StorageStub(rpc, address, timeout=30)
            orphan = chunk_id(ORPHAN_INO, 0)
            await stub.write(target, chains[0], version, orphan, 0, MiB, b"x" * 100)
            orphans = [(t, orphan.hex()) for t in routing.chain(chains[0])["targets"]]
            layout = layouts[short]
            chain = layout["chains"][3 % len(layout["chains"])]
            orphans += [(t, chunk_id(short, 3).hex()) for t in routing.chain(chain)["targets"]]
            address, target, version = head(chain)
            await StorageStub(rpc, address, timeout=30).write(
                target, chain, version, chunk_id(short, 3), 0, MiB, b"y" * 10
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
            return orphans

    return trio.run(run)


def test_fsck_finds_orphans_missing_and_under_replicated_chunks(tmp_path: Path) -> None:
    c = ProcessCluster(tmp_path / "data", storage_nodes=2, replicas=2)
    c.up(mount=False)
    try:
        with Client(c.config) as fs:
            for name, size in (("a", 3 * MiB), ("lost", 3 * MiB), ("thin", MiB), ("empty", 0)):
                fs.write_bytes(f"/{name}", bytes([len(name)]) * size)
            short, lost = fs.stat("/a").st_ino, fs.stat("/lost").st_ino
            thin = fs.stat("/thin").st_ino
        code, clean = fsck(c)
        assert code == 0 and clean["files"] == 4 and clean["targets"] == 2, clean
        assert clean["chunks"] == 2 * 7  # 3 + 3 + 1 chunks, on both replicas
        for kind in ("orphans", "missing", "under_replicated", "length_mismatches", "errors"):
            assert clean[kind] == [], clean

        planted = damage(c, short, lost, thin)
        code, found = fsck(c)
        print(f"fsck found: {found}")
        assert code == 1
        assert sorted((o["target"], o["chunk"]) for o in found["orphans"]) == sorted(planted)
        assert [(m["ino"], m["index"]) for m in found["missing"]] == [(lost, 2)]
        [under] = found["under_replicated"]
        assert (under["ino"], under["index"], len(under["missing_on"])) == (thin, 0, 1)
        assert found["length_mismatches"] == [] and found["errors"] == []

        code, repaired = fsck(c, "--repair")
        print(f"fsck --repair: {repaired}")
        assert code == 1  # the lost chunk has no copy anywhere
        # the orphans (one chain call each: remove_file, truncate_file), the copy
        assert len(repaired["repaired"]) == 3, repaired
        left = repaired["remaining"]
        assert left["orphans"] == [] and left["under_replicated"] == []
        assert [(m["ino"], m["index"]) for m in left["missing"]] == [(lost, 2)]
        with Client(c.config) as fs:
            assert fs.read_bytes("/thin") == bytes([4]) * MiB
            assert fs.read_bytes("/a") == bytes([1]) * 3 * MiB
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
