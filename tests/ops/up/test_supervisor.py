"""``kvpool up``'s supervisor against real, small processes: start, health, stop,
and never a process left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.ops.up.plan import (
    ProcessSpec,
)
from kvpool.ops.up.supervisor import StartupFailed, Supervisor, log_tail
from tests.ops.up.helpers import REPO, gone
from tests.waiting import wait_until

# A process that ignores SIGTERM and has a child (same process group) that ignores it too,
# as a stuck vLLM API server with its engine process would.
STUBBORN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    print("CHILDPID", child.pid, flush=True)
    time.sleep(300)
    """
)


def spec(tmp_path: Path, name: str, code: str, *, stage: int = 0, health: str = "") -> ProcessSpec:
    return ProcessSpec(
        name=name,
        role=name,
        argv=(sys.executable, "-c", code),
        env={"PYTHONUNBUFFERED": "1"},
        health_url=health or "http://127.0.0.1:9/health",
        url="",
        log_path=tmp_path / f"{name}.log",
        stage=stage,
    )


def child_pid(log: Path) -> int:
    wait_until(lambda: "CHILDPID " in log.read_text(errors="replace"))
    line = next(x for x in log.read_text().splitlines() if x.startswith("CHILDPID "))
    return int(line.split()[1])


@pytest.fixture
def sup() -> Iterator[Supervisor]:
    # a process that exits on SIGTERM gets ample time even on a loaded machine, so that
    # "stopped" never turns into "killed" by chance
    s = Supervisor(base_env=dict(os.environ), term_timeout_s=10.0, kill_timeout_s=10.0)
    try:
        yield s
    finally:
        s.stop_all()


def test_stop_escalates_to_sigkill_for_the_whole_group(tmp_path: Path, sup: Supervisor) -> None:
    running = sup.start(spec(tmp_path, "stubborn", STUBBORN))
    grandchild = child_pid(running.spec.log_path)
    sup.term_timeout_s = 1.0  # it will not stop on SIGTERM: no need to wait long
    stopped: list[tuple[str, str]] = []
    sup.stop_all(lambda r, how: stopped.append((r.spec.name, how)))
    assert stopped == [("stubborn", "killed (did not stop on SIGTERM)")]
    assert gone(running.pid) and gone(grandchild)


def test_stop_clears_what_a_dead_leader_left_in_its_group(tmp_path: Path, sup: Supervisor) -> None:
    parent = textwrap.dedent(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print("CHILDPID", child.pid, flush=True)
        time.sleep(300)
        """
    )
    running = sup.start(spec(tmp_path, "server", parent))
    engine = child_pid(running.spec.log_path)
    os.kill(running.pid, signal.SIGKILL)  # the API server crashes, its engine lives on
    wait_until(lambda: running.proc.poll() is not None)
    assert [r.spec.name for r in sup.exited()] == ["server"] and sup.exited() == []
    assert not gone(engine)
    assert sup.stop(running) == "stopped"
    assert gone(engine)


def test_stop_goes_in_reverse_stage_order(tmp_path: Path, sup: Supervisor) -> None:
    sleeper = "import time; time.sleep(300)"
    for name, stage in (("master", 0), ("prefill", 1), ("decode", 1), ("proxy", 2)):
        sup.start(spec(tmp_path, name, sleeper, stage=stage))
    order: list[str] = []
    sup.stop_all(lambda r, how: order.append(f"{r.spec.name}:{how}"))
    assert order == ["proxy:stopped", "prefill:stopped", "decode:stopped", "master:stopped"]
    assert all(gone(pid) for pid in sup.pids().values())


def test_a_process_that_exits_while_starting_is_named_with_its_log(
    tmp_path: Path, sup: Supervisor
) -> None:
    running = sup.start(spec(tmp_path, "broken", "print('cannot bind port 1234'); exit(3)"))
    with pytest.raises(StartupFailed, match="broken: exited with exit status 3") as info:
        sup.wait_healthy([running], 30)
    assert "cannot bind port 1234" in info.value.log_path.read_text()


def test_an_earlier_stage_that_dies_fails_the_start_of_a_later_one(
    tmp_path: Path, sup: Supervisor
) -> None:
    # A prefill whose health URL a stranger answered, then died binding its port: the
    # proxy's stage would wait for a healthy prefill until the start timeout.
    early = sup.start(spec(tmp_path, "prefill", "print('Address already in use'); exit(1)"))
    wait_until(lambda: early.proc.poll() is not None)
    late = sup.start(spec(tmp_path, "proxy", "import time; time.sleep(300)", stage=1))
    with pytest.raises(StartupFailed, match="prefill: exited with exit status 1") as info:
        sup.wait_healthy([late], 300)
    assert "Address already in use" in info.value.log_path.read_text()


def test_a_process_that_never_gets_healthy_times_out(tmp_path: Path, sup: Supervisor) -> None:
    running = sup.start(spec(tmp_path, "silent", "import time; time.sleep(300)"))
    with pytest.raises(StartupFailed, match="silent: not healthy after 1 s"):
        sup.wait_healthy([running], 1.0)


def test_healthy_and_signal_during_start(tmp_path: Path, sup: Supervisor) -> None:
    web = tmp_path / "web"
    web.mkdir()
    (web / "health").write_text("ok")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = spec(
        tmp_path,
        "web",
        f"import http.server, functools; http.server.ThreadingHTTPServer(('127.0.0.1', {port}),"
        f" functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(web)!r}))"
        ".serve_forever()",
        health=f"http://127.0.0.1:{port}/health",
    )
    seen: list[str] = []
    assert sup.wait_healthy([sup.start(server)], 30, on_healthy=lambda r: seen.append(r.spec.name))
    assert seen == ["web"]
    waiting = sup.start(spec(tmp_path, "waiting", "import time; time.sleep(300)"))
    assert not sup.wait_healthy([waiting], 30, should_stop=lambda: True)


PARENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from kvpool.ops.up.plan import ProcessSpec
    from kvpool.ops.up.supervisor import Supervisor
    log = Path(sys.argv[1])
    s = Supervisor(base_env=dict(os.environ))
    s.start(ProcessSpec("kid", "kid", (sys.executable, "-c", "import time; time.sleep(300)"),
                        {}, "", "", log, 0))
    print(s.running[0].pid, flush=True)
    time.sleep(300)
    """
)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "kid.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert parent.stdout is not None
        kid = int(parent.stdout.readline())
        wait_until(lambda: "==> kvpool up" in (tmp_path / "kid.log").read_text())
        # the launcher asks for its parent-death signal, then execs the real command: once
        # the command line no longer holds the launcher, the signal is armed
        wait_until(
            lambda: "prctl" not in cmdline(kid),
            what="the launcher to exec the child's own command",
        )
        assert not gone(kid)
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
    wait_until(lambda: gone(kid), what="the child outlived its SIGKILLed supervisor")


def test_a_failed_start_shows_the_exception_raised_above_the_last_lines(tmp_path: Path) -> None:
    # what a vLLM whose engine core failed prints: the cause, then the front end's own
    # traceback ending in "See root cause above"
    lines = ["INFO starting"]
    lines += ["(EngineCore pid=7) Traceback (most recent call last):"]
    lines += ["(EngineCore pid=7) OSError: [Errno 98] Address already in use"]
    lines += [f"  frame {i}" for i in range(40)]
    lines += ["RuntimeError: Engine core initialization failed. See root cause above."]
    log = tmp_path / "prefill-1.log"
    log.write_text("\n".join(lines) + "\n")
    shown = log_tail(log, 30).splitlines()
    assert shown[1] == "(EngineCore pid=7) OSError: [Errno 98] Address already in use"
    assert shown[-1].startswith("RuntimeError: Engine core initialization failed")
    assert "  frame 11" in shown and "  frame 10" not in shown  # then the last 30 lines
    log.write_text("\n".join(lines[-5:]) + "\n")  # nothing raised above: the tail alone
    assert log_tail(log, 30).splitlines() == lines[-5:]
