"""Processes that join a test's private network namespace (vLLM, ``vllm serve``, the
proxy beside a real ``mooncake_master``): inside, reachable only from inside, and gone
when the namespace closes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvpool.testing.mooncake import Namespace, http_json

PORT = 8765  # inside the namespace, where nothing else listens


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_a_process_started_in_the_namespace_is_inside_it_and_ends_with_it() -> None:
    server = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(PORT)]
    url = f"http://127.0.0.1:{PORT}/"
    with Namespace() as ns:
        proc = ns.popen(server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while ns.run("kvpool.testing.mooncake:http_json", url, None, 1.0)[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "no server inside"
            time.sleep(0.1)
        # asked once it serves: until nsenter has entered, its PID is still outside
        assert _netns(proc.pid) == _netns(ns.proc.pid) != _netns(os.getpid())
        # the machine's own namespace cannot reach it
        assert http_json(url, None, 1.0)[0] is None
        done = subprocess.run(ns.command("ip", "-o", "link"), capture_output=True, text=True)
        assert [line.split(":")[1].strip() for line in done.stdout.splitlines()] == ["lo"]
    assert proc.poll() is not None  # closing the namespace ended what it started
