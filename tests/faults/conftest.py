"""Fixtures of the fault tests (see faultcluster.py)."""

from faultcluster import fault_cluster

__all__ = ["fault_cluster"]
