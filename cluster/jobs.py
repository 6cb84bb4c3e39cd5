"""mgmtd's background jobs, for `shufflefs jobs`: drains (`cluster/drain.py`),
re-replications of dead nodes (`cluster/replace.py`), the rebalance
(`cluster/rebalance.py`) and the resyncs of syncing targets.

A job id names what the job works on, so it is the same after a restart of
mgmtd: ``drain-NODE``, ``replace-NODE``, ``rebalance-N`` (numbered in mgmtd's persisted
state), ``resync-TARGET``. Drains, replacements and rebalances can be cancelled; a resync
cannot (it is how a replica comes back; drain or remove its node instead).
"""

from __future__ import annotations

import errno
import re

from shufflefs.cluster import drain, rebalance, replace
from shufflefs.cluster.protocol import JobInfo
from shufflefs.cluster.state import SYNCING, WAITING, ClusterState
from shufflefs.rpc.errors import FsError

JOB_ID = re.compile(r"(drain|replace|rebalance|resync)-([1-9][0-9]*)")


def jobs(state: ClusterState) -> list[JobInfo]:
    """Every running job (drains with chains left, resyncs), and the last
    rebalance also when it has ended."""
    out: list[JobInfo] = []
    for node in sorted(state.draining_nodes):
        left = len(drain.chains_of_node(state, node))
        if not left:
            continue  # drained: waits for `shufflefs node remove`, nothing runs
        total = max(state.drain_chains.get(node, left), left)
        kind = "replace" if node in state.replacing else "drain"
        why = f" ({state.replacing[node]})" if kind == "replace" else ""
        out.append(
            JobInfo(
                id=f"{kind}-{node}",
                kind=kind,
                state="running",
                done=total - left,
                left=left,
                detail=f"node {node}: {left} of {total} chains left{why}",
            )
        )
    job = state.rebalance
    if job is not None:
        move = job["move"]
        now = (
            f"; moving chain {move['chain']}: target {move['out']} -> {move['into']}"
            if move
            else ""
        )
        left = rebalance.left(state)
        out.append(
            JobInfo(
                id=f"rebalance-{job['id']}",
                kind="rebalance",
                state=job["state"],
                done=job["done"],
                left=left,
                detail=f"{job['done']} moves done, {left} left{now}",
            )
        )
    for chain in sorted(state.chains.values(), key=lambda c: c.id):
        for t in chain.targets:
            if state.targets[t].state in (SYNCING, WAITING):
                out.append(
                    JobInfo(
                        id=f"resync-{t}",
                        kind="resync",
                        state=state.targets[t].state,
                        done=0,
                        left=1,
                        detail=f"target {t} (node {state.targets[t].node}) in chain {chain.id}",
                    )
                )
    return out


def cancel(state: ClusterState, job_id: str) -> JobInfo:
    """Cancel drain or rebalance *job_id*; what it looks like afterwards."""
    match = JOB_ID.fullmatch(job_id)
    if match is None:
        raise FsError(errno.EINVAL, f"{job_id!r} is not a job id (see `shufflefs jobs`)")
    kind, number = match.group(1), int(match.group(2))
    if kind == "resync":
        raise FsError(
            errno.EINVAL,
            "a resync cannot be cancelled (it brings a replica back); drain its node "
            "instead (`shufflefs node drain`)",
        )
    if kind == "drain" and number in state.replacing:
        raise FsError(
            errno.ENOENT, f"node {number} is being replaced, not drained: cancel replace-{number}"
        )
    if kind == "replace":
        left = replace.cancel(state, number)
        return JobInfo(
            id=job_id,
            kind="replace",
            state="cancelled",
            done=0,
            left=len(left),
            detail=f"node {number} stays in chains {left} (not replaced again until it was back)",
        )
    if kind == "drain":
        left = drain.cancel(state, number)
        return JobInfo(
            id=job_id,
            kind="drain",
            state="cancelled",
            done=0,
            left=len(left),
            detail=f"node {number} stays in chains {left}",
        )
    job = rebalance.running(state)
    if job is None or job["id"] != number:
        raise FsError(errno.ENOENT, f"no running job {job_id} (see `shufflefs jobs`)")
    job = rebalance.cancel(state)
    return JobInfo(
        id=job_id,
        kind="rebalance",
        state=job["state"],
        done=job["done"],
        left=0,
        detail=f"cancelled after {job['done']} moves; the move in flight was rolled back",
    )
