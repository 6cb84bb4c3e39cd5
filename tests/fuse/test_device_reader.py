"""The worker that waits at the FUSE device keeps it through requests
answered at once, hands it over when a handler may wait, and every worker
ends with the session (fuse/device_reader.py).

A pipe stands in for the device (one byte a request: readable when one
waits, POLLHUP when the writer closes it, as the device reports POLLERR
once unmounted) and `worker` for pyfuse3's worker loop, which calls the
replaced `_wait_fuse_readable` the same way: wait, receive one request,
handle it (awaiting its handler if it has one), again."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable

import pytest
import trio

from shufflefs.fuse import device_reader
from shufflefs.fuse.device_reader import DeviceReader

WORKERS = 4


class Device:
    """The pipe, the reader of its read end, and what the workers did."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self.exited = False
        self.reader = DeviceReader(self.r, lambda: self.exited)
        self.taken: list[tuple[int, bytes]] = []  # (worker, request) as received
        self.gate = trio.Event()  # what the waiting handlers wait for
        self.ended = 0

    def send(self, requests: bytes) -> None:
        os.write(self.w, requests)

    async def worker(self, k: int) -> None:
        while await self.reader.wait_readable():
            req = os.read(self.r, 1)
            if not req:  # (the writer is gone: receive ends the worker, as libfuse's does)
                break
            self.taken.append((k, req))
            if req == b"s":  # a handler that may wait, as ShuffleOps' say so
                self.reader.hand_over()
                await self.gate.wait()
            elif req == b"q":  # one that waits without saying so
                await self.gate.wait()
        self.ended += 1

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            await trio.sleep(0.005)


@pytest.fixture
async def device() -> AsyncIterator[Device]:
    dev = Device()
    try:
        yield dev
    finally:
        os.close(dev.r)
        if dev.w >= 0:
            os.close(dev.w)


async def test_requests_answered_at_once_keep_one_worker_at_the_device(device: Device) -> None:
    """Twenty requests that need no waiting, one after another: the same
    worker takes every one; no other worker ever left its parking."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for k in range(WORKERS):
                nursery.start_soon(device.worker, k)
            for i in range(20):
                device.send(b"f")
                await device.until(lambda i=i: len(device.taken) == i + 1)
            assert {k for k, _ in device.taken} == {device.taken[0][0]}
            device.exited = True
            device.send(b"f")
            await device.until(lambda: len(device.taken) == 21)
            nursery.cancel_scope.cancel()


async def next_request_while_the_first_waits(device: Device, first: bytes) -> None:
    """*first*, whose handler waits, then one more: taken by another worker
    while the first handler still waits."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for k in range(WORKERS):
                nursery.start_soon(device.worker, k)
            device.send(first)
            await device.until(lambda: len(device.taken) == 1)
            device.send(b"f")
            await device.until(lambda: len(device.taken) == 2)
            assert not device.gate.is_set()
            assert device.taken[0][0] != device.taken[1][0]
            device.gate.set()
            nursery.cancel_scope.cancel()


async def test_a_handler_that_may_wait_hands_the_device_over(
    device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose handler waits (and says so first): the next request
    is taken by another worker, long before a parked worker would look by
    itself."""
    monkeypatch.setattr(device_reader, "PARK_CHECK", 3600.0)
    await next_request_while_the_first_waits(device, b"s")


async def test_a_handler_waiting_unannounced_holds_the_device_one_park_check_at_most(
    device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that waits without handing over: a parked worker finds the
    device unwatched at its next look and takes the next request."""
    monkeypatch.setattr(device_reader, "PARK_CHECK", 0.05)
    await next_request_while_the_first_waits(device, b"q")


async def test_every_worker_ends_when_the_device_goes(
    device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unmounted (the device reports an error; here the pipe's writer
    closes): the worker at the device ends on its receive and the parked
    ones at once, not at their next look."""
    monkeypatch.setattr(device_reader, "PARK_CHECK", 3600.0)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for k in range(WORKERS):
                nursery.start_soon(device.worker, k)
            device.send(b"ff")
            await device.until(lambda: len(device.taken) == 2)
            os.close(device.w)
            device.w = -1
    assert device.ended == WORKERS


async def test_every_worker_ends_when_the_session_has_exited(
    device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session exited (pyfuse3.terminate): the next worker to look ends
    and takes the parked ones with it."""
    monkeypatch.setattr(device_reader, "PARK_CHECK", 0.05)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for k in range(WORKERS):
                nursery.start_soon(device.worker, k)
            device.send(b"s")  # its worker waits in its handler, another takes the device
            await device.until(lambda: len(device.taken) == 1)
            device.exited = True
            device.send(b"f")  # taken; the worker then finds the session over
            await device.until(lambda: device.ended >= WORKERS - 1)
            device.gate.set()
    assert device.ended == WORKERS
