"""The record and fd caches count their lookups (`shufflefs_cache_lookups_total`),
also after a cache is gone."""

from __future__ import annotations

import gc
import os

from prometheus_client import REGISTRY

from shufflefs.storage.cache import MISSING, FdCache, RecordCache


def scraped() -> dict[tuple[str, str], float]:
    out = {}
    for metric in REGISTRY.collect():
        if metric.name == "shufflefs_cache_lookups":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["cache"], sample.labels["result"]] = sample.value
    return out


def delta(before: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    now = scraped()
    return {key: now[key] - before.get(key, 0) for key in now if now[key] != before.get(key, 0)}


def test_lookups_are_counted_and_survive_their_cache() -> None:
    before = scraped()
    records: RecordCache[bytes, int] = RecordCache(4)
    records.set(b"a", 1)
    records.set(b"gone", MISSING)
    assert records.get(b"a") == 1
    assert records.get(b"gone") is MISSING  # known absent: a hit
    assert records.get(b"b") is None
    fds: FdCache[str] = FdCache(4)
    assert fds.get("x") is None
    handle = fds.put("x", os.open("/dev/null", os.O_RDONLY), fds.epoch)
    fds.release(handle)
    again = fds.get("x")
    assert again is handle
    fds.release(again)
    want = {("record", "hit"): 2, ("record", "miss"): 1, ("fd", "hit"): 1, ("fd", "miss"): 1}
    assert delta(before) == want
    fds.close_all()
    del records, fds, handle, again
    gc.collect()
    assert delta(before) == want  # a counter never goes back
