"""`shufflefs mount -o`: the options each mode defaults to, and the bad values
refused with EINVAL naming the option (the CLI prints that one line)."""

from __future__ import annotations

import errno

import pytest

from shufflefs.fuse.libfuse import SPIN
from shufflefs.fuse.mount_options import (
    DATASET_LINGER,
    DATASET_TIMEOUT,
    RW_LINGER,
    RW_TIMEOUT,
    WATCHED_LINGER,
    parse_options,
)
from shufflefs.rpc.errors import FsError


def test_default_mount_is_read_write_close_to_open() -> None:
    o = parse_options([])
    assert not o.read_only and o.fuse_options() == set()
    assert (o.attr_timeout, o.entry_timeout, o.negative_timeout) == (RW_TIMEOUT, RW_TIMEOUT, 0.0)
    assert o.handle_linger == WATCHED_LINGER and o.local_reads and o.cache_watch
    assert parse_options(["no_cache_watch"]).handle_linger == RW_LINGER  # opens revalidate


@pytest.mark.parametrize("given", [["ro"], ["cache=immutable"], ["ro,cache=immutable"]])
def test_ro_is_the_dataset_mode_with_long_timeouts(given: list[str]) -> None:
    o = parse_options(given)
    assert o.read_only and "ro" in o.fuse_options()
    assert o.attr_timeout == o.entry_timeout == o.negative_timeout == DATASET_TIMEOUT
    assert o.handle_linger == DATASET_LINGER
    assert o.immutable == ("cache=immutable" in given[0])  # only it serves reads by inode
    assert o.info("/m")["mode"] == ("immutable" if o.immutable else "ro")


def test_writeback_is_the_read_write_mode_whose_closes_finish_behind() -> None:
    o = parse_options(["writeback"])
    assert o.writeback and not o.read_only and o.fuse_options() == set()
    assert o.info("/m")["mode"] == "writeback"
    assert not parse_options([]).writeback and parse_options([]).info("/m")["mode"] == "rw"
    assert parse_options(["writeback_cache"]).writeback_cache
    assert not parse_options(["writeback"]).writeback_cache


def test_timeouts_are_options_in_either_mode() -> None:
    o = parse_options(["attr_timeout=2.5,entry_timeout=0", "negative_timeout=7"])
    assert (o.attr_timeout, o.entry_timeout, o.negative_timeout) == (2.5, 0.0, 7.0)
    o = parse_options(["ro,attr_timeout=3600", "handle_linger=0,max_tasks=8,no_local_reads"])
    assert o.read_only and o.attr_timeout == 3600 and o.entry_timeout == DATASET_TIMEOUT
    assert o.handle_linger == 0 and o.max_tasks == 8 and not o.local_reads


def test_spin_us_is_microseconds_the_fuse_thread_polls_before_sleeping() -> None:
    assert parse_options([]).spin == SPIN > 0
    assert parse_options(["spin_us=0"]).spin == 0.0
    assert parse_options(["ro,spin_us=10000"]).spin == 0.01


def test_list_ahead_is_subdirectories_listed_ahead() -> None:
    assert parse_options([]).list_ahead == parse_options(["ro"]).list_ahead == 8
    assert parse_options(["list_ahead=0"]).list_ahead == 0
    assert parse_options(["cache=immutable,list_ahead=1024"]).list_ahead == 1024


def test_dir_ahead_is_entries_of_a_directory_opened_ahead() -> None:
    assert parse_options([]).dir_ahead == parse_options(["ro"]).dir_ahead == 1024
    assert parse_options(["dir_ahead=0"]).dir_ahead == 0
    assert parse_options(["ro,dir_ahead=65536"]).dir_ahead == 65536


def test_info_is_what_the_session_reports() -> None:
    info = parse_options(["ro,entry_timeout=9"]).info("/mnt/x")
    assert info == {
        "mountpoint": "/mnt/x",
        "mode": "ro",
        "attr_timeout": DATASET_TIMEOUT,
        "entry_timeout": 9.0,
        "negative_timeout": DATASET_TIMEOUT,
        "handle_linger": DATASET_LINGER,
    }


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("attr_timeout=soon", "attr_timeout=soon"),
        ("entry_timeout=-1", "entry_timeout=-1"),
        ("negative_timeout=nan", "negative_timeout=nan"),
        ("attr_timeout=inf", "attr_timeout=inf"),
        ("attr_timeout=1e9", "attr_timeout=1e9"),
        ("attr_timeout", "needs a value"),
        ("ro=1", "takes no value"),
        ("max_tasks=0", "max_tasks=0"),
        ("max_tasks=many", "max_tasks=many"),
        ("spin_us=-1", "spin_us=-1"),
        ("spin_us=10001", "microseconds from 0 to 10000"),
        ("spin_us=0.5", "spin_us=0.5"),
        ("spin_us", "spin_us=MICROSECONDS"),
        ("list_ahead=-1", "list_ahead=-1"),
        ("list_ahead=1025", "a whole number from 0 to 1024"),
        ("list_ahead", "list_ahead=DIRECTORIES"),
        ("dir_ahead=-1", "dir_ahead=-1"),
        ("dir_ahead=65537", "a whole number from 0 to 65536"),
        ("dir_ahead=all", "dir_ahead=all"),
        ("dir_ahead", "dir_ahead=ENTRIES"),
        ("cache=loose", "cache=loose"),
        ("cache=immutable,rw", "needs a read-only mount"),
        ("ro,writeback", "'writeback' needs a read-write mount"),
        ("cache=immutable,writeback", "'writeback' needs a read-write mount"),
        ("ro,writeback_cache", "'writeback_cache' needs a read-write mount"),
        ("writeback=1", "takes no value"),
        ("ro,rw", "contradict"),
        ("noatime", "unknown mount option 'noatime'"),
    ],
)
def test_bad_options_are_einval_naming_them(given: str, says: str) -> None:
    with pytest.raises(FsError) as err:
        parse_options([given])
    assert err.value.code == errno.EINVAL
    assert says in err.value.message and "\n" not in err.value.message
