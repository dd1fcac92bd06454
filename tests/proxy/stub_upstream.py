"""A small but real OpenAI-compatible upstream (aiohttp) standing in for a vLLM instance.

It answers as vLLM 0.32 does for a P/D pair: a request with
``kv_transfer_params.do_remote_decode`` gets one token and ``kv_transfer_params`` saying
where "its KV" is; any other request gets a deterministic answer (``reference_text``),
whole or as SSE chunks ending in ``data: [DONE]``.  It records every request it
received and every client that went away mid-stream, so tests can assert what the
proxy sent.  Run it in-process (``StubUpstream``) or as a process::

    python -m tests.proxy.stub_upstream --port 0 --name d1 --token-delay 0.05

which prints ``PORT <n>`` once it listens; ``GET /_stub/received`` returns the records.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MODEL",
    "StubUpstream",
    "prompt_text",
    "reference_text",
    "reference_tokens",
]

DEFAULT_MAX_TOKENS = 16
_WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]
MODEL = "stub-model"


def prompt_text(body: dict[str, Any]) -> str:
    """The text the answer is derived from: the prompt, or the chat messages."""
    if "prompt" in body:
        return json.dumps(body["prompt"], sort_keys=True)
    return json.dumps(body.get("messages"), sort_keys=True)


def reference_tokens(body: dict[str, Any]) -> list[str]:
    """The tokens of the answer, one SSE chunk each: ``max_tokens`` of them."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    seed = hashlib.sha256(prompt_text(body).encode()).digest()
    return [f" {_WORDS[(seed[i % 32] + i) % len(_WORDS)]}{i}" for i in range(int(limit))]


def reference_text(body: dict[str, Any]) -> str:
    """What a decode answers for this request: the same text whole or streamed."""
    return "".join(reference_tokens(body))


@dataclass
class StubUpstream:
    name: str = "stub"
    host: str = "127.0.0.1"
    port: int = 0
    token_delay_s: float = 0.0  # between two tokens (the first comes at once)
    first_token_delay_s: float = 0.0  # silence before the first streamed byte
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    disconnects: int = 0
    healthy: bool = True
    # (status, message) answered to the next requests, one per request
    fail_next: list[tuple[int, str]] = field(default_factory=list)
    # as `vllm serve --api-key`: /v1/* needs "Authorization: Bearer <api_key>"
    api_key: str | None = None
    unauthorized: int = 0  # requests refused for the key
    # as vLLM >= 0.30: a whole reply carries prompt_token_ids and token_ids when asked
    # (``return_token_ids``), so the proxy starts answers with P's token
    token_ids: bool = False
    # as vLLM with --enable-prompt-tokens-details: the reply says what it had cached
    cached_tokens: int | None = None
    waiting: int = 0  # vllm:num_requests_waiting on /metrics
    _runner: web.AppRunner | None = None
    _disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/_stub/received", self._received)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait_disconnect(self, timeout: float) -> None:
        await asyncio.wait_for(self._disconnected.wait(), timeout)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """vLLM 0.32's AuthenticationMiddleware: guards /v1, answers 401 Unauthorized."""
        guarded = self.api_key is not None and request.path.startswith("/v1")
        if guarded and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.unauthorized += 1
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.1\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize, for a byte-level stand-in: one token per byte of the text."""
        body = await request.json()
        text = body.get("prompt") if "prompt" in body else prompt_text(body)
        return web.json_response({"tokens": list(str(text).encode()), "count": len(text)})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": MODEL, "object": "model", "created": 0, "owned_by": self.name}
        return web.json_response({"object": "list", "data": [model]})

    async def _received(self, request: web.Request) -> web.Response:
        records = [{"path": p, "body": b} for p, b in self.received]
        return web.json_response({"received": records, "disconnects": self.disconnects})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return self._error(400, "invalid JSON")
        body["_headers"] = {
            name: request.headers.get(name) for name in ("X-Request-Id", "Authorization")
        }
        self.received.append((request.path, body))
        if self.fail_next:
            return self._error(*self.fail_next.pop(0))
        chat = request.path.endswith("/chat/completions")
        kv_in = body.get("kv_transfer_params") or {}
        kv_out = None
        if kv_in.get("do_remote_decode"):
            kv_out = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.name,
                "remote_request_id": request.headers.get("X-Request-Id"),
                "remote_block_ids": [len(self.received), 7],
                "remote_host": self.host,
                "remote_port": self.port,
            }
        tokens = reference_tokens(body)
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{len(self.received)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", MODEL),
        }
        if not body.get("stream"):
            if self.token_delay_s:
                try:
                    await asyncio.sleep(self.token_delay_s * len(tokens))
                except asyncio.CancelledError:  # the client went away before the answer
                    self.disconnects += 1
                    self._disconnected.set()
                    raise
            text = "".join(tokens)
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            usage: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": len(tokens)}
            if self.cached_tokens is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
            reply = {**base, "choices": [choice], "usage": usage, "kv_transfer_params": kv_out}
            if self.token_ids and body.get("return_token_ids"):
                choice["token_ids"] = list(range(100, 100 + len(tokens)))
                (reply if chat else choice)["prompt_token_ids"] = [1, 2, 3]
            return web.json_response(reply)
        return await self._stream(request, base, tokens, chat)

    async def _stream(
        self, request: web.Request, base: dict[str, Any], tokens: list[str], chat: bool
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(piece: str | None, finish: str | None, first: bool = False) -> bytes:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                delta: dict[str, Any] = {} if piece is None else {"content": piece}
                if first:
                    delta["role"] = "assistant"
                choice["delta"] = delta
            else:
                choice["text"] = piece or ""
            return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n".encode()

        try:
            if self.first_token_delay_s:
                await asyncio.sleep(self.first_token_delay_s)
            if chat:
                await out.write(event("", None, first=True))
            for i, piece in enumerate(tokens):
                if self.token_delay_s and i > 0:
                    await asyncio.sleep(self.token_delay_s)
                await out.write(event(piece, None))
            await out.write(event(None, "length"))
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            self._disconnected.set()
            raise
        return out

    def _error(self, status: int, message: str) -> web.Response:
        body = {
            "error": {"message": message, "type": "BadRequestError", "param": None, "code": status}
        }
        return web.json_response(body, status=status)


async def _main(port: int, name: str, token_delay: float) -> None:
    stub = StubUpstream(name=name, port=port, token_delay_s=token_delay)
    await stub.start()
    print(f"PORT {stub.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await stub.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", default="stub")
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    if args.uvloop:  # the benchmark runs its upstreams on uvloop, as vLLM does
        import uvloop

        uvloop.run(_main(args.port, args.name, args.token_delay))
    else:
        asyncio.run(_main(args.port, args.name, args.token_delay))
