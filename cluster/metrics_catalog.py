"""The process-wide Prometheus instruments outside the RPC layer.

Code that counts something imports its instrument from here, so every name
is declared (and documented, docs/metrics.md) in one place. RPC requests,
errors, latency and bytes per method are in `rpc.metrics`; gauges read from
live state (targets, chains, capacity) are collected when scraped
(`cluster.metrics_collectors`).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from shufflefs.rpc.metrics import LATENCY_BUCKETS

COMMIT_BATCH = Histogram(
    "shufflefs_meta_commit_batch_size",
    "Mutations per metadata group commit (one LMDB write transaction, one fsync)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
UPDATE_BATCH = Histogram(
    "shufflefs_storage_update_batch_size",
    "Update steps (stage, flush, commit) per worker-thread call of a target's update "
    "queue (one group flush and one record transaction for the batch)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
CACHE_WATCH_WAITS = Counter(
    "shufflefs_meta_cache_watch_waits",
    "Commits that waited for a client caching a changed file, by how the wait ended "
    "(acked: the client dropped it; lease: it did not answer within its lease; grace: "
    "a server that just began waited out what an earlier one granted)",
    ["result"],
)
CACHE_WATCH_WAIT_SECONDS = Histogram(
    "shufflefs_meta_cache_watch_wait_seconds",
    "Time a commit's callers waited for the clients caching the files it changed",
    buckets=LATENCY_BUCKETS,
)
OPEN_CACHE = Counter(
    "shufflefs_client_open_cache",
    "Read-only opens of a client with an open cache, by how each was answered (trusted: "
    "from the cache, no round trip; revalidated: from the cache after a getattr; opened: "
    "a round trip)",
    ["result"],
)
RESYNC_CHUNKS = Counter(
    "shufflefs_resync_chunks_copied", "Chunks copied to a syncing replica by resync"
)
RESYNC_BYTES = Counter(
    "shufflefs_resync_bytes_copied", "Bytes copied to a syncing replica by resync"
)
SCRUB_CHUNKS = Counter(
    "shufflefs_scrub_chunks_checked", "Chunks whose every block a scrub verified"
)
SCRUB_FOUND = Counter(
    "shufflefs_scrub_damage",
    "Damage a scrub found or mended, by kind (corrupt, divergent, repaired, unrecoverable)",
    ["kind"],
)

CLIENT_OPS = Counter(
    "shufflefs_client_ops", "Reads and writes of a mount or native client, by op", ["op"]
)
CLIENT_BYTES = Counter(
    "shufflefs_client_bytes", "Bytes read and written by a mount or native client", ["op"]
)
CLIENT_ERRORS = Counter(
    "shufflefs_client_errors", "Reads and writes of a client that failed, by op", ["op"]
)
CLIENT_LATENCY = Histogram(
    "shufflefs_client_latency_seconds",
    "Time of one read or write of a mount or native client",
    ["op"],
    buckets=LATENCY_BUCKETS,
)
