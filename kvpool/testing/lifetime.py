"""Children that die with the test run that started them, however the run ends.

:func:`popen` children get SIGTERM from the kernel when their starting thread exits
(PR_SET_PDEATHSIG) and carry :data:`MARK`, the run's ``<pid>:<start time>``; what a killed
run left anyway (vLLM's engine core, a hung child) is found by a mark whose process is
gone, and killed by PID (:func:`sweep`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.ops.up.supervisor import _LAUNCHER

__all__ = [
    "MARK",
    "carrying",
    "claim",
    "leftovers",
    "mark",
    "popen",
    "stop",
    "sweep",
    "tie",
]

MARK = "KVPOOL_TEST_RUN"


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), or None if there is no such process:
    with the PID it names one process, never a later one that reused the PID."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return fields[19].decode()  # field 22 of proc(5); [0] is field 3, after "(comm)"


def mark(pid: int | None = None) -> str:
    """The value of :data:`MARK` for children of ``pid`` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid)}"


def _alive(value: str) -> bool:
    pid, _, started = value.partition(":")
    return pid.isdigit() and _start_time(int(pid)) == started


def tie(argv: Sequence[str]) -> list[str]:
    """``argv`` run through the launcher: SIGTERM to it when this thread exits."""
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *argv]


def popen(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, env=env, **kwargs)``, tied to this process and marked.
    The PID is the program's own (the launcher execs it), so are its session and group."""
    # the mark ``env`` names, else the run's (:func:`claim`), else this process's own
    full_env = {MARK: os.environ.get(MARK) or mark(), **(os.environ if env is None else env)}

    def start() -> subprocess.Popen[Any]:
        return subprocess.Popen(tie(argv), env=full_env, **kwargs)

    if threading.current_thread() is threading.main_thread():
        return start()
    # The kernel signals when the starting *thread* exits: a short-lived one hands the
    # start to a thread that lives as long as this process.
    return _spawner().submit(start).result()


def stop(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """SIGTERM to ``proc``, then SIGKILL if it does not exit within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@functools.cache
def _spawner() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-spawner")


def claim() -> str | None:
    """Make this process a run: what it starts from now on carries its mark (also children
    started without :func:`popen`).  Returns the mark it carried before, if any."""
    before = os.environ.get(MARK)
    os.environ[MARK] = mark()
    return before


def _marked(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except OSError:  # gone, or not ours to read (a zombie's reads empty)
        return None
    prefix = MARK.encode() + b"="
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def carrying(value: str) -> list[int]:
    """The PIDs of the live processes marked ``value``."""
    return [pid for pid in _pids() if _marked(pid) == value]


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _ancestors() -> set[int]:
    """This process and those above it: a run may be started from a marked shell."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                pid = int(stat.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def leftovers(among: Iterable[int] | None = None) -> dict[int, str]:
    """PID → start time of each marked process (of ``among``, default all) whose run is
    gone."""
    spared = _ancestors()
    found: dict[int, str] = {}
    for pid in _pids() if among is None else among:
        value = _marked(pid)
        started = _start_time(pid)
        if pid not in spared and value and started is not None and not _alive(value):
            found[pid] = started
    return found


def sweep(among: Iterable[int] | None = None, wait_s: float = 10.0) -> list[int]:
    """SIGKILL every :func:`leftovers` process, each by a pidfd opened while its start time
    still matched (so never a process that reused its PID); returns the PIDs killed, after
    waiting at most ``wait_s`` in all for them to go."""
    killed: dict[int, int] = {}  # pidfd → pid
    for pid, started in leftovers(among).items():
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        if _start_time(pid) != started:
            os.close(pidfd)
            continue
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        killed[pidfd] = pid
    poller = select.poll()
    for pidfd in killed:
        poller.register(pidfd, select.POLLIN)  # readable once the process has exited
    pending, deadline = set(killed), time.monotonic() + wait_s
    while pending and (left := deadline - time.monotonic()) > 0:
        for pidfd, _ in poller.poll(left * 1000):
            poller.unregister(pidfd)
            pending.discard(pidfd)
    for pidfd in killed:
        os.close(pidfd)
    return sorted(killed.values())
