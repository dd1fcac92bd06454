"""Suite-wide settings: how the suite is spread over pytest-xdist's workers.

The README's test command runs pytest with two workers (``-n 2`` in ``pyproject.toml``):
much of the suite waits on sockets, timeouts and child processes rather than on the CPU.
Work is handed out a test module at a time (each module's fixtures are made once), except
for the tests which start many processes or whole stacks.  Those form two units, each run
one after another on one worker as they would alone: ``"vllm"`` (the modules that start
real vLLM instances, the longest unit) and ``"stacks"`` (the rest of the multi-host
namespaces, the soak, the benchmarks' runs).  The vLLM unit is handed out first and the
stacks unit last, so the other worker runs the short modules and then the stacks while
vLLM runs: two vLLM stacks at once on 2 cores would each take twice as long and crowd their bounds.

(``--dist loadgroup`` with ``xdist_group`` marks would say the same, but xdist 3.8 groups
by rewriting node ids, which pytest 9 no longer reads: its groups are silently ignored.)
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from kvpool.testing import lifetime, shm

# folders under tests/ → their unit of work
HEAVY = {"e2e": "vllm", "bench": "stacks", "multihost": "stacks", "soak": "stacks"}
# modules outside tests/e2e that start real vLLM too
VLLM_MODULES = (
    "tests/multihost/test_pd.py",
    "tests/multihost/test_deploy_docs.py",
    "tests/bench/test_ttft.py",
)
FIRST, LAST = "vllm", "stacks"


def unit_of(nodeid: str, module_unit: str) -> str:
    """The unit of work of a test: its folder's under :data:`HEAVY`, else its module's."""
    if nodeid.split("::", 1)[0] in VLLM_MODULES:
        return FIRST
    parts = nodeid.split("/", 2)
    if len(parts) == 3 and parts[0] == "tests" and parts[1] in HEAVY:
        return HEAVY[parts[1]]
    return module_unit


def hand_out_order(nodeid: str) -> int:
    """Where a test's unit goes in the queue: the vLLM unit first, the stacks last."""
    unit = unit_of(nodeid, "")
    return 0 if unit == FIRST else 2 if unit == LAST else 1


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, super()._split_scope(nodeid))

        def schedule(self) -> None:
            # Units are queued in collection order (not by size): every worker collected
            # the same list, so sorting each one alike keeps them equal.
            if self.collection is None:
                self.config.option.loadscopereorder = False
                for node, collection in self.registered_collections.items():
                    self.registered_collections[node] = sorted(collection, key=hand_out_order)
            super().schedule()

    return Scheduling(config, log)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The multi-host scenarios' measured times (tests/multihost's ``record``).  Here, not
    in tests/multihost/conftest.py: under xdist this process collects nothing, so a
    folder's conftest is never loaded in it.  Each worker wrote its file under its own
    basetemp, a folder of this one (one process: the file is in this one)."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    if config.stash.get(_SWEPT, None):
        terminalreporter.section("processes left by an earlier, killed run (killed)")
        terminalreporter.write_line(" ".join(map(str, config.stash[_SWEPT])))
    if config.stash.get(_SHM_LEFT, None):
        terminalreporter.section("/dev/shm: files that appeared during the run", red=True)
        for line in config.stash[_SHM_LEFT]:
            terminalreporter.write_line(line)
    timings: dict[str, Any] = {}
    for pattern in ("multihost-timings.json", "*/multihost-timings.json"):
        for path in sorted(base.glob(pattern)):
            timings.update(json.loads(path.read_text()))
    if timings:
        terminalreporter.section("multi-host: time to detect and to recover (s)")
        for scenario, numbers in timings.items():
            terminalreporter.write_line(f"{scenario}: {json.dumps(numbers)}")


# ------------------------------------------------------------------ no orphans
# Every process of the run (pytest, each xdist worker) marks what it starts, however it
# starts it (kvpool.testing.lifetime); children started through lifetime.popen also get
# SIGTERM when it dies.  A run killed from outside (a CI time-out, SIGKILL) can still leave
# a grandchild or a hung child: the next run kills those at its start, by PID, and lists
# them.
_SWEPT = pytest.StashKey[list[int]]()
_MARK_BEFORE = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_MARK_BEFORE] = lifetime.claim()


def pytest_unconfigure(config: pytest.Config) -> None:
    before = config.stash.get(_MARK_BEFORE, None)
    if before is None:
        os.environ.pop(lifetime.MARK, None)
    else:
        os.environ[lifetime.MARK] = before


# ------------------------------------------------------------------ /dev/shm, as found
# The run must leave /dev/shm as it found it: a segment of a killed node or a vLLM
# engine's psm_* file holds memory until reboot.  Checked once, by the process that ran
# the session (xdist's controller, or pytest alone), after every worker has ended.
_SHM_BEFORE = pytest.StashKey[set[str]]()


def _runs_the_session(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


_SHM_LEFT = pytest.StashKey[list[str]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    if _runs_the_session(session.config):
        # before the snapshot: what the leftovers held is then not this run's
        session.config.stash[_SWEPT] = lifetime.sweep()
        session.config.stash[_SHM_BEFORE] = shm.snapshot()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _runs_the_session(config) or _SHM_BEFORE not in config.stash:
        return
    before = config.stash[_SHM_BEFORE]
    held = sorted(set(shm.snapshot()) - before - set(shm.orphans(before)))
    removed = shm.remove_orphans(before)  # leaves the machine clean either way
    failing = [name for name in removed if name.startswith(_MUST_NOT_LEAK)]
    lines = [f"  {name}: no live process holds it (removed)" for name in removed]
    # held by a live process: another run's, or a process this one failed to stop
    lines += [f"  {name}: held by a live process (left)" for name in held]
    if lines:
        config.stash[_SHM_LEFT] = lines
    if failing and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# kvpool's segments and vLLM's message queues (psm_*, up to 250 MB each) fail the run;
# anything else is listed and removed.  vLLM's engines leave two of multiprocessing's named
# semaphores (sem.mp-*, 32 bytes each) even when they stop cleanly, and one vLLM run of
# tests/bench leaves its group's two vllm_dist_*-cpushm_* files (traced to that folder,
# not yet to its test; the TP tests of tests/e2e leave none).
_MUST_NOT_LEAK = ("kvpool-", "psm_")
