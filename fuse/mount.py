"""`shufflefs mount` and `shufflefs umount`.

The mount process connects to the cluster first (routing map, metadata
session) and only then mounts, so a mountpoint that appears is usable. It
stays until unmounted (``shufflefs umount``/``fusermount3 -u``) or sent
SIGTERM (it then unmounts itself). Without --foreground the command starts
the mount process in the background and returns once the mount is ready.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from pathlib import Path

import pyfuse3
import trio

from shufflefs.client.fs import ClientOptions, FileSystem
from shufflefs.cluster import procs
from shufflefs.cluster.config import ClientConfig, find_client_config, load_client_config
from shufflefs.cluster.launcher import unmount, wait_mounted
from shufflefs.cluster.metrics_client import read_counter, start_client_metrics
from shufflefs.cluster.preflight import mounted_fstype
from shufflefs.cluster.routing import RoutingCache
from shufflefs.fuse import device_reader
from shufflefs.fuse.fast_answers import FastAnswerCounts, FastAnswers
from shufflefs.fuse.fast_hints import FastHints
from shufflefs.fuse.fast_reads import FastReadCounts, FastReads
from shufflefs.fuse.libfuse import KernelQueue, SpinCounts
from shufflefs.fuse.mount_options import MountOptions, parse_options
from shufflefs.fuse.ops import ShuffleOps
from shufflefs.fuse.read_inode import READ_INODES
from shufflefs.fuse.writeback import DRAIN_SECONDS
from shufflefs.rpc.client import open_rpc_client
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.runtime import run_service, setup_logging

log = logging.getLogger("shufflefs.mount")

FSTYPE = "fuse.shufflefs"


class FuseLoop:
    """Whether `pyfuse3.main` runs: `pyfuse3.terminate` touches the FUSE
    session, which `pyfuse3.close` frees, so it must not be called after."""

    running = False

    def end(self) -> None:
        """SIGTERM of the mount: end `pyfuse3.main` (its ``finally`` unmounts
        and closes the session while the connections still run)."""
        if self.running:
            self.running = False
            pyfuse3.terminate()


FUSE_LOOP = FuseLoop()


async def run_mount(
    config: ClientConfig,
    secret: bytes,
    mountpoint: Path,
    options: MountOptions,
) -> None:
    if options.immutable and not READ_INODES.available():
        # said before the session opens, so `shufflefs status` shows the mode it runs in
        log.warning(
            "cache=immutable: this pyfuse3 build cannot name a READ's inode: mounting as ro"
        )
        options.immutable = False
    async with open_rpc_client(secret) as rpc, trio.open_nursery() as nursery:
        routing = RoutingCache(rpc, config.mgmtd)
        client_options = ClientOptions(
            local_reads=options.local_reads,
            open_linger=options.handle_linger,
            trust_open_cache=options.read_only,
            cache_watch=options.cache_watch,
            mount=options.info(str(mountpoint)),
            inline_disk_waits=False,
        )
        fs = FileSystem(rpc, routing, client_options)
        await fs.start(nursery)
        fast_counts = FastReadCounts()
        answer_counts = FastAnswerCounts()
        spin_counts = SpinCounts()
        ops = ShuffleOps(fs, options)
        writeback = [ops.writeback.counts.collect] if ops.writeback is not None else []
        watch = [fs.cache_watch.collect] if fs.cache_watch is not None else []
        await start_client_metrics(
            nursery,
            fs,
            options.metrics or config.mount_metrics,
            rpc=rpc,
            mgmtd=config.mgmtd,
            collectors=[
                fast_counts.collect,
                answer_counts.collect,
                spin_counts.collect,
                ops.dir_ahead.counts.collect,
                ops.list_ahead.counts.collect,
                *writeback,
                *watch,
            ],
        )
        await ops.start(nursery)
        opts = set(pyfuse3.default_options) | options.fuse_options()
        opts |= {"fsname=shufflefs", "subtype=shufflefs"}
        if os.geteuid() == 0:
            opts.add("allow_other")  # every user of a training node may use the mount
        pyfuse3.init(ops, str(mountpoint), opts)
        fast: FastReads | None = None
        READ_INODES.noflush_read_only = not options.read_only
        keeps_listings = not options.immutable and (options.read_only or fs.cache_watch is not None)
        READ_INODES.dir_flags = ops.listings.flags if keeps_listings else None
        fast_answers = options.fast_answers
        READ_INODES.answering = fast_answers
        fast_hints = options.fast_answers and ops.prefetch.running
        READ_INODES.hinting = fast_hints
        wanted = options.immutable or options.fast_reads or keeps_listings or fast_answers
        hooked = wanted and READ_INODES.install()
        if hooked and not options.immutable and not options.fast_reads:
            READ_INODES.hook_reads(None, False)  # the opendir trampoline alone
        if options.immutable:
            if hooked:
                ops.serve_by_inode()
            else:
                log.warning("cache=immutable: opens stay on (READs would not name their inode)")
        queue = KernelQueue(READ_INODES.session, options.spin, spin_counts) if hooked else None
        if hooked:
            device_reader.install(READ_INODES.session)
        if queue is not None and options.fast_reads:
            fast = FastReads(ops, fs, secret, nursery, queue, fast_counts, on_read=read_counter(fs))
            fast.install()
        answers = None
        if queue is not None and fast_answers:
            answers = FastAnswers(ops, READ_INODES, nursery, queue, answer_counts)
            answers.install()
        if queue is not None and ops.kept_listings.enabled:
            ops.kept_listings.install(queue, answer_counts)
            READ_INODES.fast_listing = ops.kept_listings.readdirplus
        hints = None
        if queue is not None and fast_hints:
            hints = FastHints(ops, READ_INODES, nursery, queue, answer_counts)
            hints.install()
        log.info(
            "mounted %s (mode %s%s; kernel options %s)",
            mountpoint,
            options.info(str(mountpoint))["mode"],
            ", the kernel's writeback cache" if options.writeback_cache else "",
            ",".join(sorted(opts)),
        )
        try:
            FUSE_LOOP.running = True
            await pyfuse3.main(min_tasks=4, max_tasks=options.max_tasks)
        finally:
            FUSE_LOOP.running = False
            device_reader.uninstall()
            with trio.CancelScope(shield=True):
                READ_INODES.fast_listing = None
                if answers is not None:
                    answers.close()
                if hints is not None:
                    hints.close()
                if fast is not None:
                    fast.close()
                if queue is not None:
                    queue.close()
                pyfuse3.close(unmount=True)
                log.info("unmounted %s", mountpoint)
                if ops.writeback is not None:
                    await ops.writeback.drain()  # every close done, as on the default mount
                with trio.move_on_after(10):
                    await fs.close()
        nursery.cancel_scope.cancel()


def cli_mount(args: argparse.Namespace) -> int:
    config_path = find_client_config(args.config).absolute()
    config, secret = load_client_config(config_path)  # fail here, in the caller's terminal
    mountpoint = Path(args.mountpoint).absolute()
    options = parse_options(args.options)
    if not mountpoint.is_dir():
        raise FsError(errno.ENOTDIR, f"mountpoint {mountpoint} is not a directory")
    if mounted_fstype(mountpoint) is not None:
        raise FsError(errno.EBUSY, f"{mountpoint} is already a mountpoint")
    if not args.foreground:
        return mount_in_background(args, config_path, mountpoint)
    setup_logging("mount", args.log_file or config.log_file, config.log_level)
    return run_service(
        "mount", lambda: run_mount(config, secret, mountpoint, options), graceful=FUSE_LOOP.end
    )


def mount_in_background(args: argparse.Namespace, config_path: Path, mountpoint: Path) -> int:
    log_file = Path(args.log_file or config_path.parent / "logs" / "mount.log").absolute()
    argv = ["mount", "--foreground", "--config", str(config_path), "--log-file", str(log_file)]
    for opt in args.options:
        argv += ["-o", opt]
    proc = procs.ServiceProcess(
        name="mount",
        argv=(*argv, str(mountpoint)),
        marker=str(mountpoint),
        pid_file=log_file.parent / f"mount-{os.getpid()}.pid",
        out_file=log_file.with_suffix(".out"),
    )
    pid = procs.start(proc)
    try:
        wait_mounted(mountpoint, pid, 60.0)
    except FsError as exc:
        raise FsError(
            exc.code, f"{exc.message}; see {log_file}\n{procs.tail(log_file, 8)}"
        ) from None
    finally:
        proc.pid_file.unlink(missing_ok=True)
    print(f"mounted shufflefs at {mountpoint} (pid {pid}, log {log_file})")
    return 0


def cli_umount(args: argparse.Namespace) -> int:
    mountpoint = Path(args.mountpoint).absolute()
    if mounted_fstype(mountpoint) != FSTYPE:
        print(f"shufflefs umount: {mountpoint} is not a shufflefs mount", file=sys.stderr)
        return 1
    serving = mount_processes(mountpoint)
    unmount(mountpoint)
    for pid in serving:
        # it finishes what it owes the cluster first (-o writeback: the
        # closes still behind) and then exits
        if not procs.wait_exit(pid, DRAIN_SECONDS + 10):
            print(f"shufflefs umount: mount process {pid} has not exited", file=sys.stderr)
            return 1
    return 0


def mount_processes(mountpoint: Path) -> list[int]:
    """The pids of the mount processes serving *mountpoint* (``mount
    --foreground ... MOUNTPOINT``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            words = procs.argv(int(entry.name))
            if words[-1:] == [str(mountpoint)] and "--foreground" in words and "mount" in words:
                found.append(int(entry.name))
    return found
