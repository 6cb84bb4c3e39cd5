"""Draining and removing storage nodes and targets: mgmtd's side.

``shufflefs node drain ID`` marks the node draining. From then on, for every
chain holding one of its targets, mgmtd adds a spare target of another node
(one not in that chain, most free space first) at the chain's tail as
`syncing`; the storage daemons' resync copies the chain to it while the
draining target still serves reads and takes writes; once the new member is
serving, the draining target leaves the chain. One chain at a time per
node, so the copy traffic stays a trickle beside training reads. When the
node is in no chain any more it is *drained*, and ``shufflefs node remove``
takes it out of the cluster.

The drain is a flag in mgmtd's persisted state and each step is derived from
the current chains (`step`), so it resumes by itself after mgmtd, the node
or a replacement restarts. Everything that could leave data with fewer
replicas is refused before anything changes: draining a node some chain of
which has no spare target to move to, removing a node or a target that is
still a chain member.
"""

from __future__ import annotations

import errno
import logging

from shufflefs.cluster import moves, rebalance
from shufflefs.cluster.state import SERVING, SYNCING, WAITING, Chain, ClusterState
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.mgmtd.drain")
_told: set[tuple[int, int]] = set()  # (node, chain) drains already logged as waiting for a spare


def storage_node(state: ClusterState, node_id: int) -> None:
    node = state.nodes.get(node_id)
    if node is None or node.kind != "storage":
        raise FsError(errno.ENOENT, f"node {node_id} is not a storage node of this cluster")


def chains_of_node(state: ClusterState, node_id: int) -> list[Chain]:
    return [
        c
        for c in sorted(state.chains.values(), key=lambda c: c.id)
        if any(state.targets[t].node == node_id for t in c.targets if t in state.targets)
    ]


def start(state: ClusterState, node_id: int) -> list[int]:
    """Mark *node_id* draining; the chains it must leave. Refused (nothing
    changes) when one of them has no spare target to move to."""
    storage_node(state, node_id)
    chains = chains_of_node(state, node_id)
    busy: set[int] = set()
    for chain in chains:
        spare = moves.spare_for(state, chain, busy)
        if spare is None and not _has_replacement(state, chain, node_id):
            raise FsError(
                errno.EBUSY,
                f"node {node_id} cannot be drained: chain {chain.id} has no spare target on "
                "another node to move to (add one with `shufflefs target add`)",
            )
        if spare is not None:
            busy.add(spare.id)
    job = rebalance.running(state)
    if job is not None:
        raise FsError(
            errno.EBUSY,
            f"a rebalance runs: drain when it is done, or cancel it "
            f"(`shufflefs jobs cancel rebalance-{job['id']}`)",
        )
    if not state.draining(node_id):
        state.draining_nodes.add(node_id)
        state.drain_chains[node_id] = len(chains)
        state.bump(f"node {node_id} draining: leaves chains {[c.id for c in chains]}")
    return [c.id for c in chains]


def _has_replacement(state: ClusterState, chain: Chain, node_id: int) -> bool:
    """The chain already has `replicas` members on nodes that stay (a drain resumed)."""
    return len(_staying(state, chain, node_id)) >= state.config["replicas"]


def _staying(state: ClusterState, chain: Chain, node_id: int) -> list[int]:
    """*chain*'s members on nodes that are neither *node_id* nor draining."""
    return [
        t
        for t in chain.targets
        if state.targets[t].node != node_id and not state.draining(state.targets[t].node)
    ]


def step(state: ClusterState) -> bool:
    """Move every draining node one step on; True if anything changed."""
    changed = False
    for node_id in sorted(state.draining_nodes):
        if node_id in state.replacing:
            continue  # a dead node's: `cluster/replace.py` moves it on
        for chain in chains_of_node(state, node_id):
            mine = [t for t in chain.targets if state.targets[t].node == node_id]
            if any(
                state.targets[t].state in (SYNCING, WAITING) for t in chain.targets if t not in mine
            ):
                break  # a copy under way: one chain at a time per node
            if moves.whole_without(state, chain, mine):
                for t in mine:  # the chain is as whole without us as it was with us
                    moves.leave(state, chain, t, "(drained)")
                changed = True
                continue
            spare = moves.spare_for(state, chain)
            if spare is None:
                if (node_id, chain.id) not in _told:
                    _told.add((node_id, chain.id))
                    log.warning("drain of node %d waits: chain %d has no spare", node_id, chain.id)
                break
            moves.join(state, chain, spare, f"for draining node {node_id}")
            changed = True
            break
    return changed


def cancel(state: ClusterState, node_id: int) -> list[int]:
    """Stop draining *node_id*: no new moves start, and the one in flight is
    rolled back (its newcomer has not served yet, so the chain is what it was
    before; one that already serves stays, and the node's member leaves as
    the move completes). The chains the node is still in."""
    if not state.draining(node_id):
        raise FsError(errno.ENOENT, f"node {node_id} is not being drained")
    for chain in chains_of_node(state, node_id):
        mine = [t for t in chain.targets if state.targets[t].node == node_id]
        if len(chain.targets) <= state.config["replicas"]:
            continue
        for t in reversed(chain.targets):
            if t not in mine and moves.roll_back(state, chain, t, "(drain cancelled)"):
                break
        else:
            if moves.whole_without(state, chain, mine):
                for t in mine:
                    moves.leave(state, chain, t, "(drained)")
    state.draining_nodes.discard(node_id)
    state.drain_chains.pop(node_id, None)
    state.bump(f"drain of node {node_id} cancelled")
    return [c.id for c in chains_of_node(state, node_id)]


def remove_node(state: ClusterState, node_id: int) -> None:
    """Take a storage node that is in no chain out of the cluster, for good:
    its daemon, if still running, is refused when it registers again."""
    storage_node(state, node_id)
    chains = chains_of_node(state, node_id)
    if chains:
        raise FsError(
            errno.EBUSY,
            f"node {node_id} still holds replicas in chains {[c.id for c in chains]}: "
            f"drain it first (`shufflefs node drain {node_id}`)",
        )
    for t in [t.id for t in state.targets.values() if t.node == node_id]:
        del state.targets[t]
    del state.nodes[node_id]
    state.draining_nodes.discard(node_id)
    state.drain_chains.pop(node_id, None)
    state.removed_nodes.add(node_id)
    state.bump(f"node {node_id} removed")


def remove_target(state: ClusterState, target_id: int) -> None:
    """Forget a target that is in no chain (a spare, or one drained)."""
    target = state.targets.get(target_id)
    if target is None:
        raise FsError(errno.ENOENT, f"unknown target {target_id}")
    chain = state.chain_of(target_id)
    if chain is not None:
        only = [t for t in chain.targets if state.targets[t].state == SERVING] == [target_id]
        why = "holds the only serving replica of" if only else "is a member of"
        raise FsError(
            errno.EBUSY,
            f"target {target_id} {why} chain {chain.id}: drain its node first "
            f"(`shufflefs node drain {target.node}`)",
        )
    del state.targets[target_id]
    state.bump(f"target {target_id} removed")
