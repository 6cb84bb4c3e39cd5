"""`shufflefs rebalance`: even out the storage nodes' share of the chains
after nodes or targets were added (mgmtd's side).

New targets of a node that joins a running cluster stay spares (a chain
needs `replicas` nodes with free targets), so the old nodes keep all the
data. A rebalance moves chain memberships onto them: `plan` picks a member
target on the most-used node and a spare target on the least-used node
that has no member in that chain, as long as the move leaves the two closer
than they were (usage is the bytes the chains' targets report, in whole
chunks; where that is equal, the number of chain memberships). mgmtd
carries out one move at a time cluster-wide through `cluster/moves.py` (the
spare joins as syncing, resync copies the chain to it, then the old member
leaves), so no chain ever has fewer serving replicas and the copy traffic
stays a trickle beside training reads.

The job is a record in mgmtd's persisted state (`ClusterState.rebalance`)
and each step re-plans from the current chains, so it resumes after a
restart of mgmtd and adapts when nodes come and go meanwhile. Cancelling
it (`shufflefs jobs cancel`) starts no more moves and rolls the one in
flight back: its newcomer has not served yet, so taking it out leaves the
chain as it was (one that already serves completes the move instead).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shufflefs.cluster import moves
from shufflefs.cluster.state import SERVING, Chain, ClusterState
from shufflefs.rpc.errors import FsError

RUNNING, DONE, CANCELLED = "running", "done", "cancelled"


@dataclass(frozen=True)
class Move:
    chain: int
    out: int  # the member target that leaves
    into: int  # the spare target that joins


def _healthy(state: ClusterState, chain: Chain) -> bool:
    """Every member serving and no more than `replicas` of them: a chain a move may start on."""
    return len(chain.targets) == state.config["replicas"] and all(
        state.targets[t].state == SERVING for t in chain.targets if t in state.targets
    )


def plan(state: ClusterState, limit: int | None = None) -> list[Move]:
    """The moves that even out the nodes, in the order they would be made
    (each as if the earlier ones were done); at most *limit*. Deterministic."""
    nodes = sorted(
        n.id
        for n in state.nodes.values()
        if n.kind == "storage" and n.state == "online" and not state.draining(n.id)
    )
    granule = max(1, int(state.config["chunk_size"]))
    members: dict[int, list[tuple[int, int]]] = {n: [] for n in nodes}  # node -> (chain, target)
    chain_nodes: dict[int, set[int]] = {}
    for chain in sorted(state.chains.values(), key=lambda c: c.id):
        chain_nodes[chain.id] = {state.targets[t].node for t in chain.targets}
        for t in chain.targets:
            node = state.targets[t].node
            if node in members:
                members[node].append((chain.id, t))
    placed = {t for c in state.chains.values() for t in c.targets}
    spares: dict[int, list[int]] = {n: [] for n in nodes}
    for spare in sorted(state.targets.values(), key=lambda t: (-t.free, t.id)):
        if spare.id not in placed and spare.state == SERVING and spare.node in spares:
            spares[spare.node].append(spare.id)
    # every member of a chain holds the same data: count the most any reports
    # (a newcomer's own figure lags by a heartbeat after its resync)
    used: dict[int, int] = {}
    for chain in state.chains.values():
        most = max((state.targets[t].used for t in chain.targets), default=0)
        used.update((t, most) for t in chain.targets)
    movable = {c.id for c in state.chains.values() if _healthy(state, c)}

    def load(n: int) -> tuple[int, int]:
        return sum(used[t] for _, t in members[n]) // granule, len(members[n])

    out: list[Move] = []
    for _ in range(sum(len(m) for m in members.values())):  # bounded: never more moves than members
        if limit is not None and len(out) >= limit:
            break
        move = _best_move(nodes, members, spares, chain_nodes, movable, used, granule, load)
        if move is None:
            break
        a, b, chain_id, t = move
        into = spares[b].pop(0)
        members[a].remove((chain_id, t))
        used[into] = used[t]
        members[b].append((chain_id, into))
        chain_nodes[chain_id] = (chain_nodes[chain_id] - {a}) | {b}
        movable.discard(chain_id)  # one move per chain per plan
        out.append(Move(chain_id, t, into))
    return out


def _best_move(
    nodes: list[int],
    members: dict[int, list[tuple[int, int]]],
    spares: dict[int, list[int]],
    chain_nodes: dict[int, set[int]],
    movable: set[int],
    used: dict[int, int],
    granule: int,
    load: Callable[[int], tuple[int, int]],
) -> tuple[int, int, int, int] | None:
    """(from node, to node, chain, member target) of the move that evens the
    most-used node out best with a node that has a spare; None if no move
    leaves the pair closer than it was."""
    loads = {n: load(n) for n in nodes}
    for a in sorted(nodes, key=lambda n: (loads[n], -n), reverse=True):
        bytes_a = sum(used[t] for _, t in members[a])
        for b in sorted((n for n in nodes if spares[n]), key=lambda n: (loads[n], n)):
            if b == a or loads[b][1] >= loads[a][1]:
                continue
            bytes_b = sum(used[t] for _, t in members[b])
            best: tuple[tuple[int, int], int, int] | None = None
            for chain_id, t in members[a]:
                if chain_id not in movable or b in chain_nodes[chain_id]:
                    continue
                after_b = ((bytes_b + used[t]) // granule, loads[b][1] + 1)
                after_a = ((bytes_a - used[t]) // granule, loads[a][1] - 1)
                if not after_b < loads[a]:
                    continue  # the pair would be no closer
                score = max(after_a, after_b)
                if best is None or score < best[0]:
                    best = (score, chain_id, t)
            if best is not None:  # the least-used node that can take one of a's chains
                return a, b, best[1], best[2]
    return None


def running(state: ClusterState) -> dict[str, Any] | None:
    job = state.rebalance
    return job if job is not None and job["state"] == RUNNING else None


def start(state: ClusterState) -> dict[str, Any]:
    """Start a rebalance (or return the one running). Refused while a drain
    runs (one kind of move at a time) and when no move would even anything out."""
    placed = {state.targets[t].node for c in state.chains.values() for t in c.targets}
    ids = sorted(n for n in state.draining_nodes if n in placed)  # drained ones wait for removal
    if ids:
        raise FsError(
            errno.EBUSY,
            f"node(s) {ids} are being drained: rebalance when the drain is done "
            f"(or cancel it: `shufflefs jobs cancel drain-{ids[0]}`)",
        )
    job = running(state)
    if job is not None:
        return job
    planned = plan(state)
    if not planned:
        raise FsError(
            errno.EALREADY,
            "nothing to rebalance: no move would even out the nodes "
            "(add storage nodes or targets first; spares must be serving)",
        )
    job = {"id": state.next_job, "state": RUNNING, "done": 0, "planned": len(planned), "move": None}
    state.next_job += 1
    state.rebalance = job
    step(state)
    state.bump(f"rebalance {job['id']} started: {len(planned)} moves planned")
    return job


def step(state: ClusterState) -> bool:
    """Move the running rebalance on; True if anything changed (persist then)."""
    job = running(state)
    if job is None:
        return False
    move = job["move"]
    if move is not None:
        chain = state.chains.get(move["chain"])
        into = state.targets.get(move["into"])
        if chain is None or into is None or into.id not in chain.targets:
            job["move"] = None  # lost under us (the target was removed): plan afresh
            return True
        if into.state == SERVING:
            if move["out"] in chain.targets:
                if not moves.whole_without(state, chain, [move["out"]]):
                    return False  # a partner is syncing: leave once the chain is whole
                moves.leave(state, chain, move["out"], f"(rebalance {job['id']})")
            job["done"] += 1
            job["move"] = None
        elif into.state == "offline":
            moves.roll_back(state, chain, into.id, f"(rebalance {job['id']}: newcomer offline)")
            job["move"] = None
            return True
        else:
            return False  # still copying: one move at a time cluster-wide
    nxt = plan(state, limit=1)
    if not nxt:
        job["state"] = DONE
        return True
    m = nxt[0]
    moves.join(
        state,
        state.chains[m.chain],
        state.targets[m.into],
        f"(rebalance {job['id']}: replaces target {m.out})",
    )
    job["move"] = {"chain": m.chain, "out": m.out, "into": m.into}
    return True


def cancel(state: ClusterState) -> dict[str, Any]:
    """Stop the running rebalance: no new move; the one in flight is rolled
    back (or, if its newcomer serves already, completed)."""
    job = running(state)
    if job is None:
        raise FsError(errno.ENOENT, "no rebalance is running")
    move = job["move"]
    if move is not None and move["chain"] in state.chains:
        chain = state.chains[move["chain"]]
        why = f"(rebalance {job['id']} cancelled)"
        if (
            not moves.roll_back(state, chain, move["into"], why)
            and move["into"] in chain.targets
            and move["out"] in chain.targets
            and moves.whole_without(state, chain, [move["out"]])
        ):
            moves.leave(state, chain, move["out"], why)  # the newcomer serves: complete it
            job["done"] += 1
    job["move"] = None
    job["state"] = CANCELLED
    state.bump(f"rebalance {job['id']} cancelled after {job['done']} moves")
    return job


def left(state: ClusterState) -> int:
    """Moves the running rebalance has still to make, as planned now."""
    job = running(state)
    if job is None:
        return 0
    return (1 if job["move"] is not None else 0) + len(plan(state))
