"""Starting and stopping local service processes by pid file.

A pid is only ever signalled after checking, through /proc, that it still
belongs to the process we started (its command line names the same config
file), so a recycled pid is never killed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shufflefs.cluster.netns import enter_command
from shufflefs.rpc.errors import FsError


@dataclass(frozen=True)
class ServiceProcess:
    name: str  # e.g. "storage2"
    argv: tuple[str, ...]  # shufflefs subcommand and its arguments
    marker: str  # a string the command line must contain (the config path)
    pid_file: Path
    out_file: Path  # stdout/stderr of the process (tracebacks before logging starts)
    netns: str | None = None  # run inside this network namespace (test hosts)
    # another program than a shufflefs subcommand (etcd): its argv before *argv*
    program: tuple[str, ...] = ()

    def command(self) -> list[str]:
        if self.program:
            return [*enter_command(self.netns), *self.program, *self.argv]
        return [
            *enter_command(self.netns),
            sys.executable,
            "-m",
            "shufflefs.cluster.cli",
            *self.argv,
        ]


def argv(pid: int) -> list[str]:
    """The process's arguments ([] if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [os.fsdecode(a) for a in raw.split(b"\0")[:-1]]


def cmdline(pid: int) -> str:
    return " ".join(argv(pid))


def is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def running_pid(proc: ServiceProcess) -> int | None:
    """The pid of our live process, or None (stale pid files are removed)."""
    try:
        pid = int(proc.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    line = cmdline(pid)
    program = Path(proc.program[0]).name if proc.program else "shufflefs"
    if program in line and proc.marker in line and not is_zombie(pid):
        return pid
    with contextlib.suppress(OSError):
        proc.pid_file.unlink()
    return None


def start(proc: ServiceProcess, env: dict[str, str] | None = None) -> int:
    """Start detached (own session, survives the calling shell)."""
    proc.pid_file.parent.mkdir(parents=True, exist_ok=True)
    proc.out_file.parent.mkdir(parents=True, exist_ok=True)
    with open(proc.out_file, "ab") as out:
        child = subprocess.Popen(
            proc.command(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
    proc.pid_file.write_text(f"{child.pid}\n")
    # Until the child has exec'd, /proc shows our own command line; wait for
    # its own so that running_pid() recognizes it from now on.
    deadline = time.monotonic() + 10.0
    while proc.marker not in cmdline(child.pid) and time.monotonic() < deadline:
        if child.poll() is not None:
            break
        time.sleep(0.005)
    return child.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_zombie(pid)


def stop(proc: ServiceProcess, timeout: float = 10.0) -> bool:
    """SIGTERM, wait, then SIGKILL. Returns True if something was stopped."""
    pid = running_pid(proc)
    if pid is None:
        return False
    stop_pid(pid, timeout)
    with contextlib.suppress(OSError):
        proc.pid_file.unlink()
    return True


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL."""
    signal_pid(pid, signal.SIGTERM)
    if not wait_exit(pid, timeout):
        signal_pid(pid, signal.SIGKILL)
        wait_exit(pid, 5.0)


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        raise FsError(errno.EPERM, f"not allowed to signal pid {pid}") from exc


def wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # reap it if it is our child (tests start services directly)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])
