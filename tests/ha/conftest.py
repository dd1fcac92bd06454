"""HA masters on a real etcd: each test gets its own etcd and masters on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.testing.etcd import EtcdCluster


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    with EtcdCluster(tmp_path / "etcd", size=1) as cluster:
        yield cluster
