"""Suite-wide settings: how the suite is spread over pytest-xdist's workers.

The README's test command runs pytest with two workers (``-n 2`` in ``pyproject.toml``):
much of the suite waits on sockets, timeouts and child processes rather than on the CPU.
Work is handed out a test module at a time (each module's fixtures are made once), except
that the tests which start many processes or whole stacks -- real vLLM, the multi-host
namespaces, the soak, the benchmarks' runs -- are one unit, run one after another on one
worker as they would alone: two of them at once on 2 cores would each take twice as long
and crowd their bounds.  The other worker takes the rest meanwhile.

(``--dist loadgroup`` with ``xdist_group`` marks would say the same, but xdist 3.8 groups
by rewriting node ids, which pytest 9 no longer reads: its groups are silently ignored.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest

HEAVY = ("bench", "e2e", "multihost", "soak")  # folders under tests/


def unit_of(nodeid: str, module_unit: str) -> str:
    """The unit of work of a test: ``"heavy"`` for a test under one of :data:`HEAVY`,
    else its module's unit."""
    parts = nodeid.split("/", 2)
    return "heavy" if len(parts) == 3 and parts[0] == "tests" and parts[1] in HEAVY else module_unit


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, super()._split_scope(nodeid))

    return Scheduling(config, log)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The multi-host scenarios' measured times (tests/multihost's ``record``).  Here, not
    in tests/multihost/conftest.py: under xdist this process collects nothing, so a
    folder's conftest is never loaded in it.  Each worker wrote its file under its own
    basetemp, a folder of this one (one process: the file is in this one)."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    timings: dict[str, Any] = {}
    for pattern in ("multihost-timings.json", "*/multihost-timings.json"):
        for path in sorted(base.glob(pattern)):
            timings.update(json.loads(path.read_text()))
    if timings:
        terminalreporter.section("multi-host: time to detect and to recover (s)")
        for scenario, numbers in timings.items():
            terminalreporter.write_line(f"{scenario}: {json.dumps(numbers)}")
