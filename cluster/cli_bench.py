"""The argument parsers of `shufflefs bench` and its modes (`loader`, `files`);
`cluster/cli.py` adds them to the command line."""

from __future__ import annotations

import argparse

from shufflefs.cluster.preflight import (
    TOKEN_DTYPES,
    comma_list,
    int_list,
    positive_float,
    positive_int,
    size,
)

CONFIG_HELP = "client config (default: $SHUFFLEFS_CONFIG, else ./.shufflefs/client.toml)"


def cluster_args(p: argparse.ArgumentParser) -> None:
    """Which cluster a benchmark measures: a running one, or one of its own."""
    p.add_argument("--config", help=f"of a running cluster: {CONFIG_HELP}")
    p.add_argument(
        "--mountpoint", help="where that cluster is mounted, for the FUSE rows (default: none)"
    )
    p.add_argument(
        "--embedded", action="store_true", help="start a cluster in a temp dir, stop it after"
    )


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="random-read IOPS four ways in, side by side (`bench loader`: training-data reads)",
        description="Random-read IOPS, MB/s and latency of the same reads through a local file "
        "(the limit), the FUSE mount, the native client and the native client batched; cold "
        "(page caches dropped, as root) and warm. With MODE `loader`: the training-data "
        "benchmark.",
    )
    cluster_args(p)
    p.add_argument("--quick", action="store_true", help="a 256 MiB file, 0.4 s per row")
    p.add_argument("--json", action="store_true", help="print one JSON object with `rows`")
    p.add_argument("--readers", type=positive_int, default=8, help="concurrent reader processes")
    p.add_argument(
        "--size-mb", type=positive_int, help="test file size in MiB (default: 1024; quick 256)"
    )
    p.add_argument("--seconds", type=positive_float, help="seconds per row (default: 5; quick 0.4)")
    p.add_argument(
        "--workloads",
        type=comma_list(_io_workloads, "workload"),
        help="comma-separated: rand4k,rand2k,rand128k,seq1m (default: all)",
    )
    p.add_argument(
        "--paths",
        type=comma_list(_io_paths, "path"),
        help="comma-separated: local,fuse,native,native-batch (default: all)",
    )
    p.add_argument("--batch", type=positive_int, default=64, help="reads per native-batch call")
    p.add_argument("--local-dir", help="where the local copy lives (default: the temp dir)")
    p.add_argument(
        "--no-local-reads",
        action="store_true",
        help="native rows read through the storage daemons even on their own host",
    )
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache rows")
    r = remote_group(
        p, "start storage hosts and reader hosts, measure from a reader host, tear all down"
    )
    r.add_argument("--reader-hosts", type=positive_int, default=1, help="reader hosts")
    r.add_argument("--replicas", type=positive_int, help="default: min(3, storage hosts)")
    r.add_argument(
        "--link-mbps",
        type=positive_float,
        help="cap each storage host's link, MB/s each way (default: uncapped)",
    )
    r.add_argument("--no-fio", action="store_true", help="skip the fio O_DIRECT rows")
    r.add_argument("--rounds", type=positive_int, default=1, help="fio rows: N rounds, medians")
    r.add_argument(
        "--compare",
        metavar="DIR",
        help="fio rows on a copy in DIR too, e.g. a MooseFS mount (default: none)",
    )
    modes = p.add_subparsers(dest="bench_mode", metavar="MODE")
    modes.required = False
    b = modes.add_parser(
        "loader",
        help="shuffled token windows per second: local disk, FUSE, native; with readahead",
        description="Sweep the batch size at a fixed seq_len and report tokens/s, samples/s "
        "and p99 batch latency for a local copy, the FUSE mount (plain reads) and the native "
        "client without and with readahead along the shuffle; cold (page caches dropped, as "
        "root) and warm.",
    )
    cluster_args(b)
    b.add_argument("--local-dir", help="where the local copy lives (default: a temp dir)")
    b.add_argument("--remote-dir", default="/bench-loader", help="dataset folder on the cluster")
    b.add_argument("--dataset-size", type=size, default="2G", help="total size of the token files")
    b.add_argument("--files", type=positive_int, default=8, help="number of token files")
    b.add_argument("--seq-len", type=positive_int, default=1024, help="tokens per window")
    b.add_argument("--dtype", choices=TOKEN_DTYPES, default="uint16", help="token dtype")
    b.add_argument(
        "--batch-sizes", type=int_list, default="8,32,128,512,2048,4096", help="comma-separated"
    )
    b.add_argument(
        "--readahead", type=positive_int, default=4, help="batches in flight (readahead rows)"
    )
    b.add_argument("--seconds", type=positive_float, default=3.0, help="time per measurement")
    b.add_argument(
        "--configs",
        type=comma_list(_loader_configs, "row"),
        default="local,local+ra,fuse,fuse+ra,native,native+ra",
        help="which rows: local, local+ra, fuse, fuse+ra, native, native+ra",
    )
    b.add_argument("--no-cold", action="store_true", help="skip the cold-cache pass")
    b.add_argument("--no-warm", action="store_true", help="skip the warm-cache pass")
    b.add_argument("--seed", type=int, default=0, help="of the shuffle")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument(
        "--plot", metavar="FILE.png", help="draw tokens/s against batch size (default: no plot)"
    )
    add_bench_files_parser(modes)


def remote_group(p: argparse.ArgumentParser, what: str) -> argparse._ArgumentGroup:
    """The --remote options of a benchmark (*what* --remote does), for more."""
    r = p.add_argument_group("--remote: readers off the storage hosts (network namespaces, root)")
    r.add_argument("--remote", action="store_true", help=what)
    r.add_argument("--storage-hosts", type=positive_int, default=3, help="storage hosts")
    return r


def add_bench_files_parser(modes: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    f = modes.add_parser(
        "files",
        help="one-file-per-sample datasets: create, stat, scan, shuffled reads, a DataLoader",
        description="Create an ImageFolder-shaped set of files in a local directory and in the "
        "mount, and measure create+write+close/s, stat/s, scan entries/s and open+read+close/s "
        "in shuffled order with 1 and --procs processes, cold and warm, through the mount, an "
        "-o ro mount and the native FileDataset, each with its ratio to the local directory; "
        "then a DataLoader(num_workers=4) over the mount.",
    )
    f.add_argument("--config", help=f"of the cluster to measure: {CONFIG_HELP}")
    f.add_argument("--mount", help="a mounted filesystem to measure (default: the cluster's)")
    f.add_argument(
        "--ro-mount",
        help="a read-only mount of the same files (default: a `mount -o ro` it starts)",
    )
    f.add_argument("--prefetch-mount", help="a mount with prefetch (default: its immutable one)")
    f.add_argument("--embedded", action="store_true", help="start a cluster, stop it after")
    f.add_argument(
        "--replicas",
        type=positive_int,
        help="copies per chunk of --embedded's or --remote's cluster (default: as `up`)",
    )
    f.add_argument("--local-dir", help="where the local directory's set goes (default: /tmp)")
    f.add_argument("--quick", action="store_true", help="2,000 files in 20 directories")
    f.add_argument("--files", type=positive_int, help="files in the set (default: 20000)")
    f.add_argument("--size", type=size, help="bytes per file (default: 110K)")
    f.add_argument("--dirs", type=positive_int, help="class directories (default: 100)")
    f.add_argument("--procs", type=positive_int, default=4, help="processes of the parallel rows")
    f.add_argument("--reads", type=positive_int, help="files per stat/read row (default: all)")
    f.add_argument(
        "--ops",
        type=comma_list(_files_ops, "operation"),
        help="comma-separated: create,stat,scan,read (default: all; files are always created)",
    )
    f.add_argument("--no-cold", action="store_true", help="skip the cold rows")
    f.add_argument(
        "--unbuffered",
        action="store_true",
        help="open+read+close rows open with buffering=0: no isatty ioctl per file "
        "(which Python before 3.14 asks of every file opened buffered)",
    )
    f.add_argument("--no-loader", action="store_true", help="skip the DataLoader rows")
    f.add_argument(
        "--loader-workers", type=positive_int, default=4, help="num_workers of the DataLoader"
    )
    f.add_argument("--seed", type=int, default=0, help="of the shuffled order")
    f.add_argument("--keep", action="store_true", help="leave the files in the mount")
    f.add_argument("--json", action="store_true", help="print one JSON object with `rows`")
    remote_group(
        f, "start storage hosts and a reader host; every mount and worker on the reader host"
    )


def _files_ops() -> tuple[str, ...]:
    from shufflefs.client.bench_files import OPS

    return OPS


def _io_workloads() -> tuple[str, ...]:
    from shufflefs.client.iobench import WORKLOADS

    return tuple(WORKLOADS)


def _io_paths() -> tuple[str, ...]:
    from shufflefs.client.iobench import PATHS

    return tuple(PATHS)


def _loader_configs() -> tuple[str, ...]:
    from shufflefs.client.data.bench import CONFIGS

    return tuple(CONFIGS)
