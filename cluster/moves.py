"""Moving one replica of a chain from one target to another: the one
mechanism under `shufflefs node drain` (`cluster/drain.py`) and `shufflefs
rebalance` (`cluster/rebalance.py`).

A move never copies anything itself and never lowers a chain's replica
count: the newcomer (a spare target of a node that has no member in the
chain) joins at the chain's tail as `syncing`, so it receives every new
write while the storage daemons' resync copies the rest to it; only once it
serves may the old member leave, and only if the chain is as whole without
it as it was with it (`whole_without`). Until then the old member keeps
serving reads and taking writes. A newcomer that has not served yet can be
taken out again at no risk (`roll_back`): the chain is what it was before.
"""

from __future__ import annotations

from collections.abc import Collection

from shufflefs.cluster.state import OFFLINE, SERVING, SYNCING, WAITING, Chain, ClusterState, Target


def spare_for(
    state: ClusterState, chain: Chain, busy: Collection[int] = (), on_node: int | None = None
) -> Target | None:
    """A spare target that may join *chain*: serving, in no chain, on an
    online node that is not draining and has no member in the chain (on
    *on_node* only, if given); most free space first."""
    placed = {t for c in state.chains.values() for t in c.targets}
    members = {state.targets[t].node for t in chain.targets if t in state.targets}
    best: Target | None = None
    for t in state.targets.values():
        node = state.nodes.get(t.node)
        if (
            t.id in placed
            or t.id in busy
            or t.state != SERVING
            or node is None
            or node.state != "online"
            or state.draining(node.id)
            or t.node in members
            or (on_node is not None and t.node != on_node)
        ):
            continue
        if best is None or (t.free, -t.id) > (best.free, -best.id):
            best = t
    return best


def copying(state: ClusterState, chain: Chain) -> bool:
    """A member of *chain* is being brought up to date (a copy under way)."""
    return any(state.targets[t].state in (SYNCING, WAITING) for t in chain.targets)


def join(state: ClusterState, chain: Chain, spare: Target, why: str) -> None:
    """*spare* joins *chain* at its tail as syncing: resync copies the chain to it."""
    chain.targets.append(spare.id)
    spare.state = SYNCING
    state.chain_changed(chain)
    state.bump(f"target {spare.id} joins chain {chain.id} {why}")


def whole_without(state: ClusterState, chain: Chain, leaving: Collection[int]) -> bool:
    """*chain* is as whole without *leaving* as with it: its other members
    serve at least `replicas` minus the ones offline (an offline partner is
    no worse off for the move), and at least one serves."""
    others = [t for t in chain.targets if t not in leaving]
    serving = sum(1 for t in others if state.targets[t].state == SERVING)
    offline = sum(1 for t in others if state.targets[t].state == OFFLINE)
    return serving > 0 and serving >= state.config["replicas"] - offline


def leave(state: ClusterState, chain: Chain, target_id: int, why: str) -> None:
    """*target_id* leaves *chain* (it stays registered, as a spare)."""
    chain.targets.remove(target_id)
    if chain.last_serving == target_id:
        chain.last_serving = None
    state.chain_changed(chain)
    state.bump(f"target {target_id} left chain {chain.id} {why}")


def roll_back(state: ClusterState, chain: Chain, newcomer: int, why: str) -> bool:
    """Take *newcomer* out of *chain* again if it has not served yet (it held
    no replica anyone relied on); False if it serves already (the move is
    then as good as done) or is not in the chain."""
    if newcomer not in chain.targets or state.targets[newcomer].state == SERVING:
        return False
    leave(state, chain, newcomer, why)
    target = state.targets[newcomer]
    node = state.nodes.get(target.node)
    target.state = SERVING if node is not None and node.state == "online" else OFFLINE
    return True
