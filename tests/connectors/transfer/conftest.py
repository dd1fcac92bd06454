from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.connectors.transfer.worker import TransferWorker
from kvpool.testing.closes import closed_at_end
from kvpool.testing.mooncake import Namespace


@pytest.fixture
def workers() -> Iterator[list[TransferWorker]]:
    """The transfer workers a test started (it appends them), closed when it ends."""
    with closed_at_end(TransferWorker) as made:
        yield made


@pytest.fixture(scope="module")
def namespace() -> Iterator[Namespace]:
    """A private network namespace for the Transfer Engine (it binds every interface)."""
    with Namespace() as ns:
        yield ns
