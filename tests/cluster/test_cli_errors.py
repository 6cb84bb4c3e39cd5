"""Every command answers a mistake at once, in one line, and changes nothing.

A table of bad values for every option of every subcommand, each run as a
real `shufflefs` process: with no cluster running (all at once, in
parallel: they are cheap) and, for the commands that talk to a cluster,
against one real cluster (`e2e`). Each must exit non-zero within seconds,
print no traceback and at most a few lines, and leave the data dirs and the
running cluster as they were. Then the failures that have their own exit
code: refused, timeout, wrong secret, other protocol version; and `up`
supervising what it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from shufflefs.cluster import cli_errors
from shufflefs.cluster.cli import build_parser
from shufflefs.rpc import framing
from shufflefs.rpc.config import write_toml
from shufflefs.rpc.server import RpcServer

RUN_TIMEOUT = 20.0
MAX_STDERR_LINES = 3


@dataclass(frozen=True)
class Case:
    path: tuple[str, ...]  # the subcommand: ("target", "add")
    option: str  # the option (or positional's dest) given a bad value
    argv: tuple[str, ...]  # with {W} (the world dir), {D} (a stopped cluster), {CFG}, {UP}...
    code: int  # the exit code it must get

    @property
    def id(self) -> str:
        return f"{'-'.join(self.path)}:{self.option}:{' '.join(self.argv)[:60]}"


USAGE = cli_errors.EXIT_USAGE
FAILED = cli_errors.EXIT_FAILED
UNREACHABLE = cli_errors.EXIT_UNREACHABLE


def case(path: str, option: str, *argv: str, code: int = USAGE) -> Case:
    words = tuple(path.split())
    return Case(words, option, (*words, *argv), code)


SAMPLE = ("--seed", "1", "--epoch", "0", "--step", "0", "--batch-size", "2")
SAMPLE_FILE = "{W}/tokens.bin"


def sample(option: str, *argv: str, code: int = USAGE) -> Case:
    return case("sample explain", option, *argv, code=code)


def fresh(name: str) -> tuple[str, ...]:
    """A data dir that must still not exist afterwards."""
    return ("--data-dir", "{W}/fresh-" + name)


def bad_client_configs(path: str, *extra: str, every: bool = False) -> list[Case]:
    """Ways a client config can be wrong, for a command that reads one: all
    of them for `status` (*every*); the others load it the same way
    (`preflight.load_client`), so two will do."""
    if not every:
        return [
            case(path, "--config", *extra, "--config", "{W}/missing.toml"),
            case(path, "--config", *extra, "--config", "{W}/cfg/insecure-secret.toml"),
        ]
    return [
        case(path, "--config", *extra, "--config", "{W}/missing.toml"),
        case(path, "--config", *extra, "--config", "{W}/emptydir"),
        case(path, "--config", *extra, "--config", "{W}/cfg/bad-syntax.toml"),
        case(path, "--config", *extra, "--config", "{W}/cfg/binary.toml"),
        case(path, "--config", *extra, "--config", "{W}/cfg/unknown-key.toml"),
        case(path, "--config", *extra, "--config", "{W}/cfg/wrong-type.toml"),
        case(path, "--config", *extra, "--config", "{W}/cfg/missing-key.toml"),
        case(path, "--config", *extra, "--config", "{W}/cfg/insecure-secret.toml"),
        case(path, "--config", *extra, "--config", "{W}/cfg/secret-is-dir.toml"),
        case(path, "--config", *extra, "--config", "{W}/cfg/short-secret.toml"),
        case(path, "--config", *extra, "--config", "{W}/cfg/no-secret.toml"),
        case(path, "--config", *extra, "--config", "/proc/self/status"),
    ]


def service_cases(kind: str) -> list[Case]:
    """A service's config: the file-level mistakes once (every service
    reads its file the same way), each service's own settings for each."""
    unreadable = [
        case(kind, "--config", "--config", "{W}/emptydir"),
        case(kind, "--config", "--config", "{W}/cfg/bad-syntax.toml"),
        case(kind, "--config", "--config", "{W}/cfg/binary.toml"),
    ]
    return [
        case(kind, "--config"),  # required
        case(kind, "--config", "--config", "{W}/missing.toml"),
        *(unreadable if kind == "mgmtd" else []),
        case(kind, "--config", "--config", f"{{W}}/cfg/{kind}-unknown-key.toml"),
        case(kind, "--config", "--config", f"{{W}}/cfg/{kind}-bad-value.toml"),
        case(kind, "--config", "--config", f"{{W}}/cfg/{kind}-proc-dir.toml"),
        case(kind, "--config", "--config", f"{{W}}/cfg/{kind}-file-as-dir.toml"),
    ]


def shape_cases(path: str) -> list[Case]:
    """format and up share these options (and their argparse types: those
    are tried on `up` only)."""
    parsing = [
        case(path, "--storage-nodes", *fresh("nneg"), "--storage-nodes", "-1"),
        case(path, "--storage-nodes", *fresh("nx"), "--storage-nodes", "x"),
        case(path, "--replicas", *fresh("rx"), "--replicas", "two"),
        case(path, "--chunk-size", *fresh("cx"), "--chunk-size", "lots"),
        case(path, "--chunk-size", *fresh("cneg"), "--chunk-size=-4K"),
    ]
    return [
        *(parsing if path == "up" else []),
        case(path, "--data-dir", "--data-dir", "{W}/afile"),
        case(path, "--data-dir", "--data-dir", "{W}/afile/sub"),
        case(path, "--data-dir", "--data-dir", "/proc/shufflefs-nope"),
        case(path, "--data-dir", "--data-dir", "/sys/shufflefs-nope"),
        case(path, "--data-dir", "--data-dir", "{RO}/data"),
        case(path, "--storage-nodes", *fresh("n0"), "--storage-nodes", "0"),
        case(path, "--storage-nodes", *fresh("nbig"), "--storage-nodes", "100000"),
        case(path, "--replicas", *fresh("r0"), "--replicas", "0"),
        case(path, "--replicas", *fresh("r5"), "--storage-nodes", "3", "--replicas", "5"),
        case(path, "--replicas", *fresh("r17"), "--storage-nodes", "20", "--replicas", "17"),
        case(path, "--chunk-size", *fresh("c3"), "--chunk-size", "3"),
        case(path, "--chunk-size", *fresh("cbig"), "--chunk-size", "1G"),
        case(path, "--host", *fresh("h1"), "--host", "192.0.2.1"),
        case(path, "--host", *fresh("h2"), "--host", "not a host!"),
    ]


def bench_cases(path: str) -> list[Case]:
    """Options `bench` and `bench loader` share."""
    return [
        *bad_client_configs(path),
        case(path, "--mountpoint", "--embedded", "--mountpoint", "{W}/afile"),
        case(path, "--mountpoint", "--embedded", "--mountpoint", "{W}/nope"),
        case(path, "--embedded", "--embedded=yes"),
        case(path, "--local-dir", "--embedded", "--local-dir", "{W}/afile"),
        case(path, "--local-dir", "--embedded", "--local-dir", "/proc/shufflefs-nope"),
        case(path, "--local-dir", "--embedded", "--local-dir", "{RO}"),
        case(path, "--json", "--json=1"),
        case(path, "--seconds", "--seconds", "0"),
        case(path, "--seconds", "--seconds", "soon"),
    ]


CLUSTER_DOWN: list[Case] = [
    *service_cases("mgmtd"),
    *service_cases("meta"),
    *service_cases("storage"),
    *shape_cases("format"),
    case("format", "--data-dir", "--data-dir", "{D}"),  # already a cluster
    *shape_cases("up"),
    case("up", "--mountpoint", *fresh("m1"), "--mountpoint", "{W}/afile"),
    case("up", "--mountpoint", *fresh("m2"), "--mountpoint", "/proc"),
    case("up", "--mountpoint", *fresh("m3"), "--mountpoint", "/proc/shufflefs-nope"),
    case("up", "--mountpoint", *fresh("m4"), "--mountpoint", "{RO}/mnt"),
    case("up", "--no-mount", *fresh("nm"), "--no-mount=yes"),
    case("up", "--replicas", "--data-dir", "{D}", "--no-mount", "--replicas", "3"),
    case("up", "--chunk-size", "--data-dir", "{D}", "--no-mount", "--chunk-size", "4M"),
    case("up", "--host", "--data-dir", "{D}", "--no-mount", "--host", "::1"),
    case("up", "--data-dir", "--data-dir", "{D_BAD_MGMTD}", "--no-mount"),
    case("up", "--data-dir", "--data-dir", "{D_BAD_STORAGE}", "--no-mount"),
    case("down", "--data-dir", "--data-dir", "{W}/afile"),
    case("down", "--data-dir", "--data-dir", "{W}/emptydir"),
    case("down", "--data-dir", "--data-dir", "/proc/shufflefs-nope"),
    *bad_client_configs("status", every=True),
    case("status", "--config", "--config", "{CFG}", code=UNREACHABLE),  # mgmtd is down
    case("status", "--json", "--json=yes", "--config", "{CFG}"),
    *bad_client_configs("scrub"),
    case("scrub", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("scrub", "--json", "--json=1"),
    *bad_client_configs("target add", "--node", "1", "/tmp/t"),
    case("target add", "--config", "--node", "1", "--config", "{CFG}", "/t", code=UNREACHABLE),
    case("target add", "--node", "/tmp/t"),
    case("target add", "--node", "--node", "x", "/tmp/t"),
    case("target add", "--node", "--node", "0", "/tmp/t"),
    case("target add", "--chain", "--node", "1", "--chain", "-2", "/tmp/t"),
    case("target add", "--chain", "--node", "1", "--chain", "c", "/tmp/t"),
    case("target add", "path", "--node", "1"),
    case("target add", "--json", "--node", "1", "--json=1", "/tmp/t"),
    case("target", "target_command"),
    case("target", "target_command", "remove"),
    *bad_client_configs("mount", "{W}/emptydir"),
    case("mount", "mountpoint", "--config", "{CFG}"),
    case("mount", "mountpoint", "--config", "{CFG}", "{W}/afile"),
    case("mount", "mountpoint", "--config", "{CFG}", "{W}/nope"),
    case("mount", "--foreground", "--config", "{CFG}", "--foreground=1", "{W}/emptydir"),
    case("mount", "--log-file", "--config", "{CFG}", "--log-file", "/proc/x/m.log", "{W}/emptydir"),
    case(
        "mount", "--log-file", "--config", "{CFG}", "--log-file", "{W}/afile/m.log", "{W}/emptydir"
    ),
    case("mount", "-o", "--config", "{CFG}", "-o", "bogus=1", "{W}/emptydir"),
    case("mount", "-o", "--config", "{CFG}", "-o", "attr_timeout=soon", "{W}/emptydir"),
    case("mount", "--config", "--config", "{CFG}", "{W}/emptydir", code=UNREACHABLE),
    case("umount", "mountpoint"),
    case("umount", "mountpoint", "{W}/afile", code=FAILED),
    case("umount", "mountpoint", "/", code=FAILED),
    sample("--seed", *SAMPLE, "--seed", "x", SAMPLE_FILE),
    sample("--epoch", *SAMPLE, "--epoch", "-1", SAMPLE_FILE),
    sample("--step", *SAMPLE, "--step", "-3", SAMPLE_FILE),
    sample("--batch-size", *SAMPLE, "--batch-size", "0", SAMPLE_FILE),
    sample("--seq-len", *SAMPLE, "--seq-len", "0", SAMPLE_FILE),
    sample("--dtype", *SAMPLE, "--dtype", "float99", SAMPLE_FILE),
    sample("--stride", *SAMPLE, "--stride", "0", SAMPLE_FILE),
    sample("--rank", *SAMPLE, "--rank", "-1", SAMPLE_FILE),
    sample("--world-size", *SAMPLE, "--world-size", "0", SAMPLE_FILE),
    sample("--drop-last", *SAMPLE, "--drop-last=1", SAMPLE_FILE),
    sample("--files", *SAMPLE, "--files=1", SAMPLE_FILE),
    sample("--json", *SAMPLE, "--json=1", SAMPLE_FILE),
    sample("--config", *SAMPLE, "--config", "{W}/missing.toml", "shufflefs://x/y.bin"),
    sample("--config", *SAMPLE, "--config", "{W}/cfg/insecure-secret.toml", "shufflefs://x/y"),
    sample("--config", *SAMPLE, "--config", "{CFG}", "shufflefs:///t.bin", code=UNREACHABLE),
    sample("paths", *SAMPLE, "{W}/missing.bin", code=FAILED),
    sample("paths", *SAMPLE),
    case("sample", "sample_command"),
    *bench_cases("bench"),
    case("bench", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("bench loader", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("bench", "--quick", "--quick=1"),
    case("bench", "--readers", "--readers", "0"),
    case("bench", "--size-mb", "--size-mb", "-5"),
    case("bench", "--workloads", "--workloads", "rand4k,bogus"),
    case("bench", "--paths", "--paths", "local,ftp"),
    case("bench", "--batch", "--batch", "0"),
    case("bench", "--no-local-reads", "--no-local-reads=1"),
    case("bench", "bench_mode", "nonsense"),
    *bench_cases("bench loader"),
    case("bench loader", "--remote-dir", "--embedded", "--remote-dir", "relative/dir"),
    case("bench loader", "--dataset-size", "--dataset-size", "huge"),
    case("bench loader", "--files", "--files", "0"),
    case("bench loader", "--seq-len", "--seq-len", "-1"),
    case("bench loader", "--dtype", "--dtype", "float128"),
    case("bench loader", "--batch-sizes", "--batch-sizes", "8,zero"),
    case("bench loader", "--readahead", "--readahead", "0"),
    case("bench loader", "--configs", "--configs", "local,warp"),
    case("bench loader", "--no-cold", "--no-cold=1"),
    case("bench loader", "--no-warm", "--no-warm=1"),
    case("bench loader", "--seed", "--seed", "x"),
    case("bench loader", "--plot", "--embedded", "--plot", "/proc/shufflefs/plot.png"),
    case("", "COMMAND"),
    case("", "COMMAND", "frobnicate"),
    case("", "--version", "--version=2"),
]


# ---- the world the cases run in ------------------------------------------------------


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
    import tomllib

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


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = make_world(tmp_path_factory.mktemp("world"))
    try:
        yield w
    finally:
        if w.ro is not None:
            subprocess.run(["umount", str(w.ro)], capture_output=True)


def check_result(c: Case, argv: list[str], r: Result, expect_code: int | None = None) -> None:
    shown = f"shufflefs {' '.join(argv)}\nexit {r.returncode}\n{r.stderr}{r.stdout[-2000:]}"
    assert r.returncode != 0, shown
    assert r.returncode == (expect_code if expect_code is not None else c.code), shown
    assert "Traceback" not in r.stderr + r.stdout, shown
    assert "internal error" not in r.stderr, shown
    assert 1 <= len([ln for ln in r.stderr.splitlines() if ln.strip()]) <= MAX_STDERR_LINES, shown
    assert r.seconds < RUN_TIMEOUT / 2, shown


@pytest.fixture(scope="module")
def down_results(world: World) -> Iterator[tuple[dict[Case, tuple[list[str], Result]], list[str]]]:
    """Every cluster-down case, four at a time, and what they changed."""
    before = snapshot(world.root)
    argvs = {c: world.fill(c.argv) for c in CLUSTER_DOWN}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {c: pool.submit(run_cli, argv, world.root) for c, argv in argvs.items()}
        results = {c: (argvs[c], f.result()) for c, f in futures.items()}
    yield results, diff(before, snapshot(world.root))


@pytest.mark.parametrize("c", CLUSTER_DOWN, ids=[c.id for c in CLUSTER_DOWN])
def test_bad_value_with_cluster_down(
    c: Case, world: World, down_results: tuple[dict[Case, tuple[list[str], Result]], list[str]]
) -> None:
    results, changed = down_results
    argv, r = results[c]
    if "{RO}" in " ".join(c.argv) and world.ro is None:
        pytest.skip("no read-only bind mount here (needs root)")
    check_result(c, argv, r)
    assert changed == [], f"the cluster-down cases changed {changed}"


def test_up_refused_by_a_service_config_starts_nothing(world: World) -> None:
    """The one mgmtd refuses and the one storage refuses: refused by `up`
    itself, with the service's own message, before any process starts."""
    for name, needle in (("D_bad_mgmtd", "chunk_size"), ("D_bad_storage", "targets")):
        data = world.root / name
        r = run_cli(["up", "--data-dir", str(data), "--no-mount"], world.root)
        assert r.returncode == USAGE and needle in r.stderr, r.stderr
        assert str(data) in r.stderr  # names the file
        assert processes_naming(str(data)) == []


# ---- coverage: the table names every subcommand and every option ------------------------


def subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, (*path, name))


def options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            yield action.dest if action.dest != "command" else "COMMAND", action
        elif action.option_strings:
            yield max(action.option_strings, key=len), action
        else:
            yield action.dest, action


def test_table_covers_every_option_of_every_subcommand() -> None:
    covered = {(c.path, c.option) for c in CLUSTER_DOWN}
    missing = [
        (path, name)
        for path, parser in subcommands(build_parser())
        for name, _ in options(parser)
        if (path, name) not in covered
    ]
    assert missing == []


def test_every_subcommand_listed_by_help_is_in_the_table() -> None:
    listed = run_cli(["--help"], Path.cwd()).stdout
    names = {path[0] for path, _ in subcommands(build_parser()) if len(path) == 1}
    for name in names:
        assert f"    {name} " in listed or f"    {name}\n" in listed
    assert names <= {c.path[0] for c in CLUSTER_DOWN if c.path}


def test_every_option_has_help_with_its_default() -> None:
    for path, parser in subcommands(build_parser()):
        formatter = parser._get_formatter()
        for name, action in options(parser):
            if isinstance(action, (argparse._SubParsersAction, argparse._VersionAction)):
                continue
            text = formatter._get_help_string(action) or ""
            assert action.help, f"shufflefs {' '.join(path)} {name} has no help"
            if action.option_strings and not action.required:
                assert "default" in text.lower(), f"shufflefs {' '.join(path)} {name}: {text}"


def test_version_and_exit_codes_in_help() -> None:
    r = run_cli(["--version"], Path.cwd())
    assert r.returncode == 0 and r.stdout.startswith("shufflefs ")
    text = run_cli(["--help"], Path.cwd()).stdout
    for code, _ in cli_errors.EXIT_CODES:
        assert f"  {code:>3}  " in text
    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    for code, meaning in cli_errors.EXIT_CODES:
        assert f"| {code} |" in doc, f"docs/operations.md lacks exit code {code} ({meaning})"


# ---- unreachable: one line naming the service and address, one exit code per kind --------


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


def test_mgmtd_down_is_unreachable_naming_it(world: World) -> None:
    import tomllib

    address = tomllib.loads((world.root / "D" / "client.toml").read_text())["mgmtd"]
    r = run_cli(["status", "--config", str(world.root / "D" / "client.toml")], world.root)
    assert_unreachable(r, cli_errors.EXIT_UNREACHABLE, address)


def test_a_service_that_never_answers_is_a_timeout(tmp_path: Path) -> None:
    with socket.socket() as listener:  # accepted by the kernel, never by anyone
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        config = client_config(tmp_path, address, b"0123456789abcdef" * 4)
        r = run_cli(["status", "--config", str(config)], tmp_path)
    assert_unreachable(r, cli_errors.EXIT_TIMEOUT, address)
    assert r.seconds < 10


async def serve_in_background(secret: bytes, nursery: trio.Nursery) -> str:
    server = RpcServer(secret, [], name="mgmtd")
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"127.0.0.1:{port}"


async def run_cli_async(argv: list[str], cwd: Path) -> Result:
    return await trio.to_thread.run_sync(run_cli, argv, cwd)


async def test_wrong_secret_is_an_auth_failure(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        address = await serve_in_background(b"the-cluster-secret-0123456789abcdef", nursery)
        config = client_config(tmp_path, address, b"another-secret-0123456789abcdef")
        r = await run_cli_async(["status", "--config", str(config)], tmp_path)
        nursery.cancel_scope.cancel()
    assert_unreachable(r, cli_errors.EXIT_AUTH, address)


async def test_other_protocol_version_is_a_version_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = b"the-cluster-secret-0123456789abcdef"
    monkeypatch.setattr(framing, "VERSION", framing.VERSION + 1)  # this process's server only
    async with trio.open_nursery() as nursery:
        address = await serve_in_background(secret, nursery)
        config = client_config(tmp_path, address, secret)
        r = await run_cli_async(["status", "--config", str(config)], tmp_path)
        nursery.cancel_scope.cancel()
    assert_unreachable(r, cli_errors.EXIT_VERSION, address)
    assert "protocol" in r.stderr


def test_internal_error_is_one_line_and_logged(tmp_path: Path) -> None:
    """A bug (here: a config class whose check itself crashes) is one line
    naming the log that holds its traceback."""
    from shufflefs.cluster.cli_errors import run_reporting

    def crash() -> int:
        raise KeyError("boom")

    data = tmp_path / "c"
    shufflefs_ok("format", "--data-dir", str(data), "--storage-nodes", "1", cwd=tmp_path)
    args = argparse.Namespace(data_dir=str(data))
    assert run_reporting("shufflefs test", args, crash) == cli_errors.EXIT_INTERNAL
    log = (data / "logs" / "cli.log").read_text()
    assert "Traceback" in log and "KeyError" in log


# ---- against a running cluster -----------------------------------------------------


@dataclass
class Running:
    data: Path
    mnt: Path
    world: World

    @property
    def config(self) -> Path:
        return self.data / "client.toml"


@pytest.fixture(scope="module")
def running(world: World) -> Iterator[Running]:
    data, mnt = world.root / "UP", world.root / "UPmnt"
    shufflefs_ok("up", "--data-dir", str(data), "--mountpoint", str(mnt), cwd=world.root)
    try:
        yield Running(data, mnt, world)
    finally:
        subprocess.run(
            [sys.executable, "-m", "shufflefs.cluster.cli", "down", "--data-dir", str(data)],
            capture_output=True,
            timeout=120,
        )


UPC = ("--config", "{UPCFG}")  # the running cluster's client config
CLUSTER_UP: list[Case] = [
    case("status", "--json", "--json=2", "--config", "{UPCFG}"),
    case("status", "--config", "--config", "{W}/cfg/insecure-secret.toml"),
    case("scrub", "--json", "--json=2", "--config", "{UPCFG}"),
    case("target add", "--node", "--node", "99", "--config", "{UPCFG}", "/tmp/t", code=FAILED),
    case("target add", "--node", "--node", "1", "--config", "{UPCFG}", "/tmp/t", code=FAILED),
    case("target add", "--chain", "--node", "{SNODE}", "--chain", "999", *UPC, "/t", code=FAILED),
    case("target add", "--node", "--node", "-3", "--config", "{UPCFG}", "/tmp/t"),
    case("target add", "path", "--node", "{SNODE}", *UPC, "/proc/sfs-t", code=FAILED),
    case("target add", "path", "--node", "{SNODE}", *UPC, "{W}/afile", code=FAILED),
    case("mount", "mountpoint", "--config", "{UPCFG}", "{UPMNT}", code=FAILED),
    case("mount", "-o", "--config", "{UPCFG}", "-o", "bogus", "{W}/emptydir"),
    case("mount", "mountpoint", "--config", "{UPCFG}", "{W}/afile"),
    case("umount", "mountpoint", "{W}/emptydir", code=FAILED),
    sample("--config", *SAMPLE, "--config", "{UPCFG}", "shufflefs:///no/such.bin", code=FAILED),
    case("bench", "--readers", "--config", "{UPCFG}", "--readers", "0"),
    case("bench", "--paths", "--config", "{UPCFG}", "--paths", "ftp"),
    case("bench", "--mountpoint", "--config", "{UPCFG}", "--mountpoint", "{W}/afile"),
    case("bench loader", "--files", "--config", "{UPCFG}", "--files", "0"),
    case("up", "--storage-nodes", "--data-dir", "{UP}", "--storage-nodes", "2"),
    case("up", "--replicas", "--data-dir", "{UP}", "--replicas", "1"),
    case("up", "--chunk-size", "--data-dir", "{UP}", "--chunk-size", "3"),
    case("up", "--chunk-size", "--data-dir", "{UP}", "--chunk-size", "4M"),
    case("up", "--mountpoint", "--data-dir", "{UP}", "--mountpoint", "/proc"),
    case("up", "--mountpoint", "--data-dir", "{UP}", "--mountpoint", "{W}/afile"),
    case("up", "--host", "--data-dir", "{UP}", "--host", "127.0.0.2"),
    case("format", "--data-dir", "--data-dir", "{UP}"),
    case("down", "--data-dir", "--data-dir", "{UP}/mgmtd"),
]

# What a running cluster changes by itself: its logs, LMDB's reader lock
# files, and the namespace database, where the mount renews its session every
# 20 s (the namespace itself is compared through the mount instead).
VOLATILE = ("logs/", "meta/db/namespace/", "mgmtd/db/lock.mdb")


@dataclass
class UpRun:
    results: dict[Case, tuple[list[str], Result]]
    changed: list[str]  # in the cluster's data dir and the world around it
    status: Result  # `shufflefs status --json` after them all


@pytest.fixture(scope="module")
def up_results(running: Running) -> UpRun:
    """Every cluster-up case, four at a time, then what they changed and
    whether the cluster still answers."""
    status = run_cli(["status", "--json", "--config", str(running.config)], running.world.root)
    storage_node = next(
        n["id"] for n in json.loads(status.stdout)["nodes"] if n["kind"] == "storage"
    )
    extra = {
        "{UPCFG}": str(running.config),
        "{UPMNT}": str(running.mnt),
        "{UP}": str(running.data),
        "{SNODE}": str(storage_node),
    }
    data_before = snapshot(running.data, skip=VOLATILE)
    world_before = snapshot(running.world.root, skip=("UP",))
    namespace_before = snapshot(running.mnt)
    argvs = {c: running.world.fill(c.argv, extra) for c in CLUSTER_UP}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {c: pool.submit(run_cli, argv, running.world.root) for c, argv in argvs.items()}
        results = {c: (argvs[c], f.result()) for c, f in futures.items()}
    changed = diff(data_before, snapshot(running.data, skip=VOLATILE))
    changed += diff(world_before, snapshot(running.world.root, skip=("UP",)))
    changed += [f"namespace {c}" for c in diff(namespace_before, snapshot(running.mnt))]
    status = run_cli(["status", "--json", "--config", str(running.config)], running.world.root)
    return UpRun(results, changed, status)


@pytest.mark.e2e
@pytest.mark.parametrize("c", CLUSTER_UP, ids=[c.id for c in CLUSTER_UP])
def test_bad_value_with_cluster_up(c: Case, up_results: UpRun) -> None:
    argv, r = up_results.results[c]
    check_result(c, argv, r)
    assert up_results.changed == [], f"the cluster-up cases changed {up_results.changed}"
    assert up_results.status.returncode == 0, up_results.status.stderr
    assert up_results.status.stdout.count('"online"') == 5  # mgmtd, meta, 3 storage nodes


@pytest.mark.e2e
def test_wrong_secret_against_the_cluster(running: Running, tmp_path: Path) -> None:
    import tomllib

    address = tomllib.loads(running.config.read_text())["mgmtd"]
    config = client_config(tmp_path, address, b"not-the-secret-0123456789abcdef")
    r = run_cli(["status", "--config", str(config)], tmp_path)
    assert_unreachable(r, cli_errors.EXIT_AUTH, address)


@pytest.mark.e2e
def test_up_with_a_service_that_fails_stops_everything(tmp_path: Path) -> None:
    """meta cannot bind its port: `up` notices at once, names meta and its
    error, stops what it started, and leaves no process behind."""
    import tomllib

    data = tmp_path / "c"
    shufflefs_ok("format", "--data-dir", str(data), "--storage-nodes", "1", cwd=tmp_path)
    meta_port = tomllib.loads((data / "cluster.toml").read_text())["meta_port"]
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", meta_port))
        squatter.listen(1)
        r = run_cli(["up", "--data-dir", str(data), "--no-mount"], tmp_path, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == cli_errors.EXIT_START_FAILED and len(lines) == 1, r.stderr
    assert lines[0].startswith("shufflefs up: meta ") and "in use" in lines[0], r.stderr
    assert str(data / "logs" / "meta.out") in lines[0]
    assert processes_naming(str(data)) == []
    assert "stopped mgmtd" in r.stdout


@pytest.mark.e2e
def test_up_adds_storage_nodes_to_an_existing_cluster(tmp_path: Path) -> None:
    data = tmp_path / "c"
    shufflefs_ok("up", "--data-dir", str(data), "--no-mount", "--storage-nodes", "1", cwd=tmp_path)
    try:
        r = shufflefs_ok(
            "up", "--data-dir", str(data), "--no-mount", "--storage-nodes", "2", cwd=tmp_path
        )
        assert "added storage2" in r.stdout
        status = run_cli(["status", "--json", "--config", str(data / "client.toml")], tmp_path)
        assert status.stdout.count('"kind": "storage"') == 2
    finally:
        run_cli(["down", "--data-dir", str(data)], tmp_path, timeout=120)
    assert processes_naming(str(data)) == []


def test_interrupted_command_exits_130(tmp_path: Path) -> None:
    """Ctrl-C while waiting for a service is exit 130, not a traceback."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        config = client_config(tmp_path, address, b"0123456789abcdef" * 4)
        proc = subprocess.Popen(
            [sys.executable, "-m", "shufflefs.cluster.cli", "status", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == cli_errors.EXIT_INTERRUPTED and "Traceback" not in err, err


@pytest.mark.e2e
def test_up_gives_up_at_its_deadline_naming_what_it_waited_for(tmp_path: Path) -> None:
    """A storage daemon that never registers (its mgmtd address is wrong, so
    it retries forever): `up` gives up at the deadline, says it was waiting
    for storage1 to register, and stops everything it started."""
    import io

    from shufflefs.cluster.launcher import up

    data = tmp_path / "c"
    shufflefs_ok("format", "--data-dir", str(data), "--storage-nodes", "1", cwd=tmp_path)
    storage_toml = data / "storage1" / "storage.toml"
    edit_toml(storage_toml, storage_toml, mgmtd=f"127.0.0.1:{free_port()}")
    out = io.StringIO()
    started = time.monotonic()
    with pytest.raises(cli_errors.StartFailed) as caught:
        up(data, None, out=out, timeout=3.0)
    assert time.monotonic() - started < 20
    assert "timed out after 3s waiting for storage1" in caught.value.message
    assert "to register with mgmtd" in caught.value.message
    assert processes_naming(str(data)) == []
    assert "stopped storage1" in out.getvalue() and "stopped mgmtd" in out.getvalue()
