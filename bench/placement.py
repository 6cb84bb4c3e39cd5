"""Placement simulator: the chain table mgmtd would build for clusters past
this machine, and what it means when a node dies or nodes are added.

    .venv/bin/python bench/placement.py                       # the table
    .venv/bin/python bench/placement.py --plot docs/placement.png --json

For each cluster shape (nodes x targets per node, 3 replicas) it builds the
chain table with the real builder (`shufflefs.cluster.placement`), then:

* kills each node in turn and counts its recovery fan-out: the distinct
  nodes its chains resync from (a returning or replacement node resyncs each
  chain from the chain's last serving member, as the storage daemons do);
* estimates the time to re-replicate the node: its targets resync in
  parallel, one disk each, from distinct source disks, so the time is the
  larger of one target's data over the per-disk rate and the most any one
  source node sends over its network link;
* reports the balance of the table (chains per pair of nodes, chains per
  node) and of used space (files stripe over all chains);
* adds 10 % more nodes and reports the data moved (the builder makes new
  chains from the new targets and leaves existing chains alone) and the used
  space spread that leaves until new files even it out.

Node capacity is fixed (`--node-tb` across its targets), so more targets per
node means less data per target and more partners to recover from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass

from shufflefs.cluster.placement import pair_counts, plan_chains

REPLICAS = 3
SCALE = 10_000  # target ids of the simulated nodes: node * SCALE + k


@dataclass
class Row:
    nodes: int
    targets_per_node: int
    chains: int
    pair_min: int
    pair_max: int
    chains_per_node_min: int
    chains_per_node_max: int
    fanout_min: int
    fanout_median: float
    recovery_hours: float
    grow_nodes: int
    grow_moved_tb: float
    spares: int  # targets left out of the table (fewer than `replicas` nodes had one left)


def table(nodes: int, per_node: int, first_node: int = 0) -> dict[int, list[int]]:
    """node -> its target ids (target id = node * SCALE + k)."""
    ids = range(first_node, first_node + nodes)
    return {n: [n * SCALE + k for k in range(per_node)] for n in ids}


def simulate(
    nodes: int, per_node: int, node_tb: float, fill: float, disk_mb_s: float, nic_gb_s: float
) -> Row:
    free = table(nodes, per_node)
    chains = [[t // SCALE for t in c] for c in plan_chains(free, REPLICAS)]
    pairs = pair_counts(chains)
    every_pair = nodes * (nodes - 1) // 2
    pair_values = list(pairs.values()) + [0] * (every_pair - len(pairs))
    per_node_chains = Counter({n: 0 for n in free})
    per_node_chains.update(n for c in chains for n in c)
    target_tb = node_tb * fill / per_node  # data on one target
    by_node: dict[int, list[list[int]]] = {}
    for c in chains:
        for n in c:
            by_node.setdefault(n, []).append(c)
    fanouts, hours = [], []
    for victim, mine in by_node.items():
        sources = Counter([m for m in c if m != victim][-1] for c in mine)
        fanouts.append(len(sources))
        disk_s = target_tb * 1e6 / disk_mb_s
        nic_s = max(sources.values()) * target_tb * 1e3 / nic_gb_s
        hours.append(max(disk_s, nic_s) / 3600)
    grow = max(REPLICAS, nodes // 10)
    new = table(grow, per_node, first_node=nodes)
    new_chains = plan_chains(new, REPLICAS, chains)
    # existing chains keep their members: nothing is copied; the new targets
    # start empty and fill as new files stripe over old and new chains alike
    assert all(n >= nodes for c in new_chains for n in (t // SCALE for t in c))
    moved = 0.0
    return Row(
        nodes=nodes,
        targets_per_node=per_node,
        chains=len(chains),
        pair_min=min(pair_values) if pair_values else 0,
        pair_max=max(pair_values) if pair_values else 0,
        chains_per_node_min=min(per_node_chains.values()),
        chains_per_node_max=max(per_node_chains.values()),
        fanout_min=min(fanouts),
        fanout_median=statistics.median(fanouts),
        recovery_hours=round(statistics.median(hours), 2),
        grow_nodes=grow,
        grow_moved_tb=moved,
        spares=nodes * per_node - REPLICAS * len(chains),
    )


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    head = (
        f"Chain tables for {REPLICAS} replicas, {args.node_tb:g} TB per node at "
        f"{args.fill:.0%} full, {args.disk_mb_s:g} MB/s per disk, {args.nic_gb_s:g} GB/s per "
        "node link.\n\n"
        "| nodes | targets/node | chains | chains per node pair | chains per node | "
        "recovery fan-out (min / median nodes) | time to re-replicate a node | "
        "+10 % nodes: data moved | spare targets |\n"
        "|---:|---:|---:|---|---|---|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.nodes} | {r.targets_per_node} | {r.chains} | {r.pair_min}-{r.pair_max} | "
        f"{r.chains_per_node_min}-{r.chains_per_node_max} | {r.fanout_min} / "
        f"{r.fanout_median:g} | {r.recovery_hours:g} h | {r.grow_moved_tb:g} TB "
        f"(+{r.grow_nodes} nodes) | {r.spares} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for per_node in sorted({r.targets_per_node for r in rows}):
        mine = [r for r in rows if r.targets_per_node == per_node]
        xs = [r.nodes for r in mine]
        left.plot(xs, [r.fanout_median for r in mine], marker="o", label=f"{per_node}/node")
        right.plot(xs, [r.recovery_hours for r in mine], marker="o", label=f"{per_node}/node")
    for ax, title in ((left, "recovery fan-out (nodes)"), (right, "hours to re-replicate")):
        ax.set_xscale("log")
        ax.set_xlabel("storage nodes")
        ax.set_title(title)
        ax.legend(title="targets")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="10,30,100,300,1000", help="cluster sizes, comma separated")
    p.add_argument("--targets", default="1,4,16", help="targets per node, comma separated")
    p.add_argument("--node-tb", type=float, default=60.0, help="raw capacity of one node, TB")
    p.add_argument("--fill", type=float, default=0.6, help="fraction of capacity in use")
    p.add_argument("--disk-mb-s", type=float, default=500.0, help="resync rate of one disk")
    p.add_argument("--nic-gb-s", type=float, default=12.5, help="one node's link rate, GB/s")
    p.add_argument("--plot", help="write a PNG of fan-out and recovery time here")
    p.add_argument("--json", action="store_true", help="print one JSON object with `rows`")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.nodes.split(",")]
        per_nodes = [int(x) for x in args.targets.split(",")]
    except ValueError:
        p.error("--nodes and --targets take comma-separated integers")
    if min(sizes) < REPLICAS or not 1 <= min(per_nodes) <= max(per_nodes) < SCALE:
        p.error(f"need nodes >= {REPLICAS} and 1 <= targets < {SCALE}")
    if not 0 < args.fill <= 1:
        p.error("need 0 < fill <= 1")
    rows = [
        simulate(n, t, args.node_tb, args.fill, args.disk_mb_s, args.nic_gb_s)
        for t in per_nodes
        for n in sizes
    ]
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        json.dump({"rows": [asdict(r) for r in rows]}, sys.stdout)
        print()
    else:
        print(markdown(rows, args), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
