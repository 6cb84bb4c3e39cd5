"""Re-replicating a dead storage node in mgmtd's state machine: the guards
(threshold, several nodes offline, off), the moves through a surviving
member, new targets where no spare is, cancel, restart, the node removed
at the end and a node back in time."""

from __future__ import annotations

import itertools

from chain_states import cluster, register

from shufflefs.cluster import jobs, replace
from shufflefs.cluster.placement import pair_counts
from shufflefs.cluster.state import OFFLINE, SERVING, SYNCING, ClusterState

T0 = 1000.0


def five_by_three(after: float = 60.0, **extra: int) -> ClusterState:
    state = cluster(initial_nodes=5)
    state.config["replace_offline_after"] = after
    for key, value in extra.items():
        state.config[key] = value  # type: ignore[literal-required]
    for node in range(1, 6):
        register(state, node, 3)
    assert len(state.chains) == 5
    return state


def kill(state: ClusterState, node: int, at: float = T0) -> None:
    for other in state.nodes.values():
        other.last_seen = at - 100 if other.id == node else at
    assert state.expire(at) == [node]


def spare_paths(state: ClusterState) -> list[str]:
    return sorted(t.path for t in state.targets.values() if state.chain_of(t.id) is None)


def run(state: ClusterState, at: float, rounds: int = 50) -> list[replace.Provision]:
    """Start what is due and step to the end, doing what the storage daemons
    would: create asked-for targets (registering them) and finish resyncs."""
    created: list[replace.Provision] = []
    for node in replace.due(state, at):
        replace.start(state, node, at)
    for _ in range(rounds):
        _, wanted = replace.step(state)
        for want in wanted:
            created.append(want)
            state.register(
                None,
                "storage",
                state.nodes[want.node].address,
                f"host{want.node}",
                state.nodes[want.node].pid,
                want.node,
                [
                    {"target_id": t.id, "path": t.path, "capacity": 1 << 30, "free": 1 << 30}
                    | {"device": want.node}
                    for t in state.targets.values()
                    if t.node == want.node
                ]
                + [
                    {"target_id": None, "path": want.path, "capacity": 1 << 30, "free": 1 << 30}
                    | {"device": want.node}
                ],
                at,
            )
        if rounds == 1:
            replace.step(state)  # the created targets join; their copies stay in flight
            break
        for chain in list(state.chains.values()):
            for t in list(chain.targets):
                if state.targets[t].state == SYNCING:
                    state.sync_done(t, chain.id, chain.version)
        if not state.replacing:
            break
    return created


def test_no_job_before_the_threshold_and_none_when_off() -> None:
    state = five_by_three(after=60.0)
    kill(state, 2)
    assert replace.due(state, T0 + 59) == []
    assert replace.due(state, T0 + 61) == [2]
    off = five_by_three(after=0.0)
    kill(off, 2)
    assert replace.due(off, T0 + 10**6) == []


def test_no_job_while_two_nodes_are_offline() -> None:
    state = five_by_three()
    kill(state, 2)
    kill(state, 4, at=T0 + 1)
    assert replace.due(state, T0 + 1000) == []
    state.config["replace_max_offline"] = 2  # the operator allows it
    assert replace.due(state, T0 + 1000) == [2, 4]


def test_a_running_rebalance_delays_the_start() -> None:
    state = five_by_three()
    state.rebalance = {"id": 1, "state": "running", "done": 0, "planned": 1, "move": None}
    kill(state, 2)
    assert replace.due(state, T0 + 100) == []
    state.rebalance["state"] = "done"
    assert replace.due(state, T0 + 100) == [2]


def test_a_second_death_pauses_a_running_job() -> None:
    state = five_by_three()
    kill(state, 2)
    for node in replace.due(state, T0 + 100):
        replace.start(state, node, T0 + 100)
    _, wanted = replace.step(state)
    assert wanted  # no spares: targets to create, one per chain of node 2
    kill(state, 5, at=T0 + 101)
    before = {c.id: list(c.targets) for c in state.chains.values()}
    _, wanted = replace.step(state)
    assert wanted == []  # nothing new is asked for or joins while two nodes are offline
    assert {c.id: list(c.targets) for c in state.chains.values()} == before
    assert state.replacing.keys() == {2}  # paused, not ended


def test_a_dead_node_is_re_replicated_from_its_partners_and_removed() -> None:
    state = five_by_three()
    kill(state, 3)
    dead_chains = [
        c.id for c in state.chains.values() if any(state.targets[t].node == 3 for t in c.targets)
    ]
    created = run(state, T0 + 100)
    assert 3 not in state.nodes and 3 in state.removed_nodes
    assert not state.replacing
    assert len(created) == len(dead_chains)  # no spares: one target created per chain
    assert all(p.path.startswith(f"/d{p.node}/replaces-target") for p in created)
    for chain in state.chains.values():
        nodes = [state.targets[t].node for t in chain.targets]
        assert len(nodes) == 3 and len(set(nodes)) == 3 and 3 not in nodes
        assert all(state.targets[t].state == SERVING for t in chain.targets)
    # the new members spread over the survivors: pair counts stay close
    counts = pair_counts(
        [[state.targets[t].node for t in c.targets] for c in state.chains.values()]
    )
    pairs = [counts.get(p, 0) for p in itertools.combinations([1, 2, 4, 5], 2)]
    assert max(pairs) - min(pairs) <= 2, counts
    assert len({p.node for p in created}) >= 2


def test_the_last_serving_member_is_never_taken_out() -> None:
    state = five_by_three(replace_max_offline=3)
    chain = next(iter(state.chains.values()))
    a, b, c = (state.targets[t].node for t in chain.targets)
    for n, at in ((a, T0), (b, T0 + 1), (c, T0 + 2)):
        kill(state, n, at)
    assert chain.last_serving is not None
    run(state, T0 + 1000)
    assert chain.last_serving in chain.targets
    assert state.targets[chain.last_serving].state == OFFLINE


def test_cancel_restart_and_a_node_back_in_time() -> None:
    state = five_by_three(replace_parallel=1)
    kill(state, 2)
    for node in replace.due(state, T0 + 100):
        replace.start(state, node, T0 + 100)
    listed = {j["id"]: j for j in jobs.jobs(state)}
    assert listed["replace-2"]["kind"] == "replace" and "offline" in listed["replace-2"]["detail"]
    # mgmtd restarts: the job is in the record
    state = ClusterState.from_record(state.to_record(), T0 + 101)
    assert state.replacing.keys() == {2}
    cancelled = jobs.cancel(state, "replace-2")
    assert cancelled["state"] == "cancelled"
    assert replace.due(state, T0 + 200) == []  # not started again by itself
    # back online (registers again), then dead again: replaced again
    state.register(
        None,
        "storage",
        state.nodes[2].address,
        "host2",
        999,
        2,
        [
            {"target_id": t.id, "path": t.path, "capacity": 1, "free": 1, "device": 2}
            for t in state.targets.values()
            if t.node == 2
        ],
        T0 + 300,
    )
    replace.step(state)
    assert 2 not in state.replace_cancelled
    kill(state, 2, at=T0 + 400)
    assert replace.due(state, T0 + 500) == [2]
    run(state, T0 + 500, rounds=1)  # a target created, joined, copying
    assert any(state.targets[t].state == SYNCING for c in state.chains.values() for t in c.targets)
    # it comes back before the end: the job ends, the copy in flight rolled back
    state.register(
        None,
        "storage",
        state.nodes[2].address,
        "host2",
        1000,
        2,
        [
            {"target_id": t.id, "path": t.path, "capacity": 1, "free": 1, "device": 2}
            for t in state.targets.values()
            if t.node == 2
        ],
        T0 + 510,
    )
    replace.step(state)
    assert not state.replacing and 2 in state.nodes
    assert all(len(c.targets) == 3 for c in state.chains.values())
