"""The multi-host suite's fixtures: a fresh topology and cluster per scenario, and the
table of measured times (printed at the end, and written as JSON under pytest's tmp dir).

Hosts: ``master``, ``node1``, ``node2``, ``client``, each its own network namespace on a
bridge (:mod:`kvpool.testing.netns`).  Everything is root-only, as the whole suite is.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.testing.netns import Topology, remove_namespaces, run_prefix
from tests.multihost.pool import Cluster, start_cluster

HOSTS = ["master", "node1", "node2", "client"]
_TIMINGS: dict[str, dict[str, Any]] = {}
_TOPOLOGIES = itertools.count()


@pytest.fixture(scope="session")
def netns_prefix() -> Iterator[str]:
    """This session's namespace prefix; whatever is left under it at the end (a test
    that died halfway) is deleted."""
    prefix = run_prefix()
    yield prefix
    remove_namespaces(prefix)


@pytest.fixture
def topology(netns_prefix: str) -> Iterator[Topology]:
    with Topology(HOSTS, prefix=f"{netns_prefix}{next(_TOPOLOGIES)}-") as topo:
        yield topo


@pytest.fixture
def cluster(topology: Topology, tmp_path: Path) -> Cluster:
    return start_cluster(topology, tmp_path)


@pytest.fixture
def record(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``record(scenario, **numbers)``: keep a scenario's measured times."""
    out = tmp_path_factory.getbasetemp() / "multihost-timings.json"

    def keep(scenario: str, **numbers: Any) -> None:
        _TIMINGS[scenario] = numbers
        out.write_text(json.dumps(_TIMINGS, indent=2))
        print(f"\n[multihost] {scenario}: {json.dumps(numbers)}")

    return keep
