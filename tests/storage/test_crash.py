"""Crash consistency: a writer process is SIGKILLed at random moments; after
each kill every chunk must match its checksums and equal either the state the
writer had acknowledged or the state after the operation in flight, never a
mix (the in-flight operation is all-or-nothing across the chunks it touches).
An update that was staged but not committed (or was being aborted) when the
kill landed must never become visible."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import crcmod.predefined
import pytest
from clusters import wait_until

from shufflefs.storage.layout import parse_chunk_file_name
from shufflefs.storage.protocol import chunk_id
from shufflefs.storage.store import ChunkStore

WRITER = Path(__file__).with_name("crash_writer.py")
CHUNK = 1 << 15
BLOCK = 512
INOS = (1, 2)
CHUNKS_PER_INO = 2
ROUNDS = 6
CIDS = [chunk_id(ino, idx) for ino in INOS for idx in range(CHUNKS_PER_INO)]

reference = crcmod.predefined.mkCrcFun("crc-32c")
Model = dict[bytes, bytes]

pytestmark = pytest.mark.e2e  # starts and kills writer processes


def data_for(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def apply(model: Model, op: list[str]) -> Model:
    out = dict(model)
    if op[0] == "R":
        ino, idx, n, seed = map(int, op[1:])
        out[chunk_id(ino, idx)] = data_for(seed, n)
    elif op[0] == "W":
        ino, idx, offset, n, seed = map(int, op[1:])
        cid = chunk_id(ino, idx)
        old = bytearray(out[cid])
        if offset > len(old):
            old.extend(bytes(offset - len(old)))
        old[offset : offset + n] = data_for(seed, n)
        out[cid] = bytes(old)
    else:
        ino, size = int(op[1]), int(op[2])
        for idx in range(CHUNKS_PER_INO):
            cid = chunk_id(ino, idx)
            out[cid] = out[cid][: max(0, size - idx * CHUNK)]
    return out


def replay(log: Path, model: Model) -> tuple[Model, list[str] | None, str, int]:
    """Apply the acknowledged operations; return the model, the operation in
    flight (begun, not acknowledged), how far it got (``begun``; for a staged
    one ``staged``, ``committing`` or ``aborting``) and how many operations
    were acknowledged. An aborted operation changes nothing."""
    pending: list[str] | None = None
    phase = "begun"
    acked = 0
    if not log.exists():
        return model, None, phase, 0
    for line in log.read_text().splitlines():
        parts = line.split()
        if parts[0] == "B":
            pending, phase = parts[2:], "begun"
        elif parts[0] in ("P", "C", "X"):
            phase = {"P": "staged", "C": "committing", "X": "aborting"}[parts[0]]
        elif parts[0] == "A":
            assert pending is not None
            if phase != "aborting":
                model = apply(model, pending)
            pending = None
            acked += 1
    return model, pending, phase, acked


def observe(target: Path, fsync: bool, cids: list[bytes] = CIDS) -> Model:
    """Open the target (running recovery) and check everything it holds
    (*cids*: every chunk the writer may have written)."""
    with ChunkStore(target, block_size=BLOCK, fsync=fsync, reserve_bytes=0) as store:
        state: Model = {}
        committed_files = set()
        for cid in cids:
            path = store.file_path(cid)
            if path is None:
                assert store.read(cid, 0, CHUNK).nbytes == 0
                state[cid] = b""
                continue
            committed_files.add(os.path.basename(path))
            info = store.chunk_info(cid)
            data = bytes(store.read(cid, 0, CHUNK))  # verifies every block's CRC
            assert len(data) == info["length"]
            want = b"".join(
                reference(data[i : i + BLOCK]).to_bytes(4, "big")
                for i in range(0, len(data), BLOCK)
            )
            assert info["crcs"] == want, f"stored checksums disagree with the bytes of {cid.hex()}"
            state[cid] = data
        on_disk = {p.name for p in (target / "chunks").rglob("*") if p.is_file()}
        assert all(parse_chunk_file_name(n) for n in on_disk)
        assert on_disk == committed_files, "stray generation files survived recovery"
        stats = store.stats()
        assert stats["chunks"] == len(committed_files)
        assert stats["used"] == sum(len(v) for v in state.values())
        return state


def kill_writer(args: list[str], log: Path, ready: bytes | None, after: float) -> None:
    """Start crash_writer.py with *args*, SIGKILL it *after* seconds (counted
    from its log's line *ready*, if given)."""
    proc = subprocess.Popen([sys.executable, str(WRITER), *args])

    def started() -> bool:
        assert proc.poll() is None, "writer died on its own"
        return ready is not None and log.exists() and log.read_bytes().startswith(ready)

    try:
        if ready is not None:
            wait_until("the writer to start", started, 30)
        time.sleep(after)  # the random moment of the kill
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "writer stopped before the kill"


@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "no-fsync"])
def test_sigkill_at_random_moments_never_half_applies(tmp_path: Path, fsync: bool) -> None:
    """fsync=false gives up durability across power loss, not across a
    process crash: the kernel still has every byte that was written."""
    rng = random.Random(20240601 + fsync)
    target = tmp_path / "target"
    model: Model = {cid: b"" for cid in CIDS}
    total_acked = in_flight = applied = held = 0
    for rnd in range(ROUNDS):
        log = tmp_path / f"writer-{rnd}.log"
        args = [str(target), str(log), str(rnd * 7919 + 1), str(fsync)]
        if rnd % 4 == 3:  # sometimes kill early: during startup recovery
            kill_writer(args, log, None, rng.uniform(0.0, 0.6))
        else:
            kill_writer(args, log, b"READY", rng.uniform(0.05, 0.6))
        acked_model, pending, phase, acked = replay(log, model)
        total_acked += acked
        state = observe(target, fsync)
        if pending is None:
            assert state == acked_model, f"round {rnd}: state differs from the acknowledged one"
        elif phase in ("staged", "aborting"):  # durable on disk, never committed
            held += 1
            assert state == acked_model, (
                f"round {rnd}: {pending}, staged and not committed ({phase}), became visible"
            )
        else:
            in_flight += 1
            after = apply(acked_model, pending)
            if state == after:
                applied += 1
            else:
                assert state == acked_model, (
                    f"round {rnd}: in-flight {pending} was half applied: "
                    + ", ".join(
                        f"{cid.hex()}: got {len(state[cid])}B before {len(acked_model[cid])}B "
                        f"after {len(after[cid])}B"
                        for cid in CIDS
                        if state[cid] != acked_model[cid]
                    )
                )
        model = state
    assert total_acked > 0, "the writer never got an operation acknowledged"
    print(
        f"acked={total_acked} kills_in_flight={in_flight} in_flight_applied={applied} "
        f"kills_while_staged={held}"
    )


@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "no-fsync"])
def test_sigkill_with_staged_updates_shows_none_of_them(tmp_path: Path, fsync: bool) -> None:
    """Staged updates of every kind (append in place, copy-on-write, whole
    chunk, new chunk) are on disk when the writer is killed: after recovery
    each chunk is exactly as committed, and nothing of them is left."""
    target = tmp_path / "target"
    log = tmp_path / "hold.log"
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(target), str(log), "1", str(fsync), "hold"]
    )
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and b"HELD" in log.read_bytes()):
            assert proc.poll() is None, "writer died on its own"
            assert time.monotonic() < deadline, "writer did not stage its updates"
            time.sleep(0.01)
        staged_bytes = sum(p.stat().st_size for p in (target / "chunks").rglob("*") if p.is_file())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    committed = {
        chunk_id(1, 0): data_for(1, 5000),
        chunk_id(1, 1): data_for(11, 3000),
        chunk_id(2, 0): data_for(2, 5000),
        chunk_id(2, 1): data_for(12, 3000),
    }
    assert staged_bytes > sum(len(v) for v in committed.values())  # they were on disk
    assert observe(target, fsync) == committed


WORKERS = 6  # as crash_writer.py's batched mode
BATCHED = {w: [chunk_id(100 + w, idx) for idx in range(CHUNKS_PER_INO)] for w in range(WORKERS)}


def replay_workers(log: Path, model: Model) -> tuple[Model, dict[str, list[str]], int, int]:
    """`replay` for the batched writer: each task's acknowledged writes
    applied; the write each task had in flight; the writes acknowledged; how
    many of them shared a worker-thread call with another (steps - batches
    at the last acknowledgement, 0 if none)."""
    pending: dict[str, list[str]] = {}
    acked = shared = 0
    for line in log.read_text().splitlines() if log.exists() else []:
        parts = line.split()
        task = parts[1].split(".")[0] if len(parts) > 1 else ""
        if parts[0] == "B":
            pending[task] = parts[2:]
        elif parts[0] == "A":
            model = apply(model, pending.pop(task))
            acked += 1
            shared = int(parts[3]) - int(parts[2])
    return model, pending, acked, shared


def test_sigkill_under_batched_writers_never_half_applies(tmp_path: Path) -> None:
    """Six tasks of one process write through one update queue (their steps
    batched into shared thread calls, flush passes and transactions), killed
    at random moments: every chunk is as its task had it acknowledged, or
    with the write in flight applied whole; nothing staged is left."""
    rng = random.Random(20261205)
    target = tmp_path / "target"
    cids = [cid for chunks in BATCHED.values() for cid in chunks]
    model: Model = {cid: b"" for cid in cids}
    total_acked = total_shared = applied = 0
    for rnd in range(4):
        log = tmp_path / f"batched-{rnd}.log"
        args = [str(target), str(log), str(rnd + 1), "True", "batched"]
        kill_writer(args, log, b"READY", rng.uniform(0.2, 0.8))
        acked_model, pending, acked, shared = replay_workers(log, model)
        total_acked += acked
        total_shared += shared
        state = observe(target, True, cids)
        for task, chunks in BATCHED.items():
            mine = {cid: state[cid] for cid in chunks}
            before = {cid: acked_model[cid] for cid in chunks}
            op = pending.get(str(task))
            if mine == before:
                continue
            assert op is not None, f"round {rnd}: task {task}'s chunks differ from the acknowledged"
            after = apply(acked_model, op)
            assert mine == {cid: after[cid] for cid in chunks}, (
                f"round {rnd}: task {task}'s write in flight {op} was half applied"
            )
            applied += 1
        model = state
    assert total_acked > 0, "the writer never got a write acknowledged"
    assert total_shared > 0, "no two steps ever shared a thread call"
    print(f"acked={total_acked} shared={total_shared} in_flight_applied={applied}")
