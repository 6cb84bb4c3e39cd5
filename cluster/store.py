"""mgmtd's persistence: the cluster state in LMDB, rewritten whole on change.

The state is small (a record per node, target and chain) and changes rarely
(registrations, failures), so one durable transaction holding the whole
record is simpler than per-record bookkeeping and can never be half-updated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import msgpack

STATE_KEY = b"cluster_state"
LEASES_KEY = b"leases"  # the embedded coordination's leases and their epochs


class MgmtdStore:
    def __init__(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=256 << 20, max_dbs=2, sync=True, subdir=True)

    def load(self) -> dict[str, Any] | None:
        with self.env.begin() as txn:
            raw = txn.get(STATE_KEY)
        return None if raw is None else msgpack.unpackb(raw, raw=False, strict_map_key=False)

    def save(self, record: dict[str, Any]) -> None:
        data = msgpack.packb(record, use_bin_type=True)
        with self.env.begin(write=True) as txn:
            txn.put(STATE_KEY, data)

    def load_leases(self) -> dict[str, Any]:
        with self.env.begin() as txn:
            raw = txn.get(LEASES_KEY)
        return {} if raw is None else msgpack.unpackb(raw, raw=False, strict_map_key=False)

    def save_leases(self, record: dict[str, Any]) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(LEASES_KEY, msgpack.packb(record, use_bin_type=True))

    def close(self) -> None:
        self.env.close()
