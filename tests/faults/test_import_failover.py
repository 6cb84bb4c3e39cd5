"""`shufflefs import` while a storage daemon is killed: the import rides
through (the client's usual failover) and every file lands whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from clusters import ProcessCluster, files_landed, wait_until

FILES_PER_DIR = 250
DIRS = 12
SIZE = 24 << 10


def test_kill9_storage_during_import(fault_cluster: ProcessCluster, tmp_path: Path) -> None:
    c = fault_cluster
    src = tmp_path / "dataset"
    for d in range(DIRS):
        (src / f"c{d:02d}").mkdir(parents=True)
        for i in range(FILES_PER_DIR):
            (src / f"c{d:02d}" / f"s{i:04d}.bin").write_bytes(os.urandom(SIZE))
    total = DIRS * FILES_PER_DIR
    out = tmp_path / "out.json"
    with out.open("w") as stdout:
        importer = subprocess.Popen(
            [sys.executable, "-m", "shufflefs.cluster.cli", "import", str(src), "/imported",
             "--concurrency", "16", "--json", "--config", str(c.client_config)],
            stdout=stdout, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            dest = c.mountpoint / "imported"
            wait_until(
                "a tenth of the files imported",
                lambda: files_landed(dest) >= total // 10 or importer.poll() is not None,
                timeout=120,
            )
            assert importer.poll() is None, "the import ended before the kill"
            c.kill("storage3")
            at_kill = files_landed(dest)
            _, err = importer.communicate(timeout=300)
        finally:
            if importer.poll() is None:
                importer.kill()
                importer.wait()
    assert importer.returncode == 0, err
    result = json.loads(out.read_text())
    assert (result["files"], result["errors"], result["stopped"]) == (total, [], None)
    assert at_kill < total, "the kill came after the import"
    for d in range(DIRS):
        for i in range(FILES_PER_DIR):
            rel = Path(f"c{d:02d}") / f"s{i:04d}.bin"
            assert (dest / rel).read_bytes() == (src / rel).read_bytes(), rel
    print(f"IMPORT under kill -9 of storage3: {at_kill} of {total} files in at the kill, all whole")
    c.restart_missing()
    c.all_serving()
