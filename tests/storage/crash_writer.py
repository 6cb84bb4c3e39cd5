"""Run by test_crash.py in a subprocess: random updates of a ChunkStore until
SIGKILLed. Every operation is logged before it starts (``B seq ...``) and
after it returned (``A seq``), so the test knows which states were
acknowledged and which one was in flight when the kill landed.

Some updates go in two steps, as on a chain replica: staged (``P seq`` once
`stage_write`/`stage_replace` returned: durable, not committed), held a
moment (the replica would be waiting for its successor), then either
committed (``C seq`` just before `commit`) or aborted (``X seq`` just before
`abort`). A kill between ``P`` and ``C``, or after ``X``, must leave no trace
of the update.

With the mode ``hold`` the writer stages one update of every kind, logs
``HELD`` and waits to be killed.

With the mode ``batched`` it runs `WORKERS` trio tasks writing through one
`UpdateQueue` (storage/update_queue.py), as the storage service does, so
that their steps share worker-thread calls, flush passes and record
transactions. Task *w* owns inode ``BATCHED_INO + w`` (no chunk is shared)
and tags its lines ``w.seq``; an acknowledgement also gives the queue's
batches and steps so far."""

from __future__ import annotations

import errno
import os
import random
import sys
import time
from functools import partial

import trio

from shufflefs.rpc.errors import FsError
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.store import ChunkStore
from shufflefs.storage.update_queue import UpdateQueue

CHUNK = 1 << 15
BLOCK = 512
INOS = (1, 2)
CHUNKS_PER_INO = 2
WORKERS = 6
BATCHED_INO = 100


def data_for(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def log_line(log: int, line: str) -> None:
    os.write(log, (line + "\n").encode())


def length_of(store: ChunkStore, ino: int, idx: int) -> tuple[int, int]:
    try:
        info = store.chunk_info(chunk_id(ino, idx))
    except FsError as exc:
        assert exc.errno == errno.ENOENT
        return 0, 0
    return info["length"], info["version"]


def pick_write(rng: random.Random, length: int) -> tuple[int, int]:
    kind = rng.random()
    if kind < 0.4 and length < CHUNK:  # append at the end
        offset = length
    elif kind < 0.5 and length + 1 < CHUNK:  # append past the end: a gap
        offset = rng.randrange(length + 1, CHUNK)
    else:  # anywhere: mostly overwrites (copy-on-write)
        offset = rng.randrange(0, CHUNK)
    return offset, rng.randint(1, min(6000, CHUNK - offset))


def staged_op(store: ChunkStore, log: int, rng: random.Random, seq: int, ino: int) -> None:
    idx = rng.randrange(CHUNKS_PER_INO)
    cid = chunk_id(ino, idx)
    length, version = length_of(store, ino, idx)
    seed = rng.getrandbits(32)
    if rng.random() < 0.3:
        n = rng.randint(0, CHUNK)
        log_line(log, f"B {seq} R {ino} {idx} {n} {seed}")
        staged = store.stage_replace(cid, data_for(seed, n), CHUNK, version + 1)
    else:
        offset, n = pick_write(rng, length)
        log_line(log, f"B {seq} W {ino} {idx} {offset} {n} {seed}")
        staged = store.stage_write(cid, offset, data_for(seed, n), CHUNK)
    log_line(log, f"P {seq}")
    time.sleep(rng.uniform(0, 0.02))  # waiting for the successor's answer
    if rng.random() < 0.3:
        log_line(log, f"X {seq}")
        store.abort(staged)
    else:
        log_line(log, f"C {seq}")
        store.commit(staged)


def hold(store: ChunkStore, log: int) -> None:
    """Stage an append, an overwrite, a new chunk and a whole-chunk replace
    (on chunks written and committed first), then wait for the kill."""
    for ino in INOS:
        store.write(chunk_id(ino, 0), 0, CHUNK, data_for(ino, 5000))
        store.write(chunk_id(ino, 1), 0, CHUNK, data_for(ino + 10, 3000))
    log_line(log, "COMMITTED")
    store.stage_write(chunk_id(1, 0), 5000, data_for(1, 4000), CHUNK)  # append in place
    store.stage_write(chunk_id(1, 1), 100, data_for(2, 900), CHUNK)  # copy-on-write
    store.stage_replace(chunk_id(2, 0), data_for(3, 7000), CHUNK, 2)  # whole chunk
    store.stage_write(chunk_id(2, 1), 3000, data_for(4, 10), CHUNK)  # append
    log_line(log, "HELD")
    while True:
        time.sleep(1)


def batched(store: ChunkStore, log: int, seed: int) -> None:
    queue = UpdateQueue(store, trio.to_thread.run_sync)

    async def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        ino = BATCHED_INO + w
        seq = 0
        while True:
            seq += 1
            idx = rng.randrange(CHUNKS_PER_INO)
            cid = chunk_id(ino, idx)
            length, _ = length_of(store, ino, idx)
            offset, n = pick_write(rng, length)
            data_seed = rng.getrandbits(32)
            log_line(log, f"B {w}.{seq} W {ino} {idx} {offset} {n} {data_seed}")
            stage = partial(
                store.stage_write, cid, offset, data_for(data_seed, n), CHUNK, None, False
            )
            if rng.random() < 0.5:
                await queue.write(cid, stage)
            else:  # as a chain replica: stage and flush (while forwarding), commit
                staged = await queue.stage_durably(cid, stage)
                await queue.commit(staged)
            log_line(log, f"A {w}.{seq} {queue.batches} {queue.steps}")

    async def run() -> None:
        log_line(log, "READY")
        async with trio.open_nursery() as nursery:
            for w in range(WORKERS):
                nursery.start_soon(worker, w)

    trio.run(run)


def main(target: str, log_path: str, seed: int, fsync: bool, mode: str) -> None:
    rng = random.Random(seed)
    store = ChunkStore(target, block_size=BLOCK, fsync=fsync, reserve_bytes=0)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if mode == "hold":
        hold(store, log)
    if mode == "batched":
        batched(store, log, seed)
    log_line(log, "READY")
    seq = 0
    while True:
        seq += 1
        ino = rng.choice(INOS)
        roll = rng.random()
        if roll < 0.1:
            size = rng.randrange(0, CHUNKS_PER_INO * CHUNK + 1)
            log_line(log, f"B {seq} T {ino} {size}")
            store.truncate_file(ino, size, CHUNK)
        elif roll < 0.45:
            staged_op(store, log, rng, seq, ino)
        else:
            idx = rng.randrange(CHUNKS_PER_INO)
            length, _ = length_of(store, ino, idx)
            offset, n = pick_write(rng, length)
            data_seed = rng.getrandbits(32)
            log_line(log, f"B {seq} W {ino} {idx} {offset} {n} {data_seed}")
            store.write(chunk_id(ino, idx), offset, CHUNK, data_for(data_seed, n))
        log_line(log, f"A {seq}")


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        sys.argv[4] == "True",
        sys.argv[5] if len(sys.argv) > 5 else "random",
    )
