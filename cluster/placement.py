"""The chain table: which targets form each replication chain.

A storage node serves several targets (one per disk, or several per disk),
each target is a member of one chain, and the chains are spread so that every
pair of nodes shares about the same number of them, with every node at each
chain position (head ... tail) about equally often. Then a dead node's
targets sit in chains with many different partners, and its data is
re-replicated from all of them at once: with ``t`` targets per node, a
replacement node resyncs ``t`` chains from up to ``t * (replicas - 1)``
different nodes instead of copying a whole node from one or two disks. (3FS
builds its chain tables the same way, from balanced incomplete block
designs; a greedy builder gets close to their balance and works for any
number of nodes and targets.)

The builder is a pure function of who has free targets and which chains
exist already: mgmtd calls it when nodes register, the placement simulator
(`bench/placement.py`) calls it for clusters of up to thousands of nodes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

MAX_PERMUTED = 6  # chains up to this long get the best head..tail order; longer ones a greedy one
# tables of up to this many new chains get the swap pass (`_even_out`): the
# greedy pass misses the balance only in small ones
MAX_EVENED = 40
MAX_PASSES = 20


def plan_chains(
    free: Mapping[int, Sequence[int]],
    replicas: int,
    existing: Iterable[Sequence[int]] = (),
) -> list[list[int]]:
    """New chains from *free* targets (node id -> its free target ids), each
    of *replicas* targets on distinct nodes, head first, until fewer than
    *replicas* nodes have a free target left. *existing* lists the nodes of
    the chains already built (head first), so new chains even out what they
    left uneven. Deterministic: the same input gives the same table."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, not {replicas}")
    nodes = sorted(n for n, ts in free.items() if ts)
    if len(nodes) < replicas:
        return []
    index = {n: i for i, n in enumerate(nodes)}
    count = len(nodes)
    pairs = np.zeros((count, count), dtype=np.int64)
    positions = np.zeros((count, replicas), dtype=np.int64)
    for chain in existing:
        members = [index[n] for n in chain if n in index]
        for a, b in itertools.combinations(members, 2):
            pairs[a, b] += 1
            pairs[b, a] += 1
        for p, n in enumerate(chain[:replicas]):
            if n in index:
                positions[index[n], p] += 1
    left = np.asarray([len(free[n]) for n in nodes], dtype=np.int64)
    queues = [list(free[n]) for n in nodes]
    order = np.arange(count)
    load = positions.sum(axis=1)
    big = np.iinfo(np.int64).max // 4
    made: list[list[int]] = []
    while int((left > 0).sum()) >= replicas:
        chosen: list[int] = []
        shared = np.zeros(count, dtype=np.int64)  # chains each node shares with the chosen
        for _ in range(replicas):
            score = shared.copy()
            score[left == 0] = big
            score[chosen] = big
            # fewest chains shared with the chosen, then most free targets, then
            # fewest chains so far, then a rotating id (no node always wins ties)
            rotated = (order - len(made) * 7919) % count
            pick = int(np.lexsort((rotated, load, -left, score))[0])
            chosen.append(pick)
            shared += pairs[pick]
        chosen = _in_position_order(chosen, positions)
        for a, b in itertools.combinations(chosen, 2):
            pairs[a, b] += 1
            pairs[b, a] += 1
        for p, n in enumerate(chosen):
            load[n] += 1
            positions[n, p] += 1
            left[n] -= 1
        made.append(chosen)
    if len(made) <= MAX_EVENED:
        _even_out(made, pairs.tolist())
    return [[queues[n].pop(0) for n in chain] for chain in made]


def _even_out(chains: list[list[int]], pairs: list[list[int]]) -> None:
    """Swap members between the new *chains* (node indexes) while that
    lowers the sum of squared pair counts. The greedy pass ends with few
    nodes left to choose from and may have to put the same pairs together
    again; a few swaps undo that. A member keeps its slot, so the swap moves
    a node to another chain's position (a small cost to position balance)."""
    for _ in range(MAX_PASSES):
        improved = False
        for x, y in itertools.combinations(range(len(chains)), 2):
            xs, ys = chains[x], chains[y]
            for i, a in enumerate(xs):
                if a in ys:
                    continue
                for j, c in enumerate(ys):
                    if c in xs:
                        continue
                    change: dict[tuple[int, int], int] = {}
                    for m in xs:
                        if m != a:
                            change[(a, m)] = change.get((a, m), 0) - 1
                            change[(c, m)] = change.get((c, m), 0) + 1
                    for m in ys:
                        if m != c:
                            change[(c, m)] = change.get((c, m), 0) - 1
                            change[(a, m)] = change.get((a, m), 0) + 1
                    if sum(2 * pairs[u][v] * d + d * d for (u, v), d in change.items()) >= 0:
                        continue
                    for (u, v), d in change.items():
                        pairs[u][v] += d
                        pairs[v][u] += d
                    xs[i], ys[j] = c, a
                    a = c
                    improved = True
                    break
        if not improved:
            return


def _in_position_order(chosen: list[int], positions: np.ndarray) -> list[int]:
    """*chosen* ordered head to tail so each node takes the position it has
    held least often (resync reads from the last serving member: a balanced
    order spreads a dead node's recovery reads over its partners)."""
    if len(chosen) <= MAX_PERMUTED:
        best = min(
            itertools.permutations(chosen),
            key=lambda perm: (sum(int(positions[n, p]) for p, n in enumerate(perm)), perm),
        )
        return list(best)
    out: list[int] = []
    rest = list(chosen)
    for p in range(len(chosen)):
        n = min(rest, key=lambda m: (int(positions[m, p]), m))
        out.append(n)
        rest.remove(n)
    return out


def pair_counts(chains: Iterable[Sequence[int]]) -> dict[tuple[int, int], int]:
    """How many chains each pair of nodes shares (chains given as node lists)."""
    out: dict[tuple[int, int], int] = {}
    for chain in chains:
        for a, b in itertools.combinations(sorted(set(chain)), 2):
            out[(a, b)] = out.get((a, b), 0) + 1
    return out
