from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.datapath.segment_server import SegmentServer
from kvpool.datapath.shm import host_token
from kvpool.storage.segment import Segment

SEGMENT_SIZE = 32 << 20


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment.create(SEGMENT_SIZE)
    yield seg
    seg.close()


@pytest.fixture
def server(segment: Segment) -> Iterator[SegmentServer]:
    srv = SegmentServer(timeout_s=5.0, host_token=host_token())
    srv.add_segment("seg0", segment)
    srv.start()
    yield srv
    srv.close()
