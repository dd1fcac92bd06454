"""``kvpool up --model PATH`` with a hybrid model: P→D through the proxy moves every KV
cache group, and the answer is a plain instance's.

One stack per tiny hybrid model (kvpool.ops.up.tiny_hybrid), started once for the module:
Gemma 3 (sliding window beside full attention) and Qwen3-Next (gated delta-net state
beside attention: bfloat16, prefix caching on, which its state needs).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.ops.up.tiny_model import sample_text
from tests.e2e.conftest import RunOffline
from tests.e2e.up_stack import START_TIMEOUT_S, Stack, post_json, running

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
HMA_OFF = "Turning off hybrid kv cache manager"
# kind: (dtype, extra vLLM flags, prompt words)
KINDS: dict[str, tuple[str, str, int]] = {
    "gemma3": ("float32", "", 500),
    "qwen3_next": ("bfloat16", "--enable-prefix-caching", 900),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def hybrid(
    request: pytest.FixtureRequest,
    hybrid_model_dir: Callable[[str], Path],
    run_offline: RunOffline,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Stack, str, list[str], dict[str, str]]]:
    """A running ``kvpool up`` of one hybrid model, its served name, its prompts, and a
    plain instance's answers to them."""
    kind = request.param
    dtype, flags, words = KINDS[kind]
    model = hybrid_model_dir(kind)
    prompts = [sample_text(words, seed=41), sample_text(words, seed=42)]
    ref = run_offline(
        {
            "model": str(model),
            "dtype": dtype,
            "prefix_caching": bool(flags),
            "steps": [
                {"op": "generate", "prompts": [p], "max_tokens": MAX_TOKENS} for p in prompts
            ],
        }
    )
    reference = {p: r["texts"][0] for p, r in zip(prompts, ref.results, strict=True)}
    state = tmp_path_factory.mktemp(f"up-{kind}")
    argv = ["kvpool", "up", "--model", str(model), "--dtype", dtype, "--state-dir", str(state)]
    for flag in ("--master-port", "--proxy-port", "--prefill-port", "--decode-port"):
        argv += [flag, "0"]
    argv += ["--prefill-kv-port", "0", "--decode-kv-port", "0"]
    argv += ["--start-timeout", str(START_TIMEOUT_S)]
    if flags:
        argv += [f"--vllm-args={flags}"]
    argv[0] = str(Path(sys.executable).parent / "kvpool")
    with running(argv, state) as stack:
        yield stack, model.name, prompts, reference


def complete(stack: Stack, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return post_json(stack.proxy + "/v1/completions", body)


def test_pd_moves_every_group_and_answers_as_a_plain_instance(
    hybrid: tuple[Stack, str, list[str], dict[str, str]],
) -> None:
    stack, model, prompts, reference = hybrid
    for prompt in prompts:
        reply = complete(stack, model, prompt)
        assert reply["choices"][0]["text"] == reference[prompt]
    prefill, decode = stack.log("prefill-0"), stack.log("decode-0")
    assert HMA_OFF not in prefill + decode  # both connectors keep vLLM's HMA on
    assert decode.count("[KVPoolTransferConnector] loaded request") >= len(prompts)
    assert "computing locally, not pulling" not in decode
    assert "refusing pull" not in prefill
    # the prefill's store child saved every group into the pool
    assert "KV cache group 1:" in prefill


def test_a_repeated_prompt_still_answers_the_same(
    hybrid: tuple[Stack, str, list[str], dict[str, str]],
) -> None:
    """The second time, each instance's own cache and the pool hold the prefix: whatever
    serves it, the answer does not change."""
    stack, model, prompts, reference = hybrid
    for _ in range(2):
        assert complete(stack, model, prompts[0])["choices"][0]["text"] == reference[prompts[0]]
