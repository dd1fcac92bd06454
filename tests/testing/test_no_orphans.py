"""A test run killed from outside leaves no process behind (kvpool.testing.lifetime).

A pytest run in a subprocess starts a server as the e2e fixtures do (``lifetime.popen``,
a session of its own) and a ``kvpool master`` (``PoolProcess``), and is SIGKILLed in the
middle of its test: nothing carrying its mark may be left.  Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvpool.testing import lifetime

ROOT = Path(__file__).resolve().parents[2]

INNER = """
import json, os, subprocess, sys, time
from pathlib import Path

from kvpool.testing import lifetime
from kvpool.testing.processes import start_master


def test_holds_servers():
    server = lifetime.popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    master = start_master("--host", "127.0.0.1")
    started = {"pids": [server.pid, master.pid], "mark": os.environ[lifetime.MARK]}
    Path(os.environ["KVPOOL_TEST_STARTED"]).write_text(json.dumps(started))
    time.sleep(600)  # SIGKILLed here
"""


def _wait_for(path: Path, run: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert run.poll() is None, f"the inner run ended:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"nothing started:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def _gone(mark: str, timeout_s: float) -> list[int]:
    """What still carries ``mark`` after waiting at most ``timeout_s`` for it to go."""
    deadline = time.monotonic() + timeout_s
    while (left := lifetime.carrying(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_run_killed_mid_test_leaves_nothing_it_started(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's addopts
    started, log = tmp_path / "started.json", tmp_path / "inner.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVPOOL_TEST_STARTED": str(started)}
    argv = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    with log.open("wb") as out:  # the real session hooks: each run marks what it starts
        run = lifetime.popen([*argv, "-q", "test_inner.py"], cwd=tmp_path, env=env, stdout=out,
                             stderr=subprocess.STDOUT)  # fmt: skip
    mark = lifetime.mark(run.pid)
    try:
        _wait_for(started, run, log, timeout_s=120)
        inner = json.loads(started.read_text())
        assert inner["mark"] == mark
        assert set(inner["pids"]) <= set(lifetime.carrying(mark))  # alive, and marked

        run.send_signal(signal.SIGKILL)
        run.wait(30)
        assert _gone(mark, timeout_s=60) == []
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
        lifetime.sweep(lifetime.carrying(mark))  # a failed test leaves nothing either


def test_the_sweep_kills_what_a_gone_run_left_and_spares_a_live_ones() -> None:
    ended = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)
    gone = lifetime.mark(ended.pid)
    ended.communicate(b"\n", timeout=30)
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    left = subprocess.Popen(sleep, env={**os.environ, lifetime.MARK: gone})
    kept = subprocess.Popen(sleep, env={**os.environ, lifetime.MARK: lifetime.mark()})
    try:
        assert lifetime.sweep([left.pid, kept.pid]) == [left.pid]
        assert left.wait(10) == -signal.SIGKILL
        assert kept.poll() is None
    finally:
        for proc in (left, kept):
            proc.kill()
            proc.wait(10)


def test_popen_marks_the_child_with_the_run(tmp_path: Path) -> None:
    read = f"import os; print(os.environ[{lifetime.MARK!r}], os.getpid(), os.getsid(0))"
    proc = lifetime.popen([sys.executable, "-c", read], stdout=subprocess.PIPE, text=True,
                          start_new_session=True)  # fmt: skip
    out, _ = proc.communicate(timeout=30)
    value, pid, sid = out.split()
    assert value == os.environ.get(lifetime.MARK, lifetime.mark())
    assert int(pid) == int(sid) == proc.pid  # the program itself: its PID, its own group
