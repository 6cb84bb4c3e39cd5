"""`shufflefs scrub`: verify every chunk of every target, repair what is damaged.

Walks every target of every online storage node, a page of chunks per call
(`StorageStub.scrub`): the storage daemon verifies every block of each chunk
against its CRC-32C, repairs damaged chunks from a healthy replica, and
compares its copy with the chain's head, repairing it where it diverges. A
progress bar goes to stderr when it is a terminal; the totals go to stdout
(``--json``: one object). The exit code is 1 if damage remains that no
replica could repair (or a target could not be scrubbed), else 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from shufflefs.cluster.admin import with_mgmtd
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.rpc.client import RpcClient
from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import StorageStub

log = logging.getLogger("shufflefs.scrub")

PAGE = 64  # chunks per scrub call: a page of 1 MiB chunks is verified in well under a second
CALL_TIMEOUT = 120.0  # a page may include repairs (copies from another replica)
BAR_WIDTH = 30


@dataclass
class Totals:
    chunks_checked: int = 0
    corrupt_found: int = 0
    divergent_found: int = 0
    repaired: int = 0
    unrecoverable: int = 0
    targets: int = 0
    errors: list[str] = field(default_factory=list)

    def as_json(self, seconds: float) -> dict[str, Any]:
        return {
            "chunks_checked": self.chunks_checked,
            "corrupt_found": self.corrupt_found,
            "divergent_found": self.divergent_found,
            "repaired": self.repaired,
            "unrecoverable": self.unrecoverable,
            "targets": self.targets,
            "errors": self.errors,
            "seconds": round(seconds, 3),
        }


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = max(total, 1)
        self.out = out
        self.enabled = out.isatty()
        self.drawn = False

    def show(self, done: int, what: str) -> None:
        if not self.enabled:
            return
        frac = min(1.0, done / self.total)
        filled = int(frac * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        self.out.write(f"\rscrub [{bar}] {done}/{self.total} chunks  {what:<24}")
        self.out.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.out.write("\n")
            self.out.flush()


async def scrub_cluster(mgmtd: MgmtdStub, rpc: RpcClient, progress_out: TextIO) -> Totals:
    """Scrub every target of every online storage node, one after another."""
    status = await mgmtd.status()
    online = {
        n["id"]: n["address"]
        for n in status["nodes"]
        if n["kind"] == "storage" and n["state"] == "online"
    }
    targets = [t for t in status["targets"] if t["node"] in online]
    totals = Totals()
    progress = Progress(sum(t["chunks"] for t in targets), progress_out)
    try:
        for t in targets:
            stub = StorageStub(rpc, online[t["node"]], timeout=CALL_TIMEOUT)
            after: bytes | None = None
            totals.targets += 1
            try:
                while True:
                    result = await stub.scrub(t["id"], after, PAGE)
                    totals.chunks_checked += result["checked"]
                    totals.corrupt_found += result["corrupt"]
                    totals.divergent_found += result["divergent"]
                    totals.repaired += result["repaired"]
                    totals.unrecoverable += result["unrecoverable"]
                    progress.show(totals.chunks_checked, f"target {t['id']}")
                    after = result["next"]
                    if after is None:
                        break
            except FsError as exc:
                totals.errors.append(f"target {t['id']}: {exc.message}")
                log.warning("scrub of target=%d failed: %s", t["id"], exc.message)
    finally:
        progress.close()
    return totals


def cli_scrub(args: argparse.Namespace) -> int:
    """``shufflefs scrub [--config FILE] [--json]``."""
    started = time.monotonic()

    async def run(mgmtd: MgmtdStub, rpc: RpcClient) -> Totals:
        return await scrub_cluster(mgmtd, rpc, sys.stderr)

    totals = with_mgmtd(args, run)
    seconds = time.monotonic() - started
    if args.json:
        print(json.dumps(totals.as_json(seconds)))
    else:
        print(
            f"scrubbed {totals.chunks_checked} chunks on {totals.targets} targets in "
            f"{seconds:.1f}s: {totals.corrupt_found} corrupt, {totals.divergent_found} divergent, "
            f"{totals.repaired} repaired, {totals.unrecoverable} unrecoverable"
        )
        for error in totals.errors:
            print(f"  {error}")
    return 1 if totals.unrecoverable or totals.errors else 0
