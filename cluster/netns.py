"""Hosts on one machine: Linux network namespaces joined by a bridge.

A "host" is a network namespace with its own loopback, its own address and
one veth link to a bridge in the root namespace, which has the subnet's
first address (mgmtd and the metadata server listen there). Storage daemons
on such hosts and a reader on another one are the real deployment's shape:
every read crosses a link, and no reader can open a storage host's chunk
files as its own (their node reports another host name).

Cutting a host takes its link down: its packets are dropped, nobody gets a
reset, so to the cluster it looks like a dead node (heartbeats stop,
connections hang until their timeouts), not like a clean shutdown. Capping a
host's link (`tc` token bucket, both directions) makes the link, not the
shared CPU, the limit of what the host serves.

Only the namespaces, links and bridge this module creates are touched; their
subnet is chosen among 10.200-249.x.0/24 ranges that no route of this
machine uses. Everything is removed by `destroy()`. Used by the test suite
(tests/hosts.py) and by ``shufflefs bench --remote``.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import subprocess
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"  # where `ip netns add` pins the namespaces it names


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def tc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=True)


def namespaces_available() -> str | None:
    """None if we can create network namespaces here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"sfs-probe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"ip netns add failed: {getattr(exc, 'stderr', exc)}"
    ip("netns", "del", probe, check=False)
    return None


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0-10.249.255.0 that overlaps no route of this machine."""
    used = []
    for line in ip("-4", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0]
        if dest[0].isdigit():
            try:
                used.append(ipaddress.ip_network(dest, strict=False))
            except ValueError:
                continue
    seed = os.getpid()
    for k in range(50 * 256):
        n = (seed + k) % (50 * 256)
        net = ipaddress.IPv4Network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.200-249.x.0/24 subnet")


def enter_command(netns: str | None) -> list[str]:
    """The argv prefix that runs a command on host *netns* (none: here).

    `nsenter --net` enters the network namespace only and execs the command
    in the same process (so a recorded pid is the command's own), and keeps
    the mount namespace: a FUSE mount made there is seen by every process
    (`ip netns exec` would hide it in a private mount namespace)."""
    return ["nsenter", f"--net={NETNS_DIR}/{netns}", "--"] if netns else []


def enter(netns: str) -> None:
    """Move the calling thread, and the threads it starts from now on, onto
    host *netns*: a process calls it first thing, before any thread or socket."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"{NETNS_DIR}/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns to {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Hosts:
    """`count` hosts h1..hN (namespaces) on a bridge; the root namespace is .1."""

    count: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    subnet: ipaddress.IPv4Network = field(default_factory=free_subnet)
    created: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"sfsbr{self.tag}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (mgmtd, meta)."""
        return str(self.subnet.network_address + 1)

    def netns(self, i: int) -> str:
        return f"sfs{self.tag}h{i}"

    def veth(self, i: int) -> str:
        return f"sfs{self.tag}v{i}"

    def address(self, i: int) -> str:
        return str(self.subnet.network_address + 10 + i)

    def names(self) -> list[str]:
        """The namespaces and links of these hosts that exist now."""
        mine = [self.netns(i) for i in range(1, self.count + 1)]
        listed = ip("netns", "list", check=False).stdout.split()
        links = ip("-o", "link", "show", check=False).stdout
        present = [n for n in mine if n in listed]
        for name in (self.bridge, *(self.veth(i) for i in range(1, self.count + 1))):
            if f": {name}:" in links or f": {name}@" in links:
                present.append(name)
        return present

    def create(self) -> None:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            self.created.append(f"link:{self.bridge}")
            ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i in range(1, self.count + 1):
                self._add_host(i)
        except BaseException:
            self.destroy()
            raise

    def _add_host(self, i: int) -> None:
        ns, veth = self.netns(i), self.veth(i)
        ip("netns", "add", ns)
        self.created.append(f"netns:{ns}")
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.created.append(f"link:{veth}")
        ip("link", "set", veth, "master", self.bridge)
        ip("link", "set", veth, "up")
        prefix = self.subnet.prefixlen
        ip("-n", ns, "addr", "add", f"{self.address(i)}/{prefix}", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")

    def cap(self, i: int, bytes_per_second: int) -> None:
        """Cap host i's link at *bytes_per_second* each way (a token bucket
        on its end of the veth for what it sends, on the bridge's end for
        what it receives). The queues go with the links in `destroy()`."""
        rate = f"{bytes_per_second * 8}bit"
        # a burst of ~4 ms at the rate (at least 64 KiB: one GSO segment) and
        # 50 ms of queue: smooth enough to measure, short enough not to bloat
        burst = str(max(64 << 10, bytes_per_second // 250))
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", "50ms"]
        tc("-n", self.netns(i), "qdisc", "replace", "dev", "eth0", *tbf)
        tc("qdisc", "replace", "dev", self.veth(i), *tbf)

    def cut(self, i: int) -> None:
        """Take host i off the network (its packets are dropped silently)."""
        ip("link", "set", self.veth(i), "down")

    def restore(self, i: int) -> None:
        ip("link", "set", self.veth(i), "up")

    def destroy(self) -> None:
        for item in reversed(self.created):
            kind, name = item.split(":", 1)
            if kind == "netns":
                ip("netns", "del", name, check=False)
            else:
                ip("link", "del", name, check=False)
        self.created.clear()
