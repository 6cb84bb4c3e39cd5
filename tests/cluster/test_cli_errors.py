"""Every command answers a mistake at once, in one line, and changes nothing.

A table of bad values for every option of every subcommand, each run as a
real `shufflefs` process: with no cluster running (all at once, in
parallel: they are cheap) and, for the commands that talk to a cluster,
against one real cluster (`e2e`). Each must exit non-zero within seconds,
print no traceback and at most a few lines, and leave the data dirs and the
running cluster as they were. (The failures with their own exit code, and
`up` supervising what it starts, are in test_cli.py; the world the cases run
in is tests/cliworld.py.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from cliworld import (
    RUN_TIMEOUT,
    Result,
    World,
    assert_unreachable,
    client_config,
    diff,
    make_world,
    processes_naming,
    run_cli,
    shufflefs_ok,
    snapshot,
)

from shufflefs.cluster import cli_errors
from shufflefs.cluster.cli import build_parser

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
        case(path, "--meta-servers", *fresh("mx"), "--meta-servers", "x"),
        case(path, "--meta-servers", *fresh("m0"), "--meta-servers", "0"),
        case(path, "--targets-per-node", *fresh("tx"), "--targets-per-node", "x"),
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
        case(path, "--targets-per-node", *fresh("t0"), "--targets-per-node", "0"),
        case(path, "--targets-per-node", *fresh("tbig"), "--targets-per-node", "1000"),
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
    case("up", "--ha", *fresh("ha1"), "--ha=yes"),
    case("up", "--ha", *fresh("ha2"), "--ha", "--meta-servers", "1"),
    case("up", "--ha", "--data-dir", "{D}", "--no-mount", "--ha"),  # formatted without it
    case("up", "--replicas", "--data-dir", "{D}", "--no-mount", "--replicas", "3"),
    case("up", "--chunk-size", "--data-dir", "{D}", "--no-mount", "--chunk-size", "4M"),
    case("up", "--host", "--data-dir", "{D}", "--no-mount", "--host", "::1"),
    case("up", "--targets-per-node", "--data-dir", "{D}", "--no-mount", "--targets-per-node", "2"),
    case("up", "--data-dir", "--data-dir", "{D_BAD_MGMTD}", "--no-mount"),
    case("up", "--data-dir", "--data-dir", "{D_BAD_STORAGE}", "--no-mount"),
    case("meta", "meta_command", "nope"),
    case("meta add", "--data-dir", "--data-dir", "{W}/afile"),
    case("meta add", "--data-dir", "--data-dir", "{D}"),  # one server: no group to grow
    case("meta add", "--timeout", "--timeout", "-1"),
    case("meta add", "--json", "--json=1"),
    case("down", "--data-dir", "--data-dir", "{W}/afile"),
    case("down", "--data-dir", "--data-dir", "{W}/emptydir"),
    case("down", "--data-dir", "--data-dir", "/proc/shufflefs-nope"),
    *bad_client_configs("status", every=True),
    case("status", "--config", "--config", "{CFG}", code=UNREACHABLE),  # mgmtd is down
    case("status", "--json", "--json=yes", "--config", "{CFG}"),
    *bad_client_configs("scrub"),
    case("scrub", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("scrub", "--json", "--json=1"),
    *bad_client_configs("fsck"),
    case("fsck", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("fsck", "--json", "--json=1"),
    case("fsck", "--repair", "--repair=1", "--config", "{CFG}"),
    *bad_client_configs("target add", "--node", "1", "/tmp/t"),
    case("target add", "--config", "--node", "1", "--config", "{CFG}", "/t", code=UNREACHABLE),
    case("target add", "--node", "/tmp/t"),
    case("target add", "--node", "--node", "x", "/tmp/t"),
    case("target add", "--node", "--node", "0", "/tmp/t"),
    case("target add", "--chain", "--node", "1", "--chain", "-2", "/tmp/t"),
    case("target add", "--chain", "--node", "1", "--chain", "c", "/tmp/t"),
    case("target add", "path", "--node", "1"),
    case("target add", "--json", "--node", "1", "--json=1", "/tmp/t"),
    *bad_client_configs("target remove", "1"),
    case("target remove", "--config", "--config", "{CFG}", "1", code=UNREACHABLE),
    case("target remove", "id", "x"),
    case("target remove", "--json", "--json=1", "1"),
    case("node", "node_command"),
    case("node", "node_command", "evacuate", "1"),
    *bad_client_configs("node drain", "1"),
    case("node drain", "--config", "--config", "{CFG}", "1", code=UNREACHABLE),
    case("node drain", "id", "0"),
    case("node drain", "--wait", "--wait=1", "1"),
    case("node drain", "--timeout", "--timeout", "-1", "1"),
    case("node drain", "--json", "--json=1", "1"),
    *bad_client_configs("node remove", "1"),
    case("node remove", "--config", "--config", "{CFG}", "1", code=UNREACHABLE),
    case("node remove", "id", "z"),
    case("node remove", "--json", "--json=1", "1"),
    case("target", "target_command"),
    case("target", "target_command", "remove"),
    *bad_client_configs("rebalance"),
    case("rebalance", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("rebalance", "--wait", "--wait=1"),
    case("rebalance", "--timeout", "--timeout", "0"),
    case("rebalance", "--json", "--json=1"),
    *bad_client_configs("jobs"),
    case("jobs", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("jobs", "--json", "--json=1"),
    case("jobs", "jobs_command", "stop", "drain-1"),
    *bad_client_configs("jobs cancel", "rebalance-1"),
    case("jobs cancel", "--config", "--config", "{CFG}", "rebalance-1", code=UNREACHABLE),
    case("jobs cancel", "id", "resync-3"),  # a resync is not cancellable
    case("jobs cancel", "id", "rebalance-0"),
    case("jobs cancel", "id", "replace-x"),
    case("jobs cancel", "id"),  # required
    case("jobs cancel", "--json", "--json=1", "drain-1"),
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
    case("mount", "-o", "--config", "{CFG}", "-o", "ro,negative_timeout=-1", "{W}/emptydir"),
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
    sample(
        "--mixture",
        "--epoch",
        "0",
        "--step",
        "0",
        "--batch-size",
        "2",
        "--mixture",
        "{W}/no.toml",
        code=FAILED,
    ),
    sample("--start", *SAMPLE, "--start", "-1", SAMPLE_FILE),
    case(
        "sample quarantine",
        "--mixture",
        "--mixture",
        "{W}/no.toml",
        "--add",
        "0:x:1:2",
        code=FAILED,
    ),
    case("sample quarantine", "--file", "--file", "/proc/nope/q.json", "--add", "0:x:1:2"),
    case("sample quarantine", "--add", "--file", "{W}/q.json", "--add", "garbage", code=FAILED),
    case(
        "sample quarantine", "--remove", "--file", "{W}/q.json", "--remove", "garbage", code=FAILED
    ),
    case(
        "sample quarantine", "--from", "--file", "{W}/q.json", "--from", "{W}/no.json", code=FAILED
    ),
    case("sample quarantine", "--rank", "--file", "{W}/q.json", "--rank", "-1", "--add", "0:x:1:2"),
    case("sample quarantine", "--config", "--file", "{W}/q.json", "--config", "{W}/missing.toml"),
    case("sample quarantine", "--json", "--file", "{W}/q.json", "--json=1"),
    case("sample quarantine", "--file"),
    case("sample startup", "--sizes", "--sizes", "abc"),
    case("sample startup", "--batch-size", "--batch-size", "0"),
    case("sample startup", "--dir", "--dir", "/proc/nope", code=FAILED),
    case("sample startup", "--json", "--json=1"),
    case("sample", "sample_command"),
    *bench_cases("bench"),
    case("bench", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("bench loader", "--config", "--config", "{CFG}", code=UNREACHABLE),
    *bad_client_configs("df"),
    case("df", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("df", "--json", "--json=1"),
    *bad_client_configs("info", "/x"),
    case("info", "--config", "--config", "{CFG}", "/x", code=UNREACHABLE),
    case("info", "--chunks", "--chunks", "0", "/x"),
    case("info", "--json", "--json=1", "/x"),
    case("info", "path"),
    *bad_client_configs("warmup", "/x"),
    case("warmup", "--config", "--config", "{CFG}", "/x", "/y", code=UNREACHABLE),
    case("warmup", "--concurrency", "--concurrency", "0", "/x"),
    case("warmup", "--json", "--json=1", "/x"),
    case("warmup", "paths"),
    *bad_client_configs("import", "{W}", "/x"),
    case("import", "--config", "--config", "{CFG}", "{W}", "/x", code=UNREACHABLE),
    case("import", "--concurrency", "--concurrency", "0", "{W}", "/x"),
    case("import", "--concurrency", "--concurrency", "257", "{W}", "/x"),
    case("import", "--skip-existing", "--skip-existing=1", "{W}", "/x"),
    case("import", "--json", "--json=1", "{W}", "/x"),
    case("import", "source", "{W}/nope", "/x"),
    case("import", "source"),
    case("import", "dest", "{W}"),
    *bad_client_configs("top"),
    case("top", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("top", "--interval", "--interval", "0"),
    case("top", "--count", "--count", "-1"),
    case("top", "--json", "--json=1"),
    case("bench", "--quick", "--quick=1"),
    case("bench", "--readers", "--readers", "0"),
    case("bench", "--size-mb", "--size-mb", "-5"),
    case("bench", "--workloads", "--workloads", "rand4k,bogus"),
    case("bench", "--paths", "--paths", "local,ftp"),
    case("bench", "--batch", "--batch", "0"),
    case("bench", "--no-local-reads", "--no-local-reads=1"),
    case("bench", "bench_mode", "nonsense"),
    case("bench", "--no-cold", "--no-cold=1"),
    case("bench", "--remote", "--remote=1"),
    case("bench", "--storage-hosts", "--remote", "--storage-hosts", "0"),
    case("bench", "--reader-hosts", "--remote", "--reader-hosts", "-1"),
    case("bench", "--replicas", "--remote", "--storage-hosts", "2", "--replicas", "3"),
    case("bench", "--link-mbps", "--remote", "--link-mbps", "fast"),
    case("bench", "--no-fio", "--no-fio=1"),
    case("bench", "--rounds", "--remote", "--rounds", "0"),
    case("bench", "--compare", "--remote", "--compare", "{W}/afile"),
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
    *bad_client_configs("bench files"),
    case("bench files", "--config", "--config", "{CFG}", code=UNREACHABLE),
    case("bench files", "--mount", "--mount", "{W}/nope"),
    case("bench files", "--ro-mount", "--embedded", "--ro-mount", "{W}/afile"),
    case("bench files", "--prefetch-mount", "--embedded", "--prefetch-mount", "{W}/nope"),
    case("bench files", "--embedded", "--embedded=yes"),
    case("bench files", "--replicas", "--embedded", "--replicas", "0"),
    case("bench files", "--local-dir", "--embedded", "--local-dir", "{W}/afile"),
    case("bench files", "--quick", "--quick=1"),
    case("bench files", "--files", "--files", "0"),
    case("bench files", "--size", "--size", "huge"),
    case("bench files", "--size", "--embedded", "--size", "8"),  # less than its header
    case("bench files", "--dirs", "--dirs", "-1"),
    case("bench files", "--procs", "--procs", "0"),
    case("bench files", "--reads", "--reads", "x"),
    case("bench files", "--ops", "--ops", "create,write"),
    case("bench files", "--no-cold", "--no-cold=1"),
    case("bench files", "--unbuffered", "--unbuffered=1"),
    case("bench files", "--no-loader", "--no-loader=1"),
    case("bench files", "--loader-workers", "--loader-workers", "0"),
    case("bench files", "--seed", "--seed", "x"),
    case("bench files", "--keep", "--keep=1"),
    case("bench files", "--json", "--json=1"),
    case("bench files", "--remote", "--remote", "--mount", "{W}/nope"),
    case("bench files", "--storage-hosts", "--remote", "--storage-hosts", "0"),
    case("", "COMMAND"),
    case("", "COMMAND", "frobnicate"),
    case("", "--version", "--version=2"),
]


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


@pytest.mark.e2e  # each case is a real `shufflefs` process
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


@pytest.mark.e2e
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


# ---- unreachable: one line naming the service and address ------------------------------


@pytest.mark.e2e
def test_mgmtd_down_is_unreachable_naming_it(world: World) -> None:
    import tomllib

    address = tomllib.loads((world.root / "D" / "client.toml").read_text())["mgmtd"]
    r = run_cli(["status", "--config", str(world.root / "D" / "client.toml")], world.root)
    assert_unreachable(r, cli_errors.EXIT_UNREACHABLE, address)


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
    case("fsck", "--repair", "--repair=yes", "--json", *UPC),
    case("target add", "--node", "--node", "99", "--config", "{UPCFG}", "/tmp/t", code=FAILED),
    case("target add", "--node", "--node", "1", "--config", "{UPCFG}", "/tmp/t", code=FAILED),
    case("target add", "--chain", "--node", "{SNODE}", "--chain", "999", *UPC, "/t", code=FAILED),
    case("target add", "--node", "--node", "-3", "--config", "{UPCFG}", "/tmp/t"),
    case("target add", "path", "--node", "{SNODE}", *UPC, "/proc/sfs-t", code=FAILED),
    case("target add", "path", "--node", "{SNODE}", *UPC, "{W}/afile", code=FAILED),
    case("target remove", "id", *UPC, "999", code=FAILED),  # no such target
    case("node drain", "id", *UPC, "99", code=FAILED),  # no such node
    case("node drain", "id", *UPC, "{SNODE}", code=FAILED),  # nowhere to move its replicas
    case("node remove", "id", *UPC, "{SNODE}", code=FAILED),  # still holds replicas
    case("rebalance", "--config", *UPC, code=FAILED),  # balanced: nothing to move
    case("rebalance", "--wait", "--wait", *UPC, code=FAILED),
    case("jobs cancel", "id", *UPC, "rebalance-9", code=FAILED),  # no such job
    case("jobs cancel", "id", *UPC, "drain-{SNODE}", code=FAILED),  # not draining
    case("jobs cancel", "id", *UPC, "replace-{SNODE}", code=FAILED),  # not being replaced
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
    case("up", "--meta-servers", "--data-dir", "{UP}", "--meta-servers", "3"),
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
