"""`shufflefs import`: a local tree copied into a real cluster, read back
through the mount (client/ingest.py)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from cliworld import run_cli
from clusters import ProcessCluster, files_landed, wait_until

from shufflefs.client.ingest import PIECE

ODD_NAME = b"caf\xe9.bin"  # not UTF-8: names are bytes end to end


def import_json(ops: ProcessCluster, *argv: str, code: int = 0) -> dict[str, Any]:
    r = run_cli(["import", *argv, "--json", "--config", str(ops.client_config)], Path.cwd(), 120)
    assert r.returncode == code, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def make_tree(root: Path) -> dict[bytes, bytes]:
    """A small dataset with the cases that matter; its regular files' bytes
    by path relative to *root*."""
    files = {
        b"empty": b"",
        b"one": b"x",
        b"a/b/c/deep.jpg": os.urandom(110_000),
        b"big.bin": os.urandom(PIECE + 12_345),  # two pieces, five chunks
        b"private.txt": b"secret\n",
        ODD_NAME: os.urandom(5000),
    }
    for rel, data in files.items():
        path = os.path.join(os.fsencode(root), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.chmod(root / "private.txt", 0o640)
    os.chmod(root / "a" / "b", 0o750)
    os.symlink("a/b/c/deep.jpg", root / "link")
    os.symlink("nowhere", root / "dangling")
    os.mkfifo(root / "pipe")
    return files


def assert_same_tree(src: Path, dst: Path, files: dict[bytes, bytes]) -> None:
    for rel, data in files.items():
        there = os.path.join(os.fsencode(dst), rel)
        with open(there, "rb") as f:
            assert f.read() == data, rel
        here = os.path.join(os.fsencode(src), rel)
        assert stat.S_IMODE(os.stat(there).st_mode) == stat.S_IMODE(os.stat(here).st_mode), rel
    assert stat.S_IMODE((dst / "a" / "b").stat().st_mode) == 0o750
    assert os.readlink(dst / "link") == "a/b/c/deep.jpg"
    assert (dst / "link").read_bytes() == files[b"a/b/c/deep.jpg"]
    assert os.readlink(dst / "dangling") == "nowhere"


def test_import_copies_a_tree_byte_for_byte(ops_cluster: ProcessCluster, tmp_path: Path) -> None:
    src = tmp_path / "dataset"
    files = make_tree(src)
    # DEST given as a path on the mount, and made with its missing parent
    dest = ops_cluster.mountpoint / "imported" / "dataset"
    out = import_json(ops_cluster, str(src), str(dest))
    assert out["files"] == len(files)
    assert out["bytes"] == sum(len(d) for d in files.values())
    assert out["links"] == 2
    assert out["dirs"] == 2 + 3  # imported/, dataset/, a/, a/b/, a/b/c/
    assert out["errors"] == [] and out["stopped"] is None
    assert len(out["left_out"]) == 1 and out["left_out"][0].startswith(f"{src}/pipe:")
    assert_same_tree(src, dest, files)
    assert not (dest / "pipe").exists()
    # a single file: into an existing directory, or to a new name
    single = tmp_path / "single.bin"
    single.write_bytes(b"s" * 7000)
    assert import_json(ops_cluster, str(single), "/imported")["files"] == 1
    assert import_json(ops_cluster, str(single), "/imported/renamed.bin")["files"] == 1
    assert (ops_cluster.mountpoint / "imported" / "single.bin").read_bytes() == b"s" * 7000
    assert (ops_cluster.mountpoint / "imported" / "renamed.bin").read_bytes() == b"s" * 7000


def test_import_again_skips_what_is_there_and_finishes_what_is_not(
    ops_cluster: ProcessCluster, tmp_path: Path
) -> None:
    src = tmp_path / "dataset"
    files = make_tree(src)
    dest = ops_cluster.mountpoint / "resumed"
    assert import_json(ops_cluster, str(src), "/resumed")["files"] == len(files)
    # as if the first run had stopped: one file never made, one cut short
    (dest / "a" / "b" / "c" / "deep.jpg").unlink()
    with open(dest / "big.bin", "r+b") as f:
        f.truncate(1000)
    # and the source changed since: a file grew
    files[b"one"] = b"xy"
    (src / "one").write_bytes(b"xy")
    out = import_json(ops_cluster, str(src), "/resumed", "--skip-existing")
    assert out["files"] == 3 and out["bytes"] == 110_000 + PIECE + 12_345 + 2
    assert out["skipped"] == len(files) - 3 + 2  # the other files and both links
    assert out["dirs"] == 0
    assert_same_tree(src, dest, files)
    # without --skip-existing every file is written again
    assert import_json(ops_cluster, str(src), "/resumed")["files"] == len(files)
    assert_same_tree(src, dest, files)


def test_import_names_what_it_cannot_write_and_goes_on(
    ops_cluster: ProcessCluster, tmp_path: Path
) -> None:
    src = tmp_path / "dataset"
    (src / "a").mkdir(parents=True)
    (src / "a" / "inside").write_bytes(b"never lands")
    (src / "b").write_bytes(b"lands")
    dest = ops_cluster.mountpoint / "clash"
    dest.mkdir()
    (dest / "a").write_bytes(b"a file where the tree has a directory")
    r = run_cli(
        ["import", str(src), "/clash", "--config", str(ops_cluster.client_config)], Path.cwd(), 120
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert f"failed: {src}/a: not a directory in the cluster; left out" in r.stdout
    assert r.stdout.startswith("imported 1 files")
    assert (dest / "b").read_bytes() == b"lands"
    assert (dest / "a").read_bytes() == b"a file where the tree has a directory"


def test_import_from_python_and_the_cli_default(
    ops_cluster: ProcessCluster, tmp_path: Path
) -> None:
    from shufflefs.client import Client
    from shufflefs.client.ingest import DEFAULT_CONCURRENCY
    from shufflefs.cluster.cli import DEFAULT_IMPORT_CONCURRENCY

    assert DEFAULT_IMPORT_CONCURRENCY == DEFAULT_CONCURRENCY  # (cli.py keeps its own copy)
    src = tmp_path / "dataset"
    for d in range(3):
        (src / f"c{d}").mkdir(parents=True)
        for i in range(40):
            (src / f"c{d}" / f"s{i}.jpg").write_bytes(f"{d}/{i}".encode() * 500)
    with Client(ops_cluster.client_config) as client:
        done = client.import_tree(src, "/from-python", concurrency=8)
        assert (done.files, done.dirs, done.failed) == (120, 4, False)
        assert client.read_bytes("/from-python/c2/s39.jpg") == b"2/39" * 500
        again = client.import_tree(src, "/from-python", skip_existing=True)
        assert (again.files, again.skipped) == (0, 120)


def test_import_refuses_a_tree_into_itself(ops_cluster: ProcessCluster) -> None:
    tree = ops_cluster.mountpoint / "selfish"
    tree.mkdir()
    (tree / "f").write_bytes(b"once")
    for dest in (tree, tree / "copy", "/selfish/copy"):
        r = run_cli(
            ["import", str(tree), str(dest), "--config", str(ops_cluster.client_config)],
            Path.cwd(),
        )
        assert r.returncode == 2, r.stdout + r.stderr
        assert "would copy itself forever" in r.stderr and len(r.stderr.splitlines()) == 1
    assert os.listdir(tree) == ["f"]


def test_an_interrupted_import_is_finished_by_running_it_again(
    ops_cluster: ProcessCluster, tmp_path: Path
) -> None:
    src = tmp_path / "dataset"
    for d in range(8):
        (src / f"c{d}").mkdir(parents=True)
        for i in range(400):
            (src / f"c{d}" / f"s{i:03d}").write_bytes(os.urandom(8000))
    argv = [sys.executable, "-m", "shufflefs.cluster.cli", "import", str(src), "/interrupted"]
    argv += ["--config", str(ops_cluster.client_config)]
    importer = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # (as at a terminal)
    )
    dest = ops_cluster.mountpoint / "interrupted"
    wait_until(
        "100 files imported", lambda: files_landed(dest) >= 100 or importer.poll() is not None
    )
    importer.send_signal(signal.SIGINT)
    out, err = importer.communicate(timeout=60)
    assert importer.returncode == 130, out + err
    assert err.startswith("interrupted after ") and "--skip-existing" in err, err
    out2 = import_json(ops_cluster, str(src), "/interrupted", "--skip-existing")
    assert out2["files"] + out2["skipped"] == 3200 and out2["files"] > 0
    for d in range(8):
        for i in range(400):
            rel = Path(f"c{d}") / f"s{i:03d}"
            assert (dest / rel).read_bytes() == (src / rel).read_bytes(), rel
