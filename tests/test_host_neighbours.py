"""benchmarks/host_neighbours.py's placement of neighbour processes: beside the engine's core on its SMT
siblings, apart from it on other physical cores, or anywhere but the engine's CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import host_neighbours  # noqa: E402


def test_neighbours_are_placed_beside_or_apart_from_the_engine_core(monkeypatch) -> None:
    # CPUs 0 and 8 share a physical core (a 16-thread host's usual numbering).
    monkeypatch.setattr(host_neighbours, "smt_siblings", lambda cpu: {cpu, (cpu + 8) % 16})
    cpus = list(range(16))
    assert host_neighbours.placement("spin:8", 0, cpus) == list(range(1, 16))
    assert host_neighbours.placement("spin:1@sibling", 0, cpus) == [8]
    assert host_neighbours.placement("stream:7:64@apart", 0, cpus) == [c for c in range(1, 16) if c != 8]
    assert host_neighbours.neighbour_code("spin:7@apart")[0] == 7
    with pytest.raises(ValueError, match="unknown placement"):
        host_neighbours.placement("spin:1@elsewhere", 0, cpus)
    with pytest.raises(SystemExit, match="no such CPU"):
        host_neighbours.placement("spin:1@sibling", 0, [0, 1])  # CPU 8 is not ours


def test_smt_siblings_reads_the_kernel_topology_list() -> None:
    siblings = host_neighbours.smt_siblings(0)
    assert 0 in siblings and all(isinstance(c, int) for c in siblings)
