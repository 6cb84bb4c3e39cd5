"""Test hosts: the network-namespace hosts of `shufflefs.cluster.netns`
(one implementation, shared with ``shufflefs bench --remote``), under the
names the tests use."""

from __future__ import annotations

from shufflefs.cluster.netns import Hosts as TestHosts
from shufflefs.cluster.netns import namespaces_available

__all__ = ["TestHosts", "namespaces_available"]
