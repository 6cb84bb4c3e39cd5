"""`shufflefs_cache_lookups_total`: the record and fd caches' hits and misses.

A lookup is counted as a plain int under the lock the cache takes anyway. A
Prometheus counter per lookup (a call, a lock and a float add of its own,
twice per page-cache read) was a fifth of `ChunkStore.read_nowait`, the
daemon's whole work for a 4 KiB read. The counts are summed when the
endpoint is scraped, by a collector in the process-wide registry; a cache
that goes away first adds its counts to the retired totals, so the counter
never goes back.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

KINDS = ("record", "fd")


class LookupCounts:
    """One cache's hits and misses (incremented under that cache's lock)."""

    __slots__ = ("hits", "kind", "misses")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.hits = 0
        self.misses = 0

    @classmethod
    def of(cls, cache: object, kind: str) -> LookupCounts:
        """New counts for *cache*, summed by the collector while it lives."""
        counts = cls(kind)
        with _lock:
            _live.add(counts)
        weakref.finalize(cache, _retire, counts)
        return counts


_lock = threading.Lock()
_live: set[LookupCounts] = set()
_retired = {kind: LookupCounts(kind) for kind in KINDS}


def _retire(counts: LookupCounts) -> None:
    with _lock:
        _live.discard(counts)
        total = _retired[counts.kind]
        total.hits += counts.hits
        total.misses += counts.misses


def totals() -> dict[tuple[str, str], int]:
    """(cache, result) -> lookups so far in this process."""
    with _lock:
        every = [*_live, *_retired.values()]
    out = {(kind, result): 0 for kind in KINDS for result in ("hit", "miss")}
    for counts in every:
        out[counts.kind, "hit"] += counts.hits
        out[counts.kind, "miss"] += counts.misses
    return out


class _Lookups(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "shufflefs_cache_lookups",
            "Lookups in the chunk-record and open-file caches, by cache and result (hit or miss)",
            labels=["cache", "result"],
        )
        for (kind, result), n in totals().items():
            family.add_metric([kind, result], n)
        yield family


REGISTRY.register(_Lookups())
