"""``kvpool up --ha``, as docs/ha.md tells a user to watch a failover: etcd, two masters,
a node; the leader is killed, the other leads, the killed one comes back as a standby."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvpool import Client
from tests.docs.blocks import doc_block
from tests.ops.up.helpers import REPO, gone, reaped, up_argv
from tests.ops.up.test_lifecycle import read_state, start_up
from tests.waiting import wait_until


def status(spec: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "status", "--master", spec, "--json"],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
    )  # fmt: skip
    leadership = json.loads(done.stdout)["leadership"]
    assert isinstance(leadership, dict)
    return leadership


def test_up_ha_survives_a_killed_leader_and_restarts_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (command,) = doc_block("ha.up").commands()
    argv = up_argv(command)
    assert argv[0] == "kvpool"  # the installed command; here, this interpreter's
    up = start_up(
        "--state-dir", str(state), "--master-port", "0", "--standby-port", "0",
        "--etcd-port", "0", command=[sys.executable, "-m", "kvpool", *argv[1:]],
    )  # fmt: skip
    with reaped(up):
        info = read_state(state, up.pid)
        procs = info["processes"]
        assert isinstance(procs, dict) and {"etcd", "master", "master-b", "node"} <= set(procs)
        urls = {name: procs[name]["url"].removeprefix("http://") for name in ("master", "master-b")}
        spec = f"{urls['master']},{urls['master-b']}"
        config = json.loads((state / "mooncake.json").read_text())
        assert config["metadata_server"] == spec  # what the vLLM instances and node dial
        with Client(spec, allow_shm=False) as client:
            wait_until(lambda: client.stats()["segments"], 30, what="the node registered")
            client.put("before", b"kept by the node" * 100)
            first = status(spec)
            assert first["role"] == "leader" and first["standbys"]
            leader = next(name for name, url in urls.items() if url == first["leader"])
            killed = procs[leader]["pid"]
            os.kill(killed, signal.SIGKILL)
            client.put("after", b"x" * 1000)  # waits for the other master to lead
            assert client.get("before") == b"kept by the node" * 100
        second = status(spec)
        # the other master, or the killed one already back (up restarts it at once): a
        # new term either way
        assert second["role"] == "leader" and second["epoch"] > first["epoch"]
        again = wait_until(
            lambda: (lambda p: p if p["alive"] and p["pid"] != killed else None)(
                read_state(state, up.pid)["processes"][leader]  # type: ignore[index]
            ),
            30,
            what="the killed master restarted",
        )
        wait_until(
            lambda: {status(spec)["leader"], *status(spec)["standbys"]} == set(urls.values()),  # type: ignore[misc]
            30,
            what="one leads, the other stands by",
        )
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=90)
    assert up.returncode == 0, out
    assert f"kvpool up: {leader} restarted as a standby" in out, out
    assert all(gone(p["pid"]) for p in read_procs(procs, again))


def read_procs(procs: dict[str, dict[str, int]], again: dict[str, int]) -> list[dict[str, int]]:
    return [*procs.values(), again]
