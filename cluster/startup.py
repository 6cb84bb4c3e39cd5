"""`up`'s start-up: start what is not running, watch it come up, and take
back everything it started if any of it does not.

A service that dies during start-up is noticed at once (its pid is watched
on every poll), not after a timeout; every wait has a deadline and names
what it was waiting for; a service's failure is reported with the last error
line it wrote and the file holding the rest. What was already running before
this `up` is left alone, so a failed `up` leaves the machine as it found it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from shufflefs.cluster import procs
from shufflefs.cluster.cli_errors import (
    AUTH,
    VERSION,
    StartFailed,
    connection_kind,
    explain_connection_error,
    innermost,
)
from shufflefs.cluster.config import load_client_config
from shufflefs.cluster.protocol import MgmtdStub
from shufflefs.cluster.routing import Routing
from shufflefs.metadata.stub import MetaStub
from shufflefs.rpc.client import RpcClient, open_rpc_client
from shufflefs.rpc.errors import FsError

if TYPE_CHECKING:
    from shufflefs.cluster.launcher import LocalCluster

START_TIMEOUT = 60.0
POLL = 0.1


class ServiceExited(FsError):
    """A service exited while we waited for it to come up."""

    def __init__(self, name: str, pid: int) -> None:
        self.name = name
        self.pid = pid
        super().__init__(errno.ECHILD, f"{name} (pid {pid}) exited during start-up")


class StartTimeout(FsError):
    """What we waited for did not happen before the deadline."""

    def __init__(self, timeout: float, waiting: str) -> None:
        super().__init__(errno.ETIMEDOUT, f"timed out after {timeout:g}s waiting for {waiting}")


def exit_status(pid: int) -> str:
    """'exit status 1' of our own child (reaping it), or '' if unknown."""
    try:
        reaped, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return ""
    if reaped == 0:
        return ""
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


Check = Callable[[RpcClient, MgmtdStub], Awaitable[str | None]]


async def wait_services_ready(cluster: LocalCluster, pids: dict[str, int], timeout: float) -> None:
    """Wait until mgmtd answers, every meta/storage process we know the pid of
    is registered and online, and the metadata server has seen the routing
    map that includes them (new files are laid out on the chains it knows).
    Raises StartTimeout naming what it waited for at the deadline, and as
    `_poll` does."""
    layout = cluster.layout()
    # HA: only the primary mgmtd registers; the standbys need only answer
    mgmtds = {n: p for n, p in pids.items() if layout.ha and n.startswith("mgmtd")}
    registering = {n: p for n, p in pids.items() if n not in mgmtds}

    async def missing(rpc: RpcClient, mgmtd: MgmtdStub) -> str | None:
        waiting = await _standbys_not_ready(rpc, layout.mgmtd_address if mgmtds else "")
        return waiting or await _not_ready(rpc, mgmtd, registering)

    waiting = await _poll(cluster, pids, timeout, missing)
    if waiting is not None:
        raise StartTimeout(timeout, waiting)


async def wait_writable(cluster: LocalCluster, pids: dict[str, int], timeout: float) -> str | None:
    """After the services are up: wait until new files can be laid out,
    that is until a storage chain has `min_replicas` serving replicas (a
    restarted target resyncs before it serves again, and until enough do
    the metadata server refuses creates with EROFS; it fetches the new map
    itself when one comes). Returns None once one has, else what is still
    missing at the deadline: the cluster is up all the same (a long resync
    is no failure), so the caller says so and stops nothing. Raises as
    `_poll` does."""

    async def missing(rpc: RpcClient, mgmtd: MgmtdStub) -> str | None:
        routing = Routing(await mgmtd.status())
        if not routing.chains or routing.writable_chains():
            return None
        return (
            f"a storage chain with {routing.config['min_replicas']} serving replicas (min_replicas)"
        )

    return await _poll(cluster, pids, timeout, missing)


async def _poll(
    cluster: LocalCluster, pids: dict[str, int], timeout: float, missing: Check
) -> str | None:
    """Ask *missing* what is still missing until it says nothing (None) or
    the deadline passes (what it said last). Raises ServiceExited as soon as
    one of *pids* dies, and `Unreachable` at once if mgmtd refuses our
    secret or speaks another protocol; any other error of a call is waited
    out."""
    _, secret = load_client_config(cluster.client_config)
    address = cluster.layout().mgmtd_address
    deadline = trio.current_time() + timeout
    async with open_rpc_client(secret, connect_timeout=1.0, call_timeout=2.0) as rpc:
        mgmtd = MgmtdStub(rpc, address)
        while True:
            for name, pid in pids.items():
                if not procs.alive(pid):
                    raise ServiceExited(name, pid)
            try:
                waiting = await missing(rpc, mgmtd)
            except FsError as exc:
                if connection_kind(exc, handshake=True) in (AUTH, VERSION):
                    raise explain_connection_error(exc, "mgmtd", address, handshake=True) from None
                waiting = f"mgmtd at {address} to answer (last error: {exc.message})"
            if waiting is None or trio.current_time() > deadline:
                return waiting
            await trio.sleep(POLL)


async def _standbys_not_ready(rpc: RpcClient, addresses: str) -> str | None:
    """The first of the mgmtd instances at *addresses* (``a,b``) that does
    not answer `role` yet, or None."""
    for address in filter(None, addresses.split(",")):
        try:
            await MgmtdStub(rpc, address, timeout=2.0).role()
        except FsError as exc:
            return f"mgmtd at {address} to answer (last error: {exc.message})"
    return None


async def _not_ready(rpc: RpcClient, mgmtd: MgmtdStub, pids: dict[str, int]) -> str | None:
    """What is still missing, or None."""
    status = await mgmtd.status()
    online = {n["pid"]: n for n in status["nodes"] if n["state"] == "online"}
    for name, pid in pids.items():
        if pid not in online:
            return f"{name} (pid {pid}) to register with mgmtd"
    metas = [n for n in online.values() if n["kind"] == "meta"]
    if len(metas) > 1 and not any(n.get("role") == "primary" for n in metas):
        return "the metadata servers to elect a primary"
    if metas and await MetaStub(rpc, metas[0]["address"]).routing_version() < status["version"]:
        return f"meta to learn routing version {status['version']}"
    return None


@dataclass
class Started:
    service: procs.ServiceProcess
    pid: int
    out_offset: int  # where this run's output starts in its files
    log_offset: int


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def new_lines(path: Path, offset: int) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


class Startup:
    """The processes one `up` started, so that a failure can take them back."""

    def __init__(self, cluster: LocalCluster, out: Any = sys.stdout) -> None:
        self.cluster = cluster
        self.out = out
        self.started: list[Started] = []

    def log_file(self, service: procs.ServiceProcess) -> Path:
        return self.cluster.logs / f"{service.name}.log"

    def ensure(self, service: procs.ServiceProcess) -> int:
        """The pid of *service*, started now if it is not running."""
        pid = procs.running_pid(service)
        if pid is not None:
            return pid
        out_offset = file_size(service.out_file)
        log_offset = file_size(self.log_file(service))
        pid = procs.start(service)
        self.started.append(Started(service, pid, out_offset, log_offset))
        print(f"started {service.name} (pid {pid})", file=self.out)
        return pid

    def last_error(self, name: str) -> tuple[str, Path]:
        """The last error line a service wrote since we started it, and the
        file it is in: its stderr (`.out`: what it printed as it gave up)
        first, else its log's last ERROR."""
        for s in self.started:
            if s.service.name != name:
                continue
            out = new_lines(s.service.out_file, s.out_offset)
            if out:
                return out[-1], s.service.out_file
            log = new_lines(self.log_file(s.service), s.log_offset)
            errors = [line for line in log if " ERROR " in line or " CRITICAL " in line]
            if errors or log:
                return (errors or log)[-1], self.log_file(s.service)
            return "it wrote nothing", s.service.out_file
        return "it was not started by this command", self.cluster.logs

    def abort(self, exc: BaseException) -> BaseException:
        """Stop what this start-up started; the one-line report of *exc*."""
        report = self.report(innermost(exc))
        self.rollback()
        return report

    def report(self, exc: BaseException) -> BaseException:
        if isinstance(exc, ServiceExited):
            line, where = self.last_error(exc.name)
            status = exit_status(exc.pid)
            how = f" ({status})" if status else ""
            return StartFailed(
                f"{exc.name} exited during start-up{how}: {line} (full log: {where})"
            )
        if isinstance(exc, StartTimeout):
            return StartFailed(f"{exc.message} (logs: {self.cluster.logs})")
        return exc

    def rollback(self) -> None:
        """Stop what this start-up started, newest first."""
        for s in reversed(self.started):
            with contextlib.suppress(FsError):
                if procs.stop(s.service):
                    print(f"stopped {s.service.name}", file=self.out)
            exit_status(s.pid)  # reap it
        self.started.clear()
