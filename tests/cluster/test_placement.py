"""The chain table builder (chains on distinct nodes, every pair of nodes
sharing about the same number of chains, mgmtd waiting for its nodes), and
draining and removing nodes and targets in mgmtd's state machine."""

from __future__ import annotations

import errno
import itertools

import pytest
from chain_states import cluster, register
from hypothesis import given, settings
from hypothesis import strategies as st

from shufflefs.cluster import drain
from shufflefs.cluster.placement import pair_counts, plan_chains
from shufflefs.cluster.state import SERVING, SYNCING, ClusterState
from shufflefs.rpc.errors import FsError


def free_targets(nodes: int, per_node: int) -> dict[int, list[int]]:
    return {n: [n * 1000 + k for k in range(per_node)] for n in range(1, nodes + 1)}


def node_lists(chains: list[list[int]]) -> list[list[int]]:
    return [[t // 1000 for t in c] for c in chains]


@settings(max_examples=80, deadline=None)
@given(nodes=st.integers(1, 30), per_node=st.integers(1, 12), replicas=st.integers(1, 4))
def test_chains_are_on_distinct_nodes_and_pairs_are_balanced(
    nodes: int, per_node: int, replicas: int
) -> None:
    free = free_targets(nodes, per_node)
    chains = plan_chains(free, replicas)
    used = [t for c in chains for t in c]
    assert len(used) == len(set(used))
    assert all(len(c) == replicas and len({t // 1000 for t in c}) == replicas for c in chains)
    if nodes < replicas:
        assert chains == []
        return
    # all but a few targets are placed: what is left cannot form a chain
    left = {n: per_node - sum(1 for t in used if t // 1000 == n) for n in free}
    assert sum(1 for v in left.values() if v) < replicas
    if replicas >= 2:
        counts = pair_counts(node_lists(chains))
        every = [counts.get(p, 0) for p in itertools.combinations(range(1, nodes + 1), 2)]
        ideal = -(-len(chains) * replicas * (replicas - 1) // 2 // len(every))
        assert max(every) <= ideal + 1, (max(every), ideal)
    assert plan_chains(free, replicas) == chains  # deterministic


def test_a_node_shares_its_chains_with_many_partners() -> None:
    chains = node_lists(plan_chains(free_targets(100, 16), 3))
    partners = {n for c in chains if 1 in c for n in c if n != 1}
    assert len(partners) == 32  # 16 chains, two new partners each
    tails = {[n for n in c if n != 1][-1] for c in chains if 1 in c}
    assert len(tails) == 16  # a returning node 1 resyncs from 16 different nodes


def test_new_chains_even_out_the_existing_ones() -> None:
    existing = [[1, 2, 3], [1, 2, 3]]
    chains = node_lists(plan_chains({1: [1000], 2: [2000], 3: [3000], 4: [4000]}, 3, existing))
    assert len(chains) == 1 and 4 in chains[0]


def test_bad_replicas() -> None:
    with pytest.raises(ValueError):
        plan_chains({1: [1]}, 0)


def test_the_first_table_waits_for_the_initial_nodes() -> None:
    state = cluster(initial_nodes=4)
    for node in range(1, 4):
        register(state, node, 3)
    assert state.chains == {}  # three of four: wait
    register(state, 4, 3)
    nodes = [[state.targets[t].node for t in c.targets] for c in state.chains.values()]
    assert len(nodes) == 4
    for a, b in itertools.combinations(sorted(state.nodes), 2):
        assert sum(1 for c in nodes if a in c and b in c) == 2


def test_without_initial_nodes_the_first_replicas_nodes_build_it() -> None:
    state = cluster(initial_nodes=0)
    for node in range(1, 4):
        register(state, node, 2)
    assert len(state.chains) == 2


def four_nodes() -> ClusterState:
    """4 storage nodes of one target each, 3 replicas: one chain and a spare."""
    state = cluster(initial_nodes=4)
    for node in range(1, 5):
        register(state, node, 1)
    assert len(state.chains) == 1
    return state


def members(state: ClusterState) -> list[int]:
    (chain,) = state.chains.values()
    return [state.targets[t].node for t in chain.targets]


def test_drain_moves_the_replica_to_the_spare_then_leaves() -> None:
    state = four_nodes()
    victim = members(state)[0]
    (spare_node,) = set(state.nodes) - set(members(state))
    (chain,) = state.chains.values()
    assert drain.start(state, victim) == [chain.id]
    assert drain.step(state)
    spare = next(t for t in state.targets.values() if t.node == spare_node)
    assert chain.targets[-1] == spare.id and spare.state == SYNCING
    assert victim in members(state)  # still serving while the copy runs
    assert not drain.step(state)  # one copy at a time: nothing more until it is done
    state.sync_done(spare.id, chain.id, chain.version)
    assert spare.state == SERVING
    assert drain.step(state)
    assert victim not in members(state) and len(members(state)) == 3
    with pytest.raises(FsError) as busy:
        drain.remove_target(state, chain.targets[0])
    assert busy.value.code == errno.EBUSY
    drain.remove_node(state, victim)
    assert victim not in state.nodes and all(t.node != victim for t in state.targets.values())
    assert state.build_chains() == []  # nothing left over to build from


def test_refusals_change_nothing() -> None:
    state = four_nodes()
    first, second, _ = members(state)
    drain.start(state, first)
    drain.step(state)
    before = state.to_record()
    for call, code in (
        (lambda: drain.start(state, second), errno.EBUSY),  # the spare is taken
        (lambda: drain.start(state, 99), errno.ENOENT),
        (lambda: drain.remove_node(state, second), errno.EBUSY),
        (lambda: drain.remove_node(state, 99), errno.ENOENT),
        (lambda: drain.remove_target(state, 99), errno.ENOENT),
    ):
        with pytest.raises(FsError) as exc:
            call()
        assert exc.value.code == code
    assert state.to_record() == before


def test_a_drain_survives_a_restart_of_mgmtd() -> None:
    state = four_nodes()
    victim = members(state)[0]
    drain.start(state, victim)
    again = ClusterState.from_record(state.to_record(), 0.0)
    assert again.draining(victim)
    assert drain.step(again)  # picks up where it was
