"""`shufflefs scrub` and `shufflefs target add`, the real commands (run as
subprocesses) against a cluster of real storage daemons and a real mgmtd in
this test process (tests/chains.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import trio
from clusters import ChainCluster, eventually
from harness import flip

from shufflefs.cluster.scrub import Progress
from shufflefs.storage.protocol import chunk_id


async def shufflefs(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The real command, while this process keeps serving the cluster."""
    return await trio.run_process(
        [sys.executable, "-m", "shufflefs.cluster.cli", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_scrub_command_finds_and_repairs(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    cids = [chunk_id(60, i) for i in range(5)]
    for i, cid in enumerate(cids):
        await cluster.write(chain, cid, 0, bytes([i]) * (2000 + i))
    await cluster.sync_maps()
    config = cluster.write_client_config()
    done = await shufflefs("scrub", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr.decode()
    report = json.loads(done.stdout)
    assert report["chunks_checked"] == 15 and report["targets"] == 3
    assert (report["corrupt_found"], report["repaired"], report["unrecoverable"]) == (0, 0, 0)
    assert b"\r" not in done.stderr  # no progress bar without a terminal
    flip(cluster.node_of(tail).store(tail).file_path(cids[2]) or "", 5)
    done = await shufflefs("scrub", "--config", str(config), "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["corrupt_found"] == 1 and report["repaired"] == 1
    await cluster.assert_identical(chain)
    for target in (head, middle, tail):  # a chunk damaged everywhere cannot be repaired
        flip(cluster.node_of(target).store(target).file_path(cids[4]) or "", 7)
    done = await shufflefs("scrub", "--config", str(config))
    assert done.returncode == 1
    text = done.stdout.decode()
    assert "scrubbed 15 chunks on 3 targets" in text  # one damaged copy on each of them
    assert "3 corrupt, 0 divergent, 0 repaired, 3 unrecoverable" in text


async def test_target_add_joins_a_chain_and_syncs(cluster: ChainCluster) -> None:
    [chain] = cluster.chain_ids()
    head, middle, tail = cluster.members(chain)
    for i in range(8):
        await cluster.write(chain, chunk_id(61, i), 0, bytes([i + 1]) * (3000 + i))
    spare_node = cluster.add_node()  # a fourth node: its own target stays a spare
    await cluster.start_node(spare_node)
    await cluster.stop_node(cluster.node_of(tail))  # a member goes down for good
    routing = await cluster.sync_maps()
    assert cluster.state is not None
    config = cluster.write_client_config()
    new_path = cluster.base / "node4-new-disk"
    done = await shufflefs(
        "target",
        "add",
        "--node",
        str(spare_node.node_id),
        str(new_path),
        "--config",
        str(config),
        "--json",
    )
    assert done.returncode == 0, done.stderr.decode()
    added = json.loads(done.stdout)
    new = added["target_id"]
    assert added["chain"] == chain and added["replaced"] == tail and added["state"] == "syncing"
    assert (new_path / "target.json").exists()
    await eventually(
        lambda: cluster.state is not None and cluster.state.targets[new].state == "serving"
    )
    routing = await cluster.sync_maps()
    assert [t["id"] for t in routing.write_targets(chain)] == [head, middle, new]
    await cluster.assert_identical(chain)
    # a restart keeps serving it, though the config lists only the first target
    await cluster.stop_node(spare_node)
    await cluster.start_node(spare_node)
    await cluster.sync_maps()
    assert new in spare_node.target_ids
    # it was cut out while stopped: it syncs again (finding nothing to copy)
    await eventually(
        lambda: cluster.state is not None and cluster.state.targets[new].state == "serving"
    )
    await eventually(lambda: bool(spare_node.service.resyncer.finished))  # its answer from mgmtd
    assert spare_node.service.resyncer.finished[-1].chunks_copied == 0
    await cluster.sync_maps()
    assert (await cluster.write(chain, chunk_id(61, 0), 0, b"after restart"))["version"] == 2
    await cluster.assert_identical(chain)
    state = json.loads((Path(spare_node.config.data_dir) / "node.json").read_text())
    assert state["targets"] == [str(new_path)]
    # a second new target has no chain to join: a spare
    done = await shufflefs(
        "target",
        "add",
        "--node",
        str(spare_node.node_id),
        str(cluster.base / "another"),
        "--config",
        str(config),
    )
    assert done.returncode == 0 and "added as a spare" in done.stdout.decode()
    done = await shufflefs(  # a node that does not exist: one line, non-zero
        "target", "add", "--node", "99", str(cluster.base / "x"), "--config", str(config)
    )
    assert done.returncode == 1 and b"not a storage node" in done.stderr


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal() -> None:
    term = Terminal()
    bar = Progress(200, term)
    bar.show(50, "target 1")
    bar.show(200, "target 2")
    bar.close()
    out = term.getvalue()
    assert out.startswith("\rscrub [#######") and "50/200 chunks" in out
    assert "[" + "#" * 30 + "] 200/200" in out and out.endswith("\n")
    pipe = io.StringIO()
    quiet = Progress(200, pipe)
    quiet.show(50, "target 1")
    quiet.close()
    assert pipe.getvalue() == ""
