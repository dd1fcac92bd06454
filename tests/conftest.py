"""Suite-wide settings: which tests share one worker when the suite runs in parallel.

The README's test command runs pytest with two workers (``-n 2 --dist loadgroup`` in
``pyproject.toml``): much of the suite waits on sockets, timeouts and child processes
rather than on the CPU.  The tests that start many processes or whole stacks -- real
vLLM, the multi-host namespaces, the soak, the benchmarks' runs -- are one group and run
one after another on one worker, as they would alone: two of them at once on 2 cores
would each take twice as long and crowd their bounds.  The other worker takes the rest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HEAVY = ("bench", "e2e", "multihost", "soak")
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(item.path).relative_to(_TESTS).parts
        if parts and parts[0] in _HEAVY:
            item.add_marker(pytest.mark.xdist_group("heavy"))
