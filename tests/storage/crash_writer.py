"""Run by test_crash.py in a subprocess: random writes to a ChunkStore until
SIGKILLed. Every operation is logged before it starts (``B seq ...``) and
after it returned (``A seq``), so the test knows which states were
acknowledged and which one was in flight when the kill landed."""

from __future__ import annotations

import errno
import os
import random
import sys

from shufflefs.rpc.errors import FsError
from shufflefs.storage.chunks import ChunkStore
from shufflefs.storage.protocol import chunk_id

CHUNK = 1 << 15
BLOCK = 512
INOS = (1, 2)
CHUNKS_PER_INO = 2


def data_for(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def main(target: str, log_path: str, seed: int, fsync: bool) -> None:
    rng = random.Random(seed)
    store = ChunkStore(target, block_size=BLOCK, fsync=fsync, reserve_bytes=0)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(log, b"READY\n")
    seq = 0
    while True:
        seq += 1
        ino = rng.choice(INOS)
        if rng.random() < 0.1:
            size = rng.randrange(0, CHUNKS_PER_INO * CHUNK + 1)
            os.write(log, f"B {seq} T {ino} {size}\n".encode())
            store.truncate_file(ino, size, CHUNK)
        else:
            idx = rng.randrange(CHUNKS_PER_INO)
            cid = chunk_id(ino, idx)
            try:
                length = store.chunk_info(cid)["length"]
            except FsError as exc:
                assert exc.errno == errno.ENOENT
                length = 0
            kind = rng.random()
            if kind < 0.4 and length < CHUNK:  # append at the end
                offset = length
            elif kind < 0.5 and length + 1 < CHUNK:  # append past the end: a gap
                offset = rng.randrange(length + 1, CHUNK)
            else:  # anywhere: mostly overwrites (copy-on-write)
                offset = rng.randrange(0, CHUNK)
            n = rng.randint(1, min(6000, CHUNK - offset))
            data_seed = rng.getrandbits(32)
            os.write(log, f"B {seq} W {ino} {idx} {offset} {n} {data_seed}\n".encode())
            store.write(cid, offset, CHUNK, data_for(data_seed, n))
        os.write(log, f"A {seq}\n".encode())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "True")
