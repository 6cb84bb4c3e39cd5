"""`shufflefs rebalance [--wait]` and `shufflefs jobs [cancel ID]` (mgmtd
does the work: `cluster/rebalance.py`, `cluster/jobs.py`)."""

from __future__ import annotations

import argparse
import errno
import json
import time

import trio

from shufflefs.cluster.admin import with_mgmtd
from shufflefs.cluster.progress import Progress, poll
from shufflefs.cluster.protocol import JobInfo, MgmtdStub
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError

POLL = 0.5  # seconds between looks at a job's progress


async def wait_rebalance(mgmtd: MgmtdStub, job: JobInfo, wait: float) -> JobInfo:
    """Follow rebalance *job* until it ends (or *wait* seconds: ETIMEDOUT)."""
    deadline = trio.current_time() + wait
    with Progress(job["id"], "moves") as progress:
        while True:
            progress.show(job["done"], job["done"] + job["left"], job["detail"].partition("; ")[2])
            if job["state"] != "running":
                return job
            if trio.current_time() > deadline:
                raise FsError(
                    errno.ETIMEDOUT,
                    f"{job['id']} not done after {wait:g}s: {job['detail']} "
                    "(it goes on; see `shufflefs jobs`)",
                )
            await trio.sleep(POLL)
            listed = await poll(mgmtd.jobs)
            if listed is None:
                continue  # mgmtd restarting: look again
            found = [j for j in listed if j["id"] == job["id"]]
            if not found:  # replaced by a newer rebalance: ours has ended
                return {**job, "state": "done", "left": 0}
            job = found[0]


def cli_rebalance(args: argparse.Namespace) -> int:
    """``shufflefs rebalance [--wait]``."""
    started = time.monotonic()

    async def run(mgmtd: MgmtdStub, rpc: RpcClient) -> JobInfo:
        job = await mgmtd.rebalance()
        return await wait_rebalance(mgmtd, job, args.timeout) if args.wait else job

    job = with_mgmtd(args, run)
    if args.json:
        print(json.dumps(job))
    elif job["state"] == "running":
        print(
            f"{job['id']} started: {job['left']} moves planned "
            "(progress in `shufflefs jobs`; `--wait` waits)"
        )
    else:
        print(
            f"{job['id']} {job['state']} in {time.monotonic() - started:.1f}s: "
            f"{job['done']} moves made"
        )
    return 0


def cli_jobs(args: argparse.Namespace) -> int:
    """``shufflefs jobs`` and ``shufflefs jobs cancel ID``."""
    if args.jobs_command == "cancel":

        async def cancel(mgmtd: MgmtdStub, rpc: RpcClient) -> JobInfo:
            return await mgmtd.cancel_job(args.id)

        job = with_mgmtd(args, cancel)
        print(json.dumps(job) if args.json else f"{job['id']} cancelled: {job['detail']}")
        return 0

    async def listing(mgmtd: MgmtdStub, rpc: RpcClient) -> list[JobInfo]:
        return await mgmtd.jobs()

    jobs = with_mgmtd(args, listing)
    if args.json:
        print(json.dumps({"jobs": jobs}))
    elif not jobs:
        print("no background jobs")
    else:
        width = max(len(j["id"]) for j in jobs)
        for j in jobs:
            print(f"{j['id']:<{width}}  {j['state']:<9}  {j['detail']}")
    return 0
