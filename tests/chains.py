"""The in-process cluster's old import name: it lives in clusters.py now.
Kept so that tests written against `from chains import ...` keep working."""

from clusters import CS, SECRET, ChainCluster, Node, eventually

__all__ = ["CS", "SECRET", "ChainCluster", "Node", "eventually"]
