"""Session fixtures for the real-vLLM tests: a tiny model, and offline vLLM in a subprocess.

Offline engines run as ``python -m tests.e2e.vllm_offline`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine in-process: a ~2 s start instead of ~15 s) in
a fresh process each, because vLLM keeps process-wide connector state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool.net import free_port
from kvpool.ops.up.tiny_model import build_tiny_model
from kvpool.testing import lifetime, processes, shm
from kvpool.testing.agent import kill_group
from kvpool.testing.processes import PoolProcess

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


def store_config(
    role: str = "kv_both", policy: str = "recompute", backend: str = "embedded", **extra: Any
) -> dict[str, Any]:
    """kvpool's store connector as a ``--kv-transfer-config`` (``extra``: its own keys)."""
    return {
        "kv_connector": "KVPoolStoreConnector",
        "kv_connector_module_path": "kvpool.connectors.store",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"lookup_rpc_port": "1", "backend": backend, **extra},
    }


@dataclass
class OfflineRun:
    results: list[Any]
    log: str


RunOffline = Callable[..., OfflineRun]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``hybrid_model_dir(kind)``: a tiny hybrid model (kvpool.ops.up.tiny_hybrid), built
    once per session and kind, in a process of its own (transformers stays out of this
    one)."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            path = tmp_path_factory.mktemp(kind)
            argv = [sys.executable, "-m", "kvpool.ops.up.tiny_hybrid", str(path), "--kind", kind]
            subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=300)
            built[kind] = path
        return built[kind]

    return get


@pytest.fixture(scope="session")
def run_offline(tmp_path_factory: pytest.TempPathFactory) -> RunOffline:
    """``run_offline(spec, env=..., enter=...)``: run one offline engine through
    ``spec["steps"]``; ``enter`` maps the command line first (a namespace's ``command``)."""
    counter = iter(range(1_000_000))

    def run(
        spec: dict[str, Any],
        *,
        env: Mapping[str, str] | None = None,
        enter: Callable[..., list[str]] | None = None,
    ) -> OfflineRun:
        workdir = tmp_path_factory.mktemp(f"offline{next(counter)}")
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        argv = [sys.executable, "-m", "tests.e2e.vllm_offline", str(spec_path)]
        proc = subprocess.run(  # tied: a killed run does not leave it computing
            lifetime.tie(argv if enter is None else enter(*argv)),
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


# A real ``kvpool master`` on a free port, as the pool's own tests start it.
Master = PoolProcess


def start_master(log_path: Path, *flags: str) -> Master:
    """A real ``kvpool master`` on 127.0.0.1, listening before this returns; its log goes
    to ``log_path`` as well."""
    return processes.start_master("--host", "127.0.0.1", *flags, log_path=log_path)


@pytest.fixture
def kvpool_master(tmp_path: Path) -> Iterator[Master]:
    master = start_master(tmp_path / "master.log")
    try:
        yield master
    finally:
        master.kill()


class Instance:
    """What the tests reach a server process by (a vLLM API server, a proxy), which runs in
    a process group of its own; the dataclasses below name these fields."""

    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    shm_before: set[str]  # /dev/shm at its start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        # killed, not stopped: the shared memory it held is ours to remove
        if kill_group(self.proc, grace_s=30, leader_first=True):
            shm.remove_orphans(self.shm_before)


@dataclass
class VllmServer(Instance):
    """A real ``vllm.entrypoints.openai.api_server`` in its own process group."""

    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    shm_before: set[str] = field(default_factory=set)  # /dev/shm at its start

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            result: dict[str, Any] = json.loads(reply.read())
            return result

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as reply:
            text: str = reply.read().decode()
            return text


def start_vllm_server(
    model: Path,
    kv_config: dict[str, Any] | None,
    log_path: Path,
    env: Mapping[str, str] | None = None,
) -> VllmServer:
    """Start ``vllm serve``'s API server (multiprocess, as deployed) and wait until healthy."""
    port = free_port()
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching",
    ]  # fmt: skip
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    full_env = vllm_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"})
    full_env.update(env or {})
    before = shm.snapshot()
    with log_path.open("wb") as log:
        proc = lifetime.popen(
            args,
            cwd=REPO,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = VllmServer(port, proc, log_path, before)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM exited: {server.log_text()[-4000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    server.stop()
    raise AssertionError(f"vLLM not healthy in 300 s: {server.log_text()[-4000:]}")
