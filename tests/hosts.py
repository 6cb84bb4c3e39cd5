"""Test hosts: Linux network namespaces joined by a bridge.

Each storage daemon of a multi-host test runs on its own "host": a network
namespace with its own loopback, its own address and one veth link to a
bridge in the root namespace, where mgmtd, the metadata server and the
client run on the bridge's address. Cutting a host takes its link down: its
packets are dropped, nobody gets a reset, so to the cluster it looks like a
dead node (heartbeats stop, connections hang until their timeouts), not
like a clean shutdown.

Only the namespaces, links and the bridge this module creates are touched,
and their subnet is chosen among 10.200-249.x.0/24 ranges that no route of
this machine uses. Everything is removed by `destroy()`.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from dataclasses import dataclass, field


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


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
        net = ipaddress.ip_network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.200-249.x.0/24 subnet")


@dataclass
class TestHosts:
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
        """The root namespace's address on the bridge (mgmtd, meta, the client)."""
        return str(self.subnet.network_address + 1)

    def netns(self, i: int) -> str:
        return f"sfs{self.tag}h{i}"

    def veth(self, i: int) -> str:
        return f"sfs{self.tag}v{i}"

    def address(self, i: int) -> str:
        return str(self.subnet.network_address + 10 + i)

    def create(self) -> None:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            self.created.append(f"link:{self.bridge}")
            ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i in range(1, self.count + 1):
                ns, veth = self.netns(i), self.veth(i)
                ip("netns", "add", ns)
                self.created.append(f"netns:{ns}")
                ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self.created.append(f"link:{veth}")
                ip("link", "set", veth, "master", self.bridge)
                ip("link", "set", veth, "up")
                ip(
                    "-n",
                    ns,
                    "addr",
                    "add",
                    f"{self.address(i)}/{self.subnet.prefixlen}",
                    "dev",
                    "eth0",
                )
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise

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
