"""bench/placement.py: the simulator runs the real builder and its figures
follow from the table (more targets per node: more partners, faster recovery)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parents[2] / "bench" / "placement.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SIM), *args], capture_output=True, text=True)


def test_more_targets_per_node_recover_from_more_nodes_faster() -> None:
    done = run("--nodes", "12,60", "--targets", "1,4", "--json")
    assert done.returncode == 0, done.stderr
    rows = {(r["nodes"], r["targets_per_node"]): r for r in json.loads(done.stdout)["rows"]}
    for nodes in (12, 60):
        one, four = rows[(nodes, 1)], rows[(nodes, 4)]
        assert one["chains"] == nodes // 3 and four["chains"] == nodes * 4 // 3
        assert one["fanout_median"] == 1 and four["fanout_median"] >= 3
        assert four["recovery_hours"] == pytest.approx(one["recovery_hours"] / 4)
        assert four["pair_max"] <= 2 and four["grow_moved_tb"] == 0


@pytest.mark.parametrize("bad", [["--nodes", "2"], ["--targets", "x"], ["--fill", "0"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    done = run(*bad)
    assert done.returncode == 2 and "error" in done.stderr and "Traceback" not in done.stderr
