"""Re-replicating a storage node that stays dead: mgmtd's side.

When every target of a storage node has been offline for longer than
`replace_offline_after` seconds (mgmtd.toml, 600 by default; 0 turns it off),
mgmtd starts job ``replace-NODE``: in essence a drain (`cluster/drain.py`) of
a node that cannot serve. For each chain the dead node is in, a new member
joins the chain's tail as `syncing` through `cluster/moves.py` and the
storage daemons' resync copies the chain to it from a surviving member; once
it serves, the dead node's target leaves the chain. The new member's node is
chosen like the chain table's (`cluster/placement.py`): the one sharing the
fewest chains with the chain's surviving members, then with the fewest
memberships; a spare target there joins, or, if it has none, mgmtd asks its
storage daemon to create one beside its existing targets
(``<their parent>/replaces-target<T>``, named after the dead member, so a
restart of mgmtd asks for the same one again). With a balanced table the
dead node's chains have different partners, so the copies are fed by many
nodes at once. At most `replace_parallel` chains of the node copy at once.

Guards, for the operator woken at 3 a.m.: no job starts (and a running one
starts no new copy) while more than `replace_max_offline` storage nodes are
offline: a rack or power outage must not set off a storm of copies that
undo themselves once power is back. A chain none of whose members serves is
left alone (there is nothing to copy from, and its last serving member is
the only one with every write). A running rebalance delays the start. The
job is in mgmtd's persisted state, so it resumes after a restart of mgmtd;
``shufflefs jobs cancel replace-NODE`` stops it (as a drain is cancelled)
and mgmtd does not start it again until the node has been back.

When the node is in no chain any more, mgmtd removes it, as ``shufflefs node
remove`` does: its daemon, should it come back, is refused when it
registers and stops, so its stale chunks are never served; wipe its data
dir to bring the machine back as a new node (and `shufflefs rebalance`).
A node that comes back before its job ended ends the job: the move in
flight is rolled back and the node's remaining targets resync as after any
restart; the ones already replaced are spares whose chunks resync deletes
should they ever join a chain.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from shufflefs.cluster import drain, moves, rebalance
from shufflefs.cluster.state import SERVING, Chain, ClusterState
from shufflefs.rpc.errors import FsError

log = logging.getLogger("shufflefs.mgmtd.replace")

DEFAULT_AFTER = 600.0
_told: set[tuple[int, str]] = set()  # (node, why) waits already logged


@dataclass(frozen=True)
class Provision:
    """A target mgmtd must have storage node *node* create (at *path*)."""

    node: int
    path: str
    chain: int


def settings(state: ClusterState) -> tuple[float, int, int]:
    """(replace_offline_after, replace_max_offline, replace_parallel)."""
    config = state.config
    return (
        float(config.get("replace_offline_after", DEFAULT_AFTER)),
        int(config.get("replace_max_offline", 1)),
        int(config.get("replace_parallel", 4)),
    )


def _offline_storage(state: ClusterState) -> list[int]:
    return sorted(n.id for n in state.nodes.values() if n.kind == "storage" and n.state != "online")


def _tell(node_id: int, why: str, *args: object) -> None:
    if (node_id, why) not in _told:
        _told.add((node_id, why))
        log.warning(why, *args)


def due(state: ClusterState, now: float) -> list[int]:
    """Storage nodes whose job should start now (guards passed); logs why a
    dead node waits, once per reason."""
    after, max_offline, _ = settings(state)
    if after <= 0:
        return []
    offline = _offline_storage(state)
    out: list[int] = []
    for node_id in offline:
        node = state.nodes[node_id]
        if (
            node_id in state.replacing
            or node_id in state.replace_cancelled
            or state.draining(node_id)
            or now - node.offline_since < after
            or not drain.chains_of_node(state, node_id)
        ):
            continue
        if len(offline) > max_offline:
            _tell(
                node_id,
                "node %d offline for %.0fs but not replaced: %d storage nodes are offline "
                "(at most %d may be: replace_max_offline)",
                node_id,
                now - node.offline_since,
                len(offline),
                max_offline,
            )
            continue
        if rebalance.running(state) is not None:
            _tell(node_id, "node %d offline: its replacement waits for the rebalance", node_id)
            continue
        out.append(node_id)
    return out


def start(state: ClusterState, node_id: int, now: float) -> None:
    node = state.nodes[node_id]
    why = f"all its targets offline for {now - node.offline_since:.0f}s"
    state.replacing[node_id] = why
    state.draining_nodes.add(node_id)
    chains = drain.chains_of_node(state, node_id)
    state.drain_chains[node_id] = len(chains)
    log.warning("re-replicating node %d (%s): chains %s", node_id, why, [c.id for c in chains])
    state.bump(f"node {node_id} replaced ({why}): leaves chains {[c.id for c in chains]}")


def _new_member_node(state: ClusterState, chain: Chain, dead: int) -> int | None:
    """The node a new member of *chain* goes to: online storage node, not
    draining, no member in the chain; fewest chains shared with the
    surviving members, then fewest memberships, then lowest id."""
    members = {state.targets[t].node for t in chain.targets}
    survivors = members - {dead}
    shared: dict[int, int] = {}
    load: dict[int, int] = {}
    for c in state.chains.values():
        nodes = {state.targets[t].node for t in c.targets}
        for n in nodes:
            load[n] = load.get(n, 0) + 1
            shared[n] = shared.get(n, 0) + len(nodes & survivors)
    candidates = [
        n.id
        for n in state.nodes.values()
        if n.kind == "storage"
        and n.state == "online"
        and not state.draining(n.id)
        and n.id not in members
    ]
    if not candidates:
        return None
    spares = {
        t.node
        for t in state.targets.values()
        if t.state == SERVING and state.chain_of(t.id) is None
    }
    # a node with a spare first among equals: one created for this chain is
    # taken on the next step even if the memberships changed meanwhile
    return min(candidates, key=lambda n: (shared.get(n, 0), n not in spares, load.get(n, 0), n))


def step(state: ClusterState) -> tuple[bool, list[Provision]]:
    """Move every replacement on: (anything changed, targets to create)."""
    changed = False
    wanted: list[Provision] = []
    _, max_offline, parallel = settings(state)
    for node_id in sorted(state.replace_cancelled):
        node = state.nodes.get(node_id)
        if node is None or node.state == "online":
            state.replace_cancelled.discard(node_id)  # back: a later death is replaced again
            changed = True
    for node_id in sorted(state.replacing):
        node = state.nodes.get(node_id)
        if node is None:
            state.replacing.pop(node_id)
            changed = True
            continue
        if node.state == "online":
            log.warning("node %d is back: its replacement ends", node_id)
            cancel(state, node_id, "node back")
            state.replace_cancelled.discard(node_id)
            changed = True
            continue
        chains = drain.chains_of_node(state, node_id)
        if not chains:
            _finish(state, node_id)
            changed = True
            continue
        storm = len(_offline_storage(state)) > max_offline
        copying = 0
        for chain in chains:
            mine = [t for t in chain.targets if state.targets[t].node == node_id]
            if mine and chain.last_serving in mine:
                continue  # it alone holds every write: never taken out
            if moves.copying(state, chain):
                copying += 1
                continue
            if moves.whole_without(state, chain, mine):
                for t in mine:
                    moves.leave(state, chain, t, f"(node {node_id} replaced)")
                changed = True
                continue
            if storm:
                _tell(node_id, "replacement of node %d paused: too many nodes offline", node_id)
                continue
            if copying >= parallel:
                continue
            if not any(state.targets[t].state == SERVING for t in chain.targets):
                _tell(node_id, "replacement of node %d: a chain has nothing to copy from", node_id)
                continue
            target = _new_member_node(state, chain, node_id)
            if target is None:
                _tell(node_id, "replacement of node %d waits: no node to move to", node_id)
                continue
            spare = moves.spare_for(state, chain, on_node=target)
            if spare is None:
                wanted.append(Provision(target, _path_for(state, target, mine), chain.id))
                copying += 1  # one being created counts against the parallel limit
                continue
            moves.join(state, chain, spare, f"replacing node {node_id}")
            copying += 1
            changed = True
        if not drain.chains_of_node(state, node_id):
            _finish(state, node_id)  # its last chain was left just now
    return changed, wanted


def _finish(state: ClusterState, node_id: int) -> None:
    """The node is in no chain: removed, as `shufflefs node remove` does."""
    why = state.replacing.pop(node_id)
    log.warning("node %d re-replicated (%s): removed from the cluster", node_id, why)
    drain.remove_node(state, node_id)


def _path_for(state: ClusterState, node_id: int, dead: list[int]) -> str:
    """Beside the node's target with the most free space, named after the member it replaces."""
    own = [t for t in state.targets.values() if t.node == node_id]
    best = max(own, key=lambda t: (t.free, -t.id))
    name = f"replaces-target{dead[0] if dead else 0}"
    return os.path.join(os.path.dirname(best.path.rstrip("/")), name)


def cancel(state: ClusterState, node_id: int, why: str = "cancelled") -> list[int]:
    """Stop replacing *node_id* (as a drain is cancelled); not started again
    until the node has been back online."""
    if node_id not in state.replacing:
        raise FsError(errno.ENOENT, f"node {node_id} is not being replaced")
    left = drain.cancel(state, node_id)
    state.replacing.pop(node_id, None)
    state.replace_cancelled.add(node_id)
    log.warning("replacement of node %d %s; it stays in chains %s", node_id, why, left)
    return left
