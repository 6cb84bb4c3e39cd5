"""Python's cyclic garbage collector, run less often in the services and the mount.

CPython collects reference cycles generation by generation: the youngest
after every 700 container objects allocated (net), and from time to time a
full collection that walks every object the process holds. Our processes
allocate a great many short-lived containers per request (frames of
coroutines, tuples, dicts decoded from msgpack) and hold many long-lived
ones (the modules and classes imported at start; a mount's open cache, its
prefetch queue and listings; a metadata server's handles and watches), so
collections were frequent, and the full ones grew with what the process
held. Measured on the mount serving four hinted readers of 8,000 cold
110 KB samples: 10% of the mount's CPU in the collector (`perf`:
``gc_collect_main``, ``visit_decref``, ``visit_reachable``); with the
settings here, none to see, and four alternated pairs of fresh mounts read
3-6% more samples per second (against one that had served reads for an hour: 8-32%).

What is done (`collect_less`, at a service's start):

* everything alive then (imports, configuration) is moved out of the
  collector's sight for good (``gc.freeze``): full collections no longer
  walk it. Those objects are still freed by reference counting; only a
  cycle among them would stay, and they live as long as the process anyway;
* the youngest generation is collected after `YOUNG` allocations instead of
  700 (an object that dies before then is never looked at by an older
  collection), the middle one after `MIDDLE` young collections, and a full
  collection waits for `OLD` middle ones (and, as always, for the objects
  promoted since the last full one to be a quarter of those that survived
  it).

The price: cyclic garbage (rare here: an exception kept with its traceback)
is found later, so up to `YOUNG` containers more may be waiting to be freed;
the mount's resident size did not change measurably.
"""

from __future__ import annotations

import gc

YOUNG = 50_000
MIDDLE = 50
OLD = 100


def collect_less() -> None:
    """Freeze what is alive now and raise the collection thresholds (see the
    module docstring). For long-running processes only: not for a user's
    process the native client runs in."""
    gc.collect()  # the garbage of start-up is not frozen with the rest
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, OLD)
