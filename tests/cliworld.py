"""The world `shufflefs` command tests run in: a dir of broken configs,
stopped clusters and files that are not directories, and how to run the real
command in it and see what it changed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shufflefs.rpc.config import write_toml

RUN_TIMEOUT = 20.0


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_cli(argv: list[str], cwd: Path, timeout: float = RUN_TIMEOUT) -> Result:
    env = {k: v for k, v in os.environ.items() if k != "SHUFFLEFS_CONFIG"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "shufflefs.cluster.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, float]:
    """Every path under *root* with its mtime (directories included)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if any(rel.startswith(s) for s in skip):
                continue
            try:
                out[rel] = p.lstat().st_mtime
            except FileNotFoundError:
                continue
    return out


def diff(before: dict[str, float], after: dict[str, float]) -> list[str]:
    changed = [p for p in after if p in before and after[p] != before[p]]
    return sorted(
        [f"+{p}" for p in after.keys() - before.keys()]
        + [f"-{p}" for p in before.keys() - after.keys()]
        + [f"~{p}" for p in changed]
    )


def processes_naming(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in line:
                pids.append(int(entry.name))
    return pids


def shufflefs_ok(*argv: str, cwd: Path) -> Result:
    result = run_cli(list(argv), cwd, timeout=120)
    assert result.returncode == 0, f"{argv}: {result.stdout}\n{result.stderr}"
    return result


def edit_toml(src: Path, dst: Path, **changes: object) -> None:
    data = tomllib.loads(src.read_text())
    data.update(changes)
    write_toml(dst, data)


@dataclass
class World:
    root: Path
    ro: Path | None  # a read-only bind mount, if this machine lets us make one

    def fill(self, argv: tuple[str, ...], extra: dict[str, str] | None = None) -> list[str]:
        subst = {
            "{W}": str(self.root),
            "{D}": str(self.root / "D"),
            "{CFG}": str(self.root / "D" / "client.toml"),
            "{D_BAD_MGMTD}": str(self.root / "D_bad_mgmtd"),
            "{D_BAD_STORAGE}": str(self.root / "D_bad_storage"),
            "{RO}": str(self.ro) if self.ro else "/proc/shufflefs-no-ro-mount",
            **(extra or {}),
        }
        out = []
        for a in argv:
            for k, v in subst.items():
                a = a.replace(k, v)
            out.append(a)
        return out


def make_world(root: Path) -> World:
    root.mkdir(parents=True, exist_ok=True)
    (root / "afile").write_text("not a directory\n")
    (root / "emptydir").mkdir()
    (root / "tokens.bin").write_bytes(bytes(range(256)) * 64)
    for name in ("D", "D_bad_mgmtd", "D_bad_storage"):
        shufflefs_ok("format", "--data-dir", str(root / name), "--storage-nodes", "1", cwd=root)
    d = root / "D"
    mgmtd_toml = root / "D_bad_mgmtd" / "mgmtd" / "mgmtd.toml"
    edit_toml(mgmtd_toml, mgmtd_toml, chunk_size=3)
    storage_toml = root / "D_bad_storage" / "storage1" / "storage.toml"
    edit_toml(storage_toml, storage_toml, targets=[])
    cfg = root / "cfg"
    cfg.mkdir()
    secret = str(d / "secret")
    (cfg / "bad-syntax.toml").write_text('mgmtd = "127.0.0.1:1\n')
    (cfg / "binary.toml").write_bytes(b"\xff\xfe\x00\x01mgmtd")
    mgmtd = f"127.0.0.1:{free_port()}"
    write_toml(cfg / "unknown-key.toml", {"mgmtd": mgmtd, "secret_file": secret, "colour": "b"})
    write_toml(cfg / "wrong-type.toml", {"mgmtd": 5, "secret_file": secret})
    write_toml(cfg / "missing-key.toml", {"secret_file": secret})
    (cfg / "insecure").write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(cfg / "insecure", 0o644)
    write_toml(cfg / "insecure-secret.toml", {"mgmtd": mgmtd, "secret_file": "insecure"})
    (cfg / "secretdir").mkdir()
    write_toml(cfg / "secret-is-dir.toml", {"mgmtd": mgmtd, "secret_file": "secretdir"})
    (cfg / "short").write_text("abc\n")
    os.chmod(cfg / "short", 0o600)
    write_toml(cfg / "short-secret.toml", {"mgmtd": mgmtd, "secret_file": "short"})
    write_toml(cfg / "no-secret.toml", {"mgmtd": mgmtd, "secret_file": "nope"})
    services = {
        "mgmtd": (d / "mgmtd" / "mgmtd.toml", {"chunk_size": 3}),
        "meta": (d / "meta" / "meta.toml", {"sync": "yes"}),
        "storage": (d / "storage1" / "storage.toml", {"targets": []}),
    }
    for kind, (src, bad) in services.items():
        edit_toml(src, cfg / f"{kind}-unknown-key.toml", heartbeat_timout=3)
        edit_toml(src, cfg / f"{kind}-bad-value.toml", **bad)
        edit_toml(src, cfg / f"{kind}-proc-dir.toml", data_dir="/proc/shufflefs-nope/db")
        edit_toml(src, cfg / f"{kind}-file-as-dir.toml", data_dir=str(root / "afile" / "db"))
    return World(root, read_only_mount(root / "ro"))


def read_only_mount(path: Path) -> Path | None:
    """A read-only bind mount of an empty directory (root only)."""
    path.mkdir()
    if os.geteuid() != 0:
        return None
    for cmd in (
        ["mount", "--bind", str(path), str(path)],
        ["mount", "-o", "remount,bind,ro", str(path)],
    ):
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            subprocess.run(["umount", str(path)], capture_output=True)
            return None
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client_config(dirpath: Path, address: str, secret: bytes) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "secret").write_bytes(secret + b"\n")
    os.chmod(dirpath / "secret", 0o600)
    write_toml(dirpath / "client.toml", {"mgmtd": address, "secret_file": "secret"})
    return dirpath / "client.toml"


def assert_unreachable(r: Result, code: int, address: str) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and len(lines) == 1, r.stderr
    assert f"mgmtd at {address}" in lines[0] and "Traceback" not in r.stderr, r.stderr
