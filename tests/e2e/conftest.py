"""Session fixtures for the real-vLLM tests: a tiny model, and offline vLLM in a subprocess.

Offline engines run as ``python -m tests.e2e.vllm_offline`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine in-process: a ~2 s start instead of ~15 s) in
a fresh process each, because vLLM keeps process-wide connector state.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.testing.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
RESULT_MARK = "KVPOOL_E2E_RESULT "
RUN_TIMEOUT_S = 420.0


def vllm_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every vLLM-CPU process in these tests gets."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONPATH": str(REPO),
        }
    )
    env.update(extra or {})
    return env


@dataclass
class OfflineRun:
    results: list[Any]
    log: str


RunOffline = Callable[..., OfflineRun]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def run_offline(tmp_path_factory: pytest.TempPathFactory) -> RunOffline:
    """``run_offline(spec, env=...)``: run one offline engine through ``spec["steps"]``."""
    counter = iter(range(1_000_000))

    def run(spec: dict[str, Any], *, env: Mapping[str, str] | None = None) -> OfflineRun:
        workdir = tmp_path_factory.mktemp(f"offline{next(counter)}")
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.vllm_offline", str(spec_path)],
            cwd=REPO,
            env=vllm_env(env),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        log = proc.stdout + proc.stderr
        (workdir / "log.txt").write_text(log)
        for line in proc.stdout.splitlines():
            if line.startswith(RESULT_MARK):
                return OfflineRun(json.loads(line[len(RESULT_MARK) :]), log)
        raise AssertionError(f"vLLM run failed (rc={proc.returncode}):\n{log[-6000:]}")

    return run


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Master:
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_master(log_path: Path, *flags: str) -> Master:
    """A real ``kvpool master`` on a free port, healthy before this returns."""
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvpool",
                "master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *flags,
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    master = Master(port, proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"master exited: {log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://{master.address}/health", timeout=2) as reply:
                if reply.status == 200:
                    return master
        except OSError:
            time.sleep(0.2)
    master.kill()
    raise AssertionError(f"master not healthy in 60 s: {log_path.read_text()[-3000:]}")


@pytest.fixture
def kvpool_master(tmp_path: Path) -> Iterator[Master]:
    master = start_master(tmp_path / "master.log")
    try:
        yield master
    finally:
        master.kill()
