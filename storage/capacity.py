"""`CapacityFigures`: what this node's heartbeats tell mgmtd about its targets.

statvfs may block on a busy disk, so the figures are measured in a worker
thread every `USAGE_INTERVAL` seconds and the agent reads the last ones on
the event loop.
"""

from __future__ import annotations

import logging

import trio

from shufflefs.cluster.protocol import TargetRegistration, TargetUsage
from shufflefs.storage.context import NodeContext

log = logging.getLogger("shufflefs.storage.capacity")

USAGE_INTERVAL = 1.0  # seconds between refreshes of the capacity figures heartbeats carry


class CapacityFigures:
    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self._usage: dict[str, tuple[int, int]] = {}  # store path -> (capacity, free)

    def _measure(self) -> dict[str, tuple[int, int]]:
        return {str(s.path): s.capacity() for s in list(self.node.stores)}

    async def refresh(self) -> None:
        self._usage = await self.node.io(self._measure)

    async def run(self, interval: float = USAGE_INTERVAL) -> None:
        """Refresh every *interval* seconds, until cancelled."""
        while True:
            await trio.sleep(interval)
            try:
                await self.refresh()
            except OSError as exc:
                log.warning("measuring target capacity failed: %s", exc)

    def registrations(self) -> list[TargetRegistration]:
        """This node's targets, in the order of `stores` (statvfs figures from
        the last refresh)."""
        out: list[TargetRegistration] = []
        for s in self.node.stores:
            cap, free = self._usage.get(str(s.path), (0, 0))
            out.append(
                {
                    "target_id": s.target_id,
                    "path": str(s.path),
                    "capacity": cap,
                    "free": free,
                    "device": s.device,
                }
            )
        return out

    def usage(self) -> list[TargetUsage]:
        out: list[TargetUsage] = []
        for s in self.node.stores:
            if s.target_id is None:
                continue
            cap, free = self._usage.get(str(s.path), (0, 0))
            out.append(
                {
                    "target_id": s.target_id,
                    "capacity": cap,
                    "free": free,
                    "used": s.used,
                    "chunks": s.chunks,
                    "device": s.device,
                }
            )
        return out
