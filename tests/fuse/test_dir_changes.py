"""`DirChanges` (fuse/handler_guards.py): which creates may leave their
directory's attributes for its next getattr. Only a mutation of the same
directory (or one that may change any: rename, rmdir) spoils them."""

from __future__ import annotations

from shufflefs.fuse.handler_guards import CHANGED_DIRS, DirChanges
from shufflefs.metadata.protocol import Attr

ATTR: Attr = {"ino": 5}  # type: ignore[typeddict-item]


def test_a_create_in_another_directory_does_not_spoil_it() -> None:
    d = DirChanges()
    d.begin((5,))  # our create in 5
    stamp = d.stamp(5)
    d.begin((6,))  # creates in 6 start and end meanwhile
    d.end((6,))
    assert d.alone(5, stamp)
    d.replied[5] = (ATTR, 1.0)  # what our create left
    d.end((5,))
    d.begin((6,))
    d.end((6,))
    assert 5 in d.replied
    d.begin((5,))  # the next mutation of 5 drops them
    assert 5 not in d.replied


def test_a_mutation_of_the_same_directory_spoils_it() -> None:
    d = DirChanges()
    d.begin((5,))
    stamp = d.stamp(5)
    d.begin((5,))  # an unlink in 5, begun and ended meanwhile
    d.end((5,))
    assert not d.alone(5, stamp)
    d.begin((5,))  # one still in flight when we end
    assert not d.alone(5, stamp)


def test_a_rename_anywhere_spoils_every_directory() -> None:
    assert "rename" not in CHANGED_DIRS and "rmdir" not in CHANGED_DIRS
    d = DirChanges()
    d.replied[7] = (ATTR, 1.0)
    d.begin((5,))
    stamp = d.stamp(5)
    d.begin(None)
    assert d.replied == {}
    d.end(None)
    assert not d.alone(5, stamp)


def test_counters_live_only_while_a_directory_has_a_mutation_in_flight() -> None:
    d = DirChanges()
    for ino in range(1000):
        d.begin((ino, ino + 1))
        d.end((ino, ino + 1))
    assert d._changes == {} and d._busy == {}
