"""The hint sender of client/data/mount_hints.py, without a mount: batches
queued while one is being sent go out together, in order, and a directory
that cannot be listed does not stop the hints (the mount's side is in
tests/e2e/test_prefetch_mount.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from shufflefs.client.data import mount_hints
from shufflefs.client.data.mount_hints import MountHints, merged


def test_consecutive_jobs_of_one_kind_merge_in_order() -> None:
    jobs = [
        ("files", [(1, 0, 0)], False),
        ("files", [(2, 0, 0), (3, 0, 0)], False),
        ("ranges", [(4, 10, 5)], False),
        ("files", [(5, 0, 0)], False),
        ("files", [(6, 0, 0)], True),  # a warm epoch's probe: goes whole, not thinned
    ]
    assert merged(jobs) == [
        ("files", [(1, 0, 0), (2, 0, 0), (3, 0, 0)], False),
        ("ranges", [(4, 10, 5)], False),
        ("files", [(5, 0, 0)], False),
        ("files", [(6, 0, 0)], True),
    ]
    assert jobs[0] == ("files", [(1, 0, 0)], False)  # (the jobs themselves are left as they were)


def test_batches_queued_during_a_send_go_out_together(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"f{i}") for i in range(40)]
    hints = MountHints(str(tmp_path), paths, whole_files=True)
    sent: list[tuple[str, list[int]]] = []
    first_taken, go_on = threading.Event(), threading.Event()

    def send(kind: str, items: list[tuple[int, int, int]], probe: bool = False) -> None:
        sent.append((kind, [i for i, _, _ in items]))
        first_taken.set()
        assert go_on.wait(10)

    hints._send = send  # type: ignore[method-assign]
    hints.files([0])
    assert first_taken.wait(10)  # the thread is in the first send
    for lo in range(1, 40, 3):
        hints.files(range(lo, min(lo + 3, 40)))  # the reader goes on: nothing waits
    go_on.set()
    hints.flush()
    hints.close()
    assert sent == [("files", [0]), ("files", list(range(1, 40)))]


def test_a_directory_that_cannot_be_listed_does_not_stop_the_hints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "big"
    big.mkdir()
    for i in range(10):
        (big / f"f{i}").write_bytes(b"")
    paths = [str(tmp_path / "gone" / "a"), str(big / "f0")]
    hints = MountHints(str(tmp_path), paths, whole_files=True)
    monkeypatch.setattr(mount_hints, "LIST_MAX", 3)  # a huge directory: listed in part
    sent: list[list[int]] = []
    hints._send_files = lambda items, probe=False: sent.append(items)  # type: ignore[method-assign]
    hints.files([0, 1])
    hints.flush()
    hints.close()
    assert sent == [[0, 1]]
    assert hints._listed == {str(tmp_path / "gone"), str(big)}


def test_a_warm_epoch_sends_one_batch_in_a_few(tmp_path: Path) -> None:
    """Once the mount answered HELD (the kernel holds every hinted file) for
    HELD_STREAK getxattrs in a row, one in PROBE_EVERY goes; a probe it
    answers otherwise (a cold file again) brings every send back."""
    paths = [str(tmp_path / f"f{i}") for i in range(400)]
    hints = MountHints(str(tmp_path), paths, whole_files=True)
    hints.read_only = True  # (a read-only mount: hints go by getxattr names)
    answers = [mount_hints.HELD]
    sent: list[int] = []

    def get_all(names: list[str]) -> list[bytes]:
        sent.append(len(sent))
        return answers * len(names)

    hints._get_all = get_all  # type: ignore[method-assign]
    for i in range(mount_hints.HELD_STREAK + 2 * mount_hints.PROBE_EVERY):
        hints._send_files([i])
    assert len(sent) == mount_hints.HELD_STREAK + 2  # then two probes
    answers[0] = b"queued"
    for i in range(mount_hints.PROBE_EVERY):  # the next probe is answered "queued"
        hints._send_files([i])
    assert len(sent) == mount_hints.HELD_STREAK + 3
    for i in range(5):
        hints._send_files([i])
    assert len(sent) == mount_hints.HELD_STREAK + 8  # every send again


def test_a_large_send_in_a_warm_epoch_is_thinned_after_its_first_answers(
    tmp_path: Path,
) -> None:
    """A hint thread behind its loader merges many batches into one send:
    the streak is learned from the first NAMED_IN_FLIGHT getxattrs' answers,
    and the rest of the same send is thinned already."""
    paths = [str(tmp_path / f"f{i:04d}") for i in range(4000)]
    hints = MountHints(str(tmp_path), paths, whole_files=True)
    hints.read_only = True
    names: list[str] = []

    def get_all(wave: list[str]) -> list[bytes]:
        names.extend(wave)
        return [mount_hints.HELD] * len(wave)

    hints._get_all = get_all  # type: ignore[method-assign]
    hints._send_files(list(range(4000)))  # ~12 paths per name: ~340 names
    every = sum(n.count("\n") + 1 for n in names)  # files hinted
    first = mount_hints.NAMED_IN_FLIGHT
    assert len(names) < first + 4000 // 12 // mount_hints.PROBE_EVERY + 2, len(names)
    assert every < 4000 // 4  # not the whole epoch
    # the probes are spread over the send, not its start alone
    assert any("f39" in n for n in names[first:]), names[first:]


def test_a_warm_epoch_is_thinned_before_the_hint_thread(tmp_path: Path) -> None:
    """In a warm epoch the loader itself leaves out all but one batch in
    PROBE_EVERY (each hand-off wakes the hint thread), and the batch it lets
    through goes whole: probes stay one in PROBE_EVERY, not one in its
    square. A probe answered otherwise brings every batch back."""
    paths = [str(tmp_path / f"f{i:04d}") for i in range(4000)]
    hints = MountHints(str(tmp_path), paths, whole_files=True)
    hints.read_only = True
    answers = [mount_hints.HELD]
    names: list[str] = []
    handed: list[int] = []

    def get_all(wave: list[str]) -> list[bytes]:
        names.extend(wave)
        return answers * len(wave)

    hints._get_all = get_all  # type: ignore[method-assign]
    send = hints._send

    def counted(kind: str, items: list[tuple[int, int, int]], probe: bool = False) -> None:
        handed.append(len(items))
        send(kind, items, probe)

    hints._send = counted  # type: ignore[method-assign]
    for lo in range(0, 16 * mount_hints.HELD_STREAK, 16):
        hints.files(range(lo, lo + 16))
        hints.flush()  # (each answered before the next: the streak is learned)
    assert len(names) >= mount_hints.HELD_STREAK
    names.clear()
    handed.clear()
    batches = 8 * mount_hints.PROBE_EVERY
    for lo in range(1000, 1000 + 16 * batches, 16):
        hints.files(range(lo, lo + 16))
        hints.flush()
    assert sum(handed) == 16 * batches // mount_hints.PROBE_EVERY  # 8 batches handed over
    assert len(names) >= 8  # each of them sent (16 paths: at least one getxattr each)
    answers[0] = b"queued"  # a probe finds a cold file
    handed.clear()
    for lo in range(3000, 3000 + 16 * mount_hints.PROBE_EVERY * 2, 16):
        hints.files(range(lo, lo + 16))
        hints.flush()
    assert sum(handed) > 16 * mount_hints.PROBE_EVERY  # every batch again
    hints.close()
