"""Process supervision for ``kvpool up``: start, wait healthy, stop, never leave anything.

Each process runs in its own session (``start_new_session``), so its process group is
exactly that process and whatever it spawned (vLLM's engine core and workers); only
groups this supervisor created are ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.errors import KVPoolError
from kvpool.net import http_get
from kvpool.ops.up.plan import ProcessSpec

__all__ = ["Running", "StartupFailed", "Supervisor", "describe_exit", "group_alive", "log_tail"]

# Children get PR_SET_PDEATHSIG (Linux) through this two-line launcher, so that even a
# `kvpool up` that is itself SIGKILLed leaves no orphan serving a port: each child gets
# SIGTERM when its parent dies.
# Runs in the child before exec: ask for SIGTERM when the parent dies, and exit at once if
# it already died between fork and prctl (the parent's pid is argv[1]).
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "try: ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except (OSError, AttributeError): pass\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class StartupFailed(KVPoolError):
    """A process of the stack exited or did not become healthy in time."""

    def __init__(self, name: str, reason: str, log_path: Path) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason
        self.log_path = log_path


# An exception's last line, as Python prints it, maybe behind vLLM's "(EngineCore pid=N) "
_RAISED = re.compile(r"^(?:\([^)]*\) )?(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?::|$)")


def log_tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file ('' if there is none), after the exceptions raised
    earlier than those lines: vLLM's front end ends with "Engine core initialization failed.
    See root cause above", and the cause is the engine core's exception, further up."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    every = text.splitlines()
    tail = every[-lines:]
    causes = list(dict.fromkeys(x for x in every[:-lines] if _RAISED.match(x)))[-3:]
    if not causes:
        return "\n".join(tail)
    return "\n".join(["raised earlier in the log:", *causes, "...", *tail])


@dataclass
class Running:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    started: float
    healthy_after_s: float | None = None
    reported_exit: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running.  Zombies do not count: a child
    whose parent died waits for init to reap it, and some container inits are slow to."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: a zombie counts as alive here
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass
class Supervisor:
    """The stack's processes, in start order."""

    base_env: Mapping[str, str]
    term_timeout_s: float = 20.0
    kill_timeout_s: float = 10.0
    poll_s: float = 0.25
    running: list[Running] = field(default_factory=list)

    def start(self, spec: ProcessSpec) -> Running:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.base_env, **spec.env}
        # a program that is no Python (mooncake_master) is exec'd by the launcher too
        python = spec.launcher or spec.argv[0]
        argv = [python, "-c", _LAUNCHER, str(os.getpid()), *spec.argv]
        with spec.log_path.open("ab") as log:
            log.write(f"\n==> kvpool up: {' '.join(spec.argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        running = Running(spec, proc, time.monotonic())
        self.running.append(running)
        return running

    def wait_healthy(
        self,
        stage: Sequence[Running],
        timeout_s: float,
        *,
        should_stop: Callable[[], bool] = lambda: False,
        on_healthy: Callable[[Running], None] = lambda r: None,
        on_wait: Callable[[list[Running], float], None] = lambda rs, t: None,
    ) -> bool:
        """Poll every process of ``stage`` until all answer their health URL.

        Returns False if ``should_stop()`` turned true (a signal); raises
        :class:`StartupFailed` naming the first process that exited or timed out.
        A process of an earlier stage that exits meanwhile fails the start too: a
        health URL can be answered by a stranger on the same port (a process that
        then dies binding it), and the later stage would wait for it forever.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        pending = list(stage)
        while pending:
            if should_stop():
                return False
            for r in self.running:
                code = r.proc.poll()
                if code is not None and not r.reported_exit:
                    r.reported_exit = True
                    raise StartupFailed(
                        r.spec.name,
                        f"exited with {describe_exit(code)} while starting",
                        r.spec.log_path,
                    )
            for r in list(pending):
                if http_get(r.spec.health_url, timeout_s=2.0).ok:
                    r.healthy_after_s = time.monotonic() - r.started
                    pending.remove(r)
                    on_healthy(r)
            if not pending:
                break
            now = time.monotonic()
            if now >= deadline:
                r = pending[0]
                raise StartupFailed(
                    r.spec.name,
                    f"not healthy after {timeout_s:.0f} s ({r.spec.health_url})",
                    r.spec.log_path,
                )
            on_wait(pending, now - start)
            time.sleep(self.poll_s)
        return True

    def exited(self) -> list[Running]:
        """Processes that exited since the last call (each reported once)."""
        out = []
        for r in self.running:
            if not r.reported_exit and r.proc.poll() is not None:
                r.reported_exit = True
                out.append(r)
        return out

    def stop_all(self, on_stopped: Callable[[Running, str], None] = lambda r, how: None) -> None:
        """Stop in reverse start order, stage by stage: the proxy drains first, the master
        goes last.  Every group ends up empty or this raises nothing and has SIGKILLed it."""
        stages: dict[int, list[Running]] = {}
        for r in self.running:
            stages.setdefault(r.spec.stage, []).append(r)
        for key in sorted(stages, reverse=True):
            self._stop_group_set(stages[key], on_stopped)

    # Stopping sends SIGTERM to the process, then to the whole group, then SIGKILL, each after
    # a bounded wait, then waits (bounded) until the group is empty.
    def stop(self, r: Running) -> str:
        """Stop one process's whole group now (bounded); says how it went."""
        outcome: list[str] = []
        self._stop_group_set([r], lambda _, how: outcome.append(how))
        return outcome[0]

    def _stop_group_set(
        self, group: Iterable[Running], on_stopped: Callable[[Running, str], None]
    ) -> None:
        members = list(group)
        # SIGTERM to each leader alone first: vLLM's API server then stops its engine
        # processes itself, and they unlink their shared memory (/dev/shm/psm_*); SIGTERM
        # to the whole group at once kills them mid-shutdown and leaves it behind
        for r in members:
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signal.SIGTERM)
        halfway = time.monotonic() + self.term_timeout_s / 2
        for r in members:
            if not self._wait_gone(r, halfway):
                _signal_group(r.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.term_timeout_s / 2
        for r in members:
            how = "stopped"
            if not self._wait_gone(r, deadline):
                _signal_group(r.pid, signal.SIGKILL)
                how = "killed (did not stop on SIGTERM)"
                if not self._wait_gone(r, time.monotonic() + self.kill_timeout_s):
                    how = "still alive after SIGKILL"
            on_stopped(r, how)

    def _wait_gone(self, r: Running, deadline: float) -> bool:
        """Reap the leader and wait until no process of its group is left."""
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=0.05)
            if r.proc.returncode is not None and not group_alive(r.pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def pids(self) -> dict[str, int]:
        return {r.spec.name: r.pid for r in self.running}


def describe_exit(code: int) -> str:
    """``exit status 3`` or ``signal SIGKILL`` from a Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"
