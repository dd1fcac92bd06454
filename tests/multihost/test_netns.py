"""kvpool.testing.netns itself: hosts reach each other, faults do what they say, an agent
runs calls on its host, and nothing is left behind, even when the test fails halfway."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from kvpool.testing.netns import Topology, remove_namespaces, run_prefix

LISTEN = (
    "import socket, sys\n"
    "s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen()\n"
    "while True: s.accept()[0].close()\n"
)
PROBE = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], 7000), timeout=1.0).close(); print('ok')\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__)\n"
)


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(prefix)]


def _reach(topo: Topology, src: str, dst: str) -> str:
    argv = topo.command(src, "python3", "-c", PROBE, topo.address(dst))
    return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_and_faults_are_undone() -> None:
    with Topology(["a", "b", "c"]) as topo:
        for host in ("b", "c"):
            topo.popen(host, ["python3", "-c", LISTEN, topo.address(host)])
        deadline = time.monotonic() + 10
        while _reach(topo, "a", "b") != "ok" or _reach(topo, "a", "c") != "ok":
            assert time.monotonic() < deadline, "the listeners did not come up"
            time.sleep(0.1)
        topo.partition("a", "b")  # a and b lose each other, nobody else
        assert _reach(topo, "a", "b") == "TimeoutError"  # lost, not refused
        assert _reach(topo, "a", "c") == "ok"
        assert _reach(topo, "c", "b") == "ok"
        topo.heal("a", "b")
        assert _reach(topo, "a", "b") == "ok"
        topo.cut("c")
        assert _reach(topo, "a", "c") == "TimeoutError"
        topo.restore("c")
        assert _reach(topo, "a", "c") == "ok"


@pytest.mark.timeout(60)
def test_an_agent_runs_calls_on_its_host_and_stops_with_the_topology() -> None:
    with Topology(["a"]) as topo:
        agent = topo.agent("a", timeout_s=30)
        ours = os.readlink("/proc/self/ns/net")
        assert agent.run("os:readlink", "/proc/self/ns/net") != ours  # on host a
        kept = agent.new("builtins:list")
        agent.call(kept, "append", 7)
        assert agent.run("builtins:sorted", kept) == [7]  # a Ref stands for what it kept
        with pytest.raises(ValueError, match="invalid literal"):
            agent.run("builtins:int", "seven")  # the helper's exception, as it was
    assert agent.proc.poll() is not None  # stopped when the topology closed


@pytest.mark.timeout(60)
def test_nothing_is_left_after_a_failure() -> None:
    prefix = run_prefix()
    with pytest.raises(RuntimeError, match="halfway"), Topology(["a", "b"], prefix=prefix) as topo:
        proc = topo.popen("a", ["sleep", "600"])
        assert len(_namespaces(prefix)) == 3  # two hosts and the bridge
        raise RuntimeError("the test failed halfway")
    assert proc.poll() is not None  # killed with its process group
    assert _namespaces(prefix) == []


def test_a_crashed_run_is_cleaned_up_by_its_prefix() -> None:
    prefix = run_prefix()
    subprocess.run(["ip", "netns", "add", f"{prefix}left"], check=True)
    assert remove_namespaces(prefix) == [f"{prefix}left"]
    assert _namespaces(prefix) == []


def test_bad_host_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Topology(["a", "a"])
