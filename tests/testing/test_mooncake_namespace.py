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


def test_a_master_is_up_only_when_its_rpc_port_accepts_too() -> None:
    """mooncake_master's metrics server can answer before its RPC port is bound: a
    master reported up on its metrics alone refused the first client (CI, 2026-12)."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvpool.testing.mooncake import master_up

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Health) as metrics:
        threading.Thread(target=metrics.serve_forever, daemon=True).start()
        with socket.socket() as rpc:
            rpc.bind(("127.0.0.1", 0))  # bound, not listening: a connect is refused
            metrics_at = f"127.0.0.1:{metrics.server_address[1]}"
            rpc_at = f"127.0.0.1:{rpc.getsockname()[1]}"
            assert not master_up(metrics_at, rpc_at)
            rpc.listen()
            assert master_up(metrics_at, rpc_at)
        metrics.shutdown()
