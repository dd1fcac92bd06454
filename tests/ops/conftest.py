from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ops.helpers import StandInMaster


@pytest.fixture
def master() -> Iterator[StandInMaster]:
    with StandInMaster() as m:
        yield m
