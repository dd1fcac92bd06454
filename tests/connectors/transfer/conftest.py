from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.connectors.transfer.worker import TransferWorker
from kvpool.testing.closes import closed_at_end


@pytest.fixture
def workers() -> Iterator[list[TransferWorker]]:
    """The transfer workers a test started (it appends them), closed when it ends."""
    with closed_at_end(TransferWorker) as made:
        yield made
