"""Which replica of a chain serves a read: load- and locality-aware, avoiding
replicas that failed lately, and otherwise always the same one per chunk.

Every replica of a chain holds the same committed bytes, so a read may go to
any serving one. We prefer the one with the fewest of our requests in flight,
counting a replica on another host as a little busier (a local one is cheaper
to reach, and may be read straight from its chunk file), and avoid for a few
seconds one that failed us. A replica that looked dead is reported to mgmtd,
which checks for itself and takes a dead node out of its chains at once
rather than after the heartbeat timeout.

Among replicas that are equally good, a chunk goes to its *home* replica: one
chosen by a hash of the chunk id over the chain's serving targets in chain
order, the same in every process of every client. A chunk read again (the
next epoch, another DataLoader worker, another training node) then finds its
bytes in the page cache of the host that served it last time, and its chunk
file open there: the replicas' hosts cache different chunks instead of each
caching whatever the reads happened to ask it for, so the cluster's page
caches add up (three replicas' hosts hold three times as much of a dataset
warm). Load still comes first: a home replica busier than another is passed
over, and reads of many chunks still spread over all the replicas (different
chunks, different homes).
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Sequence

import trio

from shufflefs.client.layout import Piece
from shufflefs.cluster.protocol import TargetInfo
from shufflefs.cluster.routing import Routing, RoutingCache
from shufflefs.rpc.addresses import hostname
from shufflefs.rpc.errors import FsError
from shufflefs.rpc.retry import TRANSIENT

log = logging.getLogger("shufflefs.client.replicas")

SUSPECT_SECONDS = 5.0  # how long a replica that failed is avoided
REMOTE_PENALTY = 2  # a replica on another host counts as this many requests busier
SPREAD_THRESHOLD = 8  # pieces of one chain in a batch from which they go to every replica
REPORT_INTERVAL = 2.0  # at most one unreachable-report per node per interval

Placed = tuple[Piece, int]  # a piece and the target chosen to read it from


def home_of(chunk: bytes, n: int) -> int:
    """*chunk*'s home: a position among its chain's *n* serving targets, the
    same in every process of every client."""
    return zlib.crc32(chunk) % n


def positions(targets: list[TargetInfo]) -> dict[int, int]:
    """Target id -> its position in the chain."""
    return {t["id"]: i for i, t in enumerate(targets)}


class InFlight(dict[int, int]):
    """Requests in flight per target id (0 when absent). Changed with `add`,
    under a lock: the reply threads of the channel reads
    (client/channel_reads.py) count down beside the event loop."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __missing__(self, key: int) -> int:
        return 0

    def add(self, target: int, n: int) -> None:
        with self._lock:
            self[target] = self.get(target, 0) + n


class Replicas:
    def __init__(self, routing: RoutingCache) -> None:
        self.routing = routing
        self.outstanding = InFlight()  # target id -> requests in flight
        self.suspect: dict[int, float] = {}  # target id -> avoid until (monotonic)
        self.background: trio.Nursery | None = None  # set by the owner, for reports
        self.host = hostname()
        self._local: tuple[int, frozenset[int]] = (-1, frozenset())
        self._reported: dict[int, float] = {}  # node id -> when we last reported it
        self._salt = random.randrange(1 << 30)
        # serving replicas per chain of one routing snapshot (immutable), so a
        # read does not rebuild the list; reset when the snapshot changes
        self._serving: tuple[Routing | None, dict[int, list[TargetInfo]]] = (None, {})

    def serving(self, routing: Routing, chain: int) -> list[TargetInfo]:
        """`routing.serving_targets(chain)`, memoized per snapshot (do not modify)."""
        snapshot, memo = self._serving
        if snapshot is not routing:
            memo = {}
            self._serving = (routing, memo)
        targets = memo.get(chain)
        if targets is None:
            targets = memo[chain] = routing.serving_targets(chain)
        return targets

    def local_targets(self, routing: Routing) -> frozenset[int]:
        """Targets on this host (cached per routing version)."""
        if self._local[0] != routing.version:
            hosts = {n["id"]: n["host"] for n in routing.nodes.values()}
            mine = frozenset(
                t for t, info in routing.targets.items() if hosts.get(info["node"]) == self.host
            )
            self._local = (routing.version, mine)
        return self._local[1]

    def pick(
        self,
        routing: Routing,
        chain: int,
        avoid: set[int] | frozenset[int] = frozenset(),
        chunk: bytes | None = None,
    ) -> TargetInfo:
        """The serving replica with the fewest of our requests in flight,
        counting a replica on another host as REMOTE_PENALTY requests busier,
        and preferring replicas that have not failed lately; among equals,
        *chunk*'s home replica (without a chunk: one that depends on this
        process, so readers spread)."""
        targets = self.serving(routing, chain)
        if not targets:
            raise FsError(errno.ENXIO, f"chain {chain} has no serving target")
        if len(targets) == 1 and not self.suspect:
            return targets[0]
        now = time.monotonic()
        suspect = self.suspect
        healthy = [t for t in targets if t["id"] not in avoid and suspect.get(t["id"], 0) <= now]
        untried = healthy or [t for t in targets if t["id"] not in avoid] or targets
        local = self.local_targets(routing)
        outstanding = self.outstanding
        if chunk is None:  # ties go to a replica that depends on this process
            salt = self._salt

            def tie(t: TargetInfo) -> int:
                return (t["id"] + salt) % 7919

        else:  # ties go to the chunk's home, then the next ones in chain order
            home, order = home_of(chunk, len(targets)), positions(targets)

            def tie(t: TargetInfo) -> int:
                return (order[t["id"]] - home) % len(targets)

        return min(
            untried,
            key=lambda t: (
                outstanding[t["id"]] + (0 if t["id"] in local else REMOTE_PENALTY),
                tie(t),
            ),
        )

    def equal_replicas(
        self, routing: Routing, chain: int, avoid: set[int] | frozenset[int]
    ) -> list[TargetInfo]:
        """The replicas as good as the best one (same locality, not failing),
        in an order that differs between processes (so readers spread)."""
        best = self.pick(routing, chain, avoid)
        local = self.local_targets(routing)
        now = time.monotonic()
        same = [
            t
            for t in routing.serving_targets(chain)
            if t["id"] not in avoid
            and self.suspect.get(t["id"], 0) <= now
            and (t["id"] in local) == (best["id"] in local)
        ] or [best]
        k = self._salt % len(same)
        return same[k:] + same[:k]

    def assign(
        self, routing: Routing, pieces: Sequence[Piece], avoid: dict[int, set[int]] | None = None
    ) -> dict[str, list[Placed]]:
        """Group pieces per storage node address. A chain with few pieces in
        the batch gets one replica (one request); one with many has its pieces
        dealt round robin over the equally good replicas, so a big batch keeps
        every replica's disk busy instead of one."""
        if len(pieces) == 1:  # one piece (a lone 4 KiB read): one replica, no grouping
            piece = pieces[0]
            t = self.pick(routing, piece[0], avoid[piece[0]] if avoid else frozenset(), piece[1])
            return {routing.target_address(t["id"]): [(piece, t["id"])]}
        per_chain: dict[int, list[Piece]] = defaultdict(list)
        for piece in pieces:
            per_chain[piece[0]].append(piece)
        groups: dict[str, list[Placed]] = defaultdict(list)
        for chain, chain_pieces in per_chain.items():
            skip: set[int] | frozenset[int] = avoid[chain] if avoid else frozenset()
            if len(chain_pieces) >= SPREAD_THRESHOLD:
                choices = self.equal_replicas(routing, chain, skip)
            else:
                best = self.pick(routing, chain, skip, chain_pieces[0][1])
                choices = [best]
                if len(chain_pieces) > 1 and best["id"] in self.local_targets(routing):
                    # on this host several replicas cost no more requests than
                    # one: each piece to its home among those as little loaded
                    load = self.outstanding[best["id"]]
                    equal = self.equal_replicas(routing, chain, skip)
                    choices = [t for t in equal if self.outstanding[t["id"]] <= load] or choices
            places = [(routing.target_address(t["id"]), t["id"]) for t in choices]
            if len(places) == 1:
                address, tid = places[0]
                groups[address].extend((p, tid) for p in chain_pieces)
                continue
            # each piece to its chunk's home, or the first of these after it
            # in chain order (as `pick` ranks them): a batch spreads over them
            # all, and a chunk is read from the same one every time
            serving = self.serving(routing, chain)
            n, order = len(serving), positions(serving)
            by_home = [min(places, key=lambda p: (order[p[1]] - h) % n) for h in range(n)]
            for piece in chain_pieces:
                address, tid = by_home[home_of(piece[1], n)]
                groups[address].append((piece, tid))
        return groups

    def failed(self, routing: Routing, target_id: int, exc: FsError) -> None:
        """A replica failed us: avoid it for a while; if it looked dead, tell
        mgmtd (which checks for itself before taking it out)."""
        self.suspect[target_id] = time.monotonic() + SUSPECT_SECONDS
        if exc.code not in TRANSIENT or exc.code in (errno.ESTALE, errno.ENXIO):
            return
        try:
            node = routing.node_of_target(target_id)["id"]
        except FsError:
            return
        now = time.monotonic()
        if self.background is None or now - self._reported.get(node, -1e9) < REPORT_INTERVAL:
            return
        self._reported[node] = now
        self.background.start_soon(self._report, node)

    async def _report(self, node: int) -> None:
        try:
            if await self.routing.mgmtd.report_unreachable(0, node):
                log.warning("storage node %d reported unreachable; mgmtd took it out", node)
                await self.routing.refresh()
        except FsError as exc:
            log.info("reporting node %d unreachable failed: %s", node, exc.message)
