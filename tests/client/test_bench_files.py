"""`shufflefs bench files`: its arguments, its file set, its rows (no processes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shufflefs.client import bench_files_work as work
from shufflefs.client.bench_files import (
    OPERATION,
    PATHS,
    Row,
    settings_from_args,
    with_ratios,
)
from shufflefs.client.bench_files_work import FileSet, run_task, split
from shufflefs.client.data.hinted_reads import prefetch_available
from shufflefs.cluster.cli import build_parser


def parse(*argv: str) -> object:
    return build_parser().parse_args(["bench", "files", *argv])


def test_defaults_and_quick() -> None:
    s = settings_from_args(parse(), root=True)
    assert s.files == FileSet(20000, 110 << 10, 100)
    assert (s.procs, s.reads, s.proc_counts) == (4, 20000, [1, 4])
    assert s.ops == ("create", "stat", "scan", "read")
    assert s.caches == ("cold", "warm") and s.loader_workers == 4
    q = settings_from_args(parse("--quick"), root=True)
    assert q.files == FileSet(2000, 110 << 10, 20)


def test_explicit_numbers_ops_and_caches() -> None:
    args = parse("--quick", "--files", "30", "--dirs", "50", "--size", "4K", "--procs", "1",
                 "--reads", "100", "--ops", "create,read", "--no-loader")  # fmt: skip
    s = settings_from_args(args, root=True)
    assert s.files == FileSet(30, 4096, 30)  # never more directories than files
    assert s.reads == 30 and s.proc_counts == [1] and s.ops == ("create", "read")
    assert s.loader_workers == 0
    assert settings_from_args(parse(), root=False).caches == ("warm",)
    assert settings_from_args(parse("--no-cold"), root=True).caches == ("warm",)
    assert settings_from_args(parse("--unbuffered"), root=True).unbuffered
    assert not settings_from_args(parse(), root=True).unbuffered
    with pytest.raises(ValueError, match="at least"):
        settings_from_args(parse("--size", "8"), root=True)


@pytest.mark.parametrize(
    "argv", [["--ops", "create,write"], ["--procs", "0"], ["--size", "1Q"], ["--files", "-3"]]
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        parse(*argv)
    assert raised.value.code != 0


def test_file_set_shape() -> None:
    fs = FileSet(10, 100, 3)
    names = [fs.name(i) for i in range(10)]
    assert names[0] == "class0000/0000000.bin" and names[9] == "class0002/0000009.bin"
    assert fs.directories() == ["class0000", "class0001", "class0002"]
    assert all(work.index_of(n) == i for i, n in enumerate(names))
    order = fs.shuffled(7)
    assert sorted(order) == list(range(10)) and order != list(range(10))
    assert fs.shuffled(7, 4) == order[:4]
    assert [len(p) for p in split(list(range(10)), 3)] == [3, 3, 4]
    assert [x for part in split(list(range(10)), 3) for x in part] == list(range(10))


def test_operations_on_a_local_directory(tmp_path: Path) -> None:
    fs = FileSet(6, 64, 2)
    for d in fs.directories():
        (tmp_path / d).mkdir()
    names = [fs.name(i) for i in range(6)]
    root = str(tmp_path)
    assert run_task(("create", root, names, 64))[0] == 6
    assert run_task(("stat", root, names, 64))[0] == 6
    assert run_task(("scan", root, fs.directories(), 64))[0] == 6
    count, start, end = run_task(("read", root, names[::-1], 64))
    assert count == 6 and end >= start
    # a wrong byte count or another file's bytes are caught, by name
    (tmp_path / names[2]).write_bytes((tmp_path / names[3]).read_bytes())
    with pytest.raises(ValueError, match=names[2]):
        run_task(("read", root, names, 64))
    (tmp_path / names[3]).write_bytes(b"short")
    with pytest.raises(ValueError, match="stat"):
        run_task(("stat", root, names, 64))


def test_prefetch_row_reads_and_checks_without_a_mount(tmp_path: Path) -> None:
    # off a shufflefs mount nothing is hinted; the bytes are still checked
    names = [f"{i:07d}.bin" for i in range(3)]
    for i, n in enumerate(names):
        (tmp_path / n).write_bytes(b"%012d" % i + b"x" * 52)
    assert not prefetch_available(str(tmp_path))
    count, _, _ = run_task(("prefetch-read", str(tmp_path), names, 64))
    assert count == 3
    (tmp_path / names[1]).write_bytes(b"short")
    with pytest.raises(ValueError, match=names[1]):
        run_task(("prefetch-read", str(tmp_path), names, 64))


def test_row_shape_and_ratios() -> None:
    rows = [
        Row("local", 1, "warm", "read", 1000.0, 10, 0.01),
        Row("fuse", 1, "warm", "read", 250.0, 10, 0.04),
        Row("native", 4, "warm", "read", 50.0, 10, 0.2),  # no local row to compare with
        Row("local", 1, "cold", "stat", 10.0, 10, 1.0),
    ]
    with_ratios(rows)
    assert [r.ratio_to_local for r in rows] == [1.0, 0.25, None, 1.0]
    keys = {f.name for f in dataclasses.fields(Row)}
    assert {"path", "procs", "cache", "op", "per_s", "ratio_to_local"} <= keys
    assert {p for p, _ in OPERATION} == set(PATHS)
    assert {op for _, op in OPERATION} == {"stat", "scan", "read"}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--mount", "/mnt"], "drop --mount"),
        (["--embedded", "--config", "c.toml"], "drop --embedded, --config"),
        (["--prefetch-mount", "/p", "--ro-mount", "/r"], "drop --ro-mount, --prefetch-mount"),
        (["--replicas", "4"], "--replicas 4 needs as many --storage-hosts"),
    ],
)
def test_remote_refuses_what_it_decides_itself(argv: list[str], says: str) -> None:
    """--remote starts its own cluster and mounts: a clear error (the CLI
    prints it on one line and exits 2), never a half-started run."""
    from shufflefs.client.bench_files_remote import check_args

    with pytest.raises(ValueError, match=says):
        check_args(parse("--remote", *argv))
