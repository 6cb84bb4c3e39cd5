"""The rebalance planner and its job in mgmtd's state machine: moves even
out the nodes after one is added, one at a time through syncing-then-leave,
never leaving a chain short of serving replicas; cancel rolls back; the job
survives a restart of mgmtd."""

from __future__ import annotations

import errno
import io
from collections import Counter

import pytest
from chain_states import cluster, register

from shufflefs.cluster import drain, jobs, rebalance
from shufflefs.cluster.progress import Progress
from shufflefs.cluster.state import SERVING, SYNCING, ClusterState
from shufflefs.rpc.errors import FsError


def four_by_three_plus_one() -> ClusterState:
    """4 nodes of 3 targets in 4 chains of 3, then a 5th node of 3 spares."""
    state = cluster(initial_nodes=4)
    for node in range(1, 5):
        register(state, node, 3)
    assert len(state.chains) == 4
    register(state, 5, 3)
    assert len(state.chains) == 4  # its targets stay spares
    return state


def memberships(state: ClusterState) -> Counter[int]:
    return Counter(state.targets[t].node for c in state.chains.values() for t in c.targets)


def finish_copies(state: ClusterState) -> None:
    """What the storage daemons' resync does: every syncing member catches up."""
    for chain in list(state.chains.values()):
        for t in list(chain.targets):
            if state.targets[t].state == SYNCING:
                state.sync_done(t, chain.id, chain.version)


def test_the_plan_moves_memberships_to_the_new_node() -> None:
    state = four_by_three_plus_one()
    moves = rebalance.plan(state)
    assert moves  # by membership counts: usage is equal (all empty)
    new = {t.id for t in state.targets.values() if t.node == 5}
    assert all(m.into in new for m in moves)
    assert len({m.chain for m in moves}) == len(moves)  # one move per chain per plan
    assert rebalance.plan(state) == moves  # deterministic


def test_used_bytes_come_before_membership_counts() -> None:
    state = four_by_three_plus_one()
    heavy = next(iter(state.chains.values()))
    for t in heavy.targets:
        state.targets[t].used = 64 << 20
    (first, *_) = rebalance.plan(state)
    assert first.chain == heavy.id  # the full chain moves first: it evens bytes out most


def test_a_balanced_cluster_has_nothing_to_do() -> None:
    state = cluster(initial_nodes=4)
    for node in range(1, 5):
        register(state, node, 3)
    assert rebalance.plan(state) == []
    with pytest.raises(FsError) as info:
        rebalance.start(state)
    assert info.value.errno == errno.EALREADY


def test_rebalance_runs_one_move_at_a_time_to_the_end() -> None:
    state = four_by_three_plus_one()
    replicas = state.config["replicas"]
    job = rebalance.start(state)
    for _ in range(50):  # bounded: a handful of moves
        in_flight = [c for c in state.chains.values() if len(c.targets) > replicas]
        assert len(in_flight) <= 1  # throttled: one move cluster-wide
        for chain in state.chains.values():  # never fewer serving replicas
            assert sum(state.targets[t].state == SERVING for t in chain.targets) >= replicas
        if job["state"] != rebalance.RUNNING:
            break
        finish_copies(state)
        rebalance.step(state)
    assert job["state"] == rebalance.DONE and job["done"] >= 2
    counts = memberships(state)
    assert counts[5] >= 2 and max(counts.values()) - min(counts.values()) <= 1, counts
    assert all(len(c.targets) == replicas for c in state.chains.values())
    assert rebalance.plan(state) == []


def test_cancel_rolls_the_move_in_flight_back() -> None:
    state = four_by_three_plus_one()
    before = {c.id: list(c.targets) for c in state.chains.values()}
    job = rebalance.start(state)
    move = job["move"]
    assert move is not None and state.targets[move["into"]].state == SYNCING
    listed = {j["id"]: j for j in jobs.jobs(state)}
    assert listed[f"rebalance-{job['id']}"]["state"] == "running"
    assert f"resync-{move['into']}" in listed
    with pytest.raises(FsError):
        jobs.cancel(state, f"resync-{move['into']}")  # a resync is not cancellable
    jobs.cancel(state, f"rebalance-{job['id']}")
    assert {c.id: c.targets for c in state.chains.values()} == before
    assert state.targets[move["into"]].state == SERVING  # a spare again
    assert not rebalance.step(state)  # cancelled: nothing more starts
    with pytest.raises(FsError) as info:
        jobs.cancel(state, f"rebalance-{job['id']}")
    assert info.value.errno == errno.ENOENT


def test_the_job_survives_a_restart_of_mgmtd() -> None:
    state = four_by_three_plus_one()
    job = rebalance.start(state)
    again = ClusterState.from_record(state.to_record(), 0.0)
    assert rebalance.running(again) == job
    assert {j["id"] for j in jobs.jobs(again)} == {j["id"] for j in jobs.jobs(state)}
    finish_copies(again)
    assert rebalance.step(again)
    assert again.rebalance is not None and again.rebalance["done"] == 1


def test_drain_and_rebalance_exclude_each_other() -> None:
    state = four_by_three_plus_one()
    job = rebalance.start(state)
    with pytest.raises(FsError) as info:
        drain.start(state, 1)
    assert info.value.errno == errno.EBUSY and "rebalance" in info.value.message
    rebalance.cancel(state)
    drain.start(state, 1)
    assert next(j["id"] for j in jobs.jobs(state)) == "drain-1"
    with pytest.raises(FsError) as info:
        rebalance.start(state)
    assert info.value.errno == errno.EBUSY and "drain" in info.value.message
    drain.step(state)
    in_flight = [c for c in state.chains.values() if len(c.targets) > 3]
    assert len(in_flight) == 1
    jobs.cancel(state, "drain-1")  # rolls the drain's newcomer back
    assert all(len(c.targets) == 3 for c in state.chains.values())
    assert not state.draining(1)
    assert job["state"] == rebalance.CANCELLED


def run_to_the_end(state: ClusterState) -> dict[str, object]:
    job = rebalance.start(state)
    for _ in range(500):  # bounded: one step per copy
        if job["state"] != rebalance.RUNNING:
            break
        finish_copies(state)
        rebalance.step(state)
    assert job["state"] == rebalance.DONE
    return job


def test_two_new_nodes_in_a_bigger_cluster_fill_up() -> None:
    state = cluster(initial_nodes=20)
    for node in range(1, 21):
        register(state, node, 4)
    register(state, 21, 4)
    register(state, 22, 4)
    run_to_the_end(state)
    counts = memberships(state)
    assert counts[21] >= 3 and counts[22] >= 3, counts
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    for chain in state.chains.values():
        assert len({state.targets[t].node for t in chain.targets}) == 3


def test_a_drained_node_waiting_for_removal_does_not_block_a_rebalance() -> None:
    state = four_by_three_plus_one()
    drain.start(state, 1)
    for _ in range(50):
        if not drain.chains_of_node(state, 1):
            break
        finish_copies(state)
        drain.step(state)
    assert not drain.chains_of_node(state, 1) and state.draining(1)
    assert "drain-1" not in {j["id"] for j in jobs.jobs(state)}  # nothing runs
    with pytest.raises(FsError) as info:
        rebalance.start(state)  # node 5 took node 1's place: balanced, not busy
    assert info.value.errno == errno.EALREADY


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_a_line_per_change_otherwise() -> None:
    plain = io.StringIO()
    with Progress("drain-3", "chains", plain) as progress:
        for done in (0, 0, 1, 2):
            progress.show(done, 2)
    assert plain.getvalue().splitlines() == [f"drain-3: {n}/2 chains" for n in (0, 1, 2)]
    term = Terminal()
    with Progress("rebalance-1", "moves", term) as progress:
        progress.show(1, 3, "moving chain 2")
    assert "\r" in term.getvalue() and "1/3 moves" in term.getvalue()
