"""The proxy's API keys on real sockets: a request without the key, or with a wrong one,
gets OpenAI's 401 and never reaches P or D; the right key is served (streams too), and P
and D see the proxy's upstream key, never the client's."""

from __future__ import annotations

import hmac
from typing import Any

import pytest

from kvpool.proxy import auth
from kvpool.proxy.auth import ApiKeys
from tests.proxy.harness import Stack, proxy_stack, read_sse, run
from tests.proxy.stub_upstream import reference_text

KEY = "sk-kvpool-0123456789abcdef0123"
OTHER_KEY = "sk-kvpool-fedcba9876543210fedc"
UPSTREAM_KEY = "vllm-instances-key-42"
COMPLETION = {"model": "stub-model", "prompt": "who holds the key", "max_tokens": 6}
CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _post(
    stack: Stack, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    async with stack.session.post(stack.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


def _no_upstream_called(stack: Stack) -> None:
    for stub in stack.prefills + stack.decodes:
        assert stub.received == [], f"{stub.name} was called: {stub.received}"


@pytest.mark.parametrize(
    "headers",
    [
        None,
        _bearer("sk-kvpool-wrong-wrong-wrong-12"),
        _bearer(KEY[:-1]),  # a prefix of the key is not the key
        _bearer(KEY + "x"),
        {"Authorization": KEY},  # no scheme
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer "},
    ],
    ids=["none", "wrong", "prefix", "longer", "no-scheme", "basic", "empty"],
)
def test_without_the_right_key_401_and_no_upstream_is_called(
    headers: dict[str, str] | None,
) -> None:
    async def scenario() -> None:
        async with proxy_stack(api_keys=(KEY,)) as stack:
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                status, reply, resp_headers = await _post(stack, path, body, headers)
                assert status == 401, reply
                error = reply["error"]
                assert error["type"] == "invalid_request_error"
                assert error["code"] == "invalid_api_key"
                assert "Bearer" in error["message"] or "incorrect" in error["message"]
                assert KEY not in error["message"]
                assert resp_headers["WWW-Authenticate"].startswith("Bearer")
            for path in ("/v1/models", "/metrics", "/v1/nothing-here"):
                async with stack.session.get(stack.url + path, headers=headers) as resp:
                    assert resp.status == 401, path
            _no_upstream_called(stack)
            # refused, not down: the holder of the key is still served
            status, reply, _ = await _post(stack, "/v1/completions", COMPLETION, _bearer(KEY))
            assert status == 200, reply
            assert reply["choices"][0]["text"] == reference_text(COMPLETION)
            async with stack.session.get(stack.url + "/metrics", headers=_bearer(KEY)) as resp:
                metrics = await resp.text()
            assert 'kvpool_proxy_errors_total{kind="unauthorized",stage="client"} 5.0' in metrics

    run(scenario())


def test_right_key_is_served_and_p_and_d_see_the_same_key_by_default() -> None:
    async def scenario() -> None:
        # the stubs demand the key as `vllm serve --api-key KEY` does
        async with proxy_stack(api_keys=(KEY,), stub_api_key=KEY) as stack:
            status, reply, _ = await _post(stack, "/v1/completions", COMPLETION, _bearer(KEY))
            assert status == 200, reply
            assert reply["choices"][0]["text"] == reference_text(COMPLETION)
            status, reply, _ = await _post(stack, "/v1/chat/completions", CHAT, _bearer(KEY))
            assert status == 200, reply
            async with stack.session.get(stack.url + "/v1/models", headers=_bearer(KEY)) as resp:
                assert resp.status == 200
                assert (await resp.json())["data"][0]["id"] == "stub-model"
            for stub in (stack.prefills[0], stack.decodes[0]):
                assert [b["_headers"]["Authorization"] for _, b in stub.received] == [
                    f"Bearer {KEY}"
                ] * 2
                assert stub.unauthorized == 0

    run(scenario())


def test_upstream_key_replaces_the_clients_key_on_both_legs() -> None:
    async def scenario() -> None:
        async with proxy_stack(
            api_keys=(KEY, OTHER_KEY), upstream_api_key=UPSTREAM_KEY, stub_api_key=UPSTREAM_KEY
        ) as stack:
            for key in (KEY, OTHER_KEY):  # either of the proxy's keys passes
                status, reply, _ = await _post(stack, "/v1/completions", COMPLETION, _bearer(key))
                assert status == 200, reply
            async with stack.session.get(stack.url + "/v1/models", headers=_bearer(KEY)) as resp:
                assert resp.status == 200  # the stub refuses /v1/models without its key
            for stub in (stack.prefills[0], stack.decodes[0]):
                seen = {b["_headers"]["Authorization"] for _, b in stub.received}
                assert seen == {f"Bearer {UPSTREAM_KEY}"}
                assert stub.unauthorized == 0

    run(scenario())


def test_a_wrong_upstream_key_is_the_upstreams_401_passed_on() -> None:
    async def scenario() -> None:
        async with proxy_stack(
            api_keys=(KEY,), upstream_api_key="not-the-vllm-key", stub_api_key=UPSTREAM_KEY
        ) as stack:
            status, reply, headers = await _post(stack, "/v1/completions", COMPLETION, _bearer(KEY))
            assert status == 401
            assert reply["error"]["message"] == "Unauthorized"
            assert headers["X-Kvpool-Upstream"] == stack.prefills[0].url
            assert stack.prefills[0].unauthorized == 1
            assert stack.decodes[0].received == []

    run(scenario())


def test_streaming_with_the_key_while_others_are_refused() -> None:
    async def scenario() -> None:
        async with proxy_stack(api_keys=(KEY,), token_delay_s=0.02) as stack:
            body = {**COMPLETION, "max_tokens": 25, "stream": True}
            url = stack.url + "/v1/completions"
            async with stack.session.post(url, json=body, headers=_bearer(KEY)) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                first = await resp.content.readuntil(b"\n\n")
                # refused requests in the middle of the stream do not disturb it
                for _ in range(5):
                    status, _, _ = await _post(stack, "/v1/completions", body, _bearer(OTHER_KEY))
                    assert status == 401
                text, done, _ = await read_sse(resp)
            assert done
            assert reference_text(body).endswith(text)
            assert first.startswith(b"data: ")
            assert len(stack.decodes[0].received) == 1

    run(scenario())


def test_health_is_open_but_tells_only_the_status_without_the_key() -> None:
    async def scenario() -> None:
        async with proxy_stack(api_keys=(KEY,)) as stack:
            async with stack.session.get(stack.url + "/health") as resp:
                assert resp.status == 200
                assert await resp.json() == {"status": "ok"}
            async with stack.session.get(stack.url + "/health", headers=_bearer(KEY)) as resp:
                detail = await resp.json()
            assert detail["status"] == "ok"
            assert detail["prefill"][0]["url"] == stack.prefills[0].url
            stack.decodes[0].healthy = False
            await stack.proxy.check_health()
            async with stack.session.get(stack.url + "/health") as resp:
                assert resp.status == 503
                assert await resp.json() == {"status": "unavailable"}

    run(scenario())


def test_open_metrics_serves_metrics_without_the_key_and_nothing_else() -> None:
    async def scenario() -> None:
        async with proxy_stack(api_keys=(KEY,), open_metrics=True) as stack:
            async with stack.session.get(stack.url + "/metrics") as resp:
                assert resp.status == 200
                assert "kvpool_proxy_requests" in await resp.text()
            status, _, _ = await _post(stack, "/v1/completions", COMPLETION)
            assert status == 401
            _no_upstream_called(stack)

    run(scenario())


def test_the_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check goes through hmac.compare_digest, over fixed-length digests (so the
    key's length does not leak either), against every key without stopping at a match."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)

    async def scenario() -> None:
        async with proxy_stack(api_keys=(KEY, OTHER_KEY)) as stack:
            for key, want in (("short-but-wrong", 401), (KEY, 200), (OTHER_KEY, 200)):
                calls.clear()
                status, _, _ = await _post(stack, "/v1/completions", COMPLETION, _bearer(key))
                assert status == want
                assert len(calls) == 2, calls  # both keys, even when the first matched
                assert all(len(a) == len(b) == 32 for a, b in calls)

    run(scenario())
    keys = ApiKeys([KEY])
    calls.clear()
    assert keys.problem(f"bearer {KEY}") is None  # the scheme is case-insensitive
    assert keys.problem(f"Bearer {OTHER_KEY}") == "incorrect API key provided"
    assert len(calls) == 2


def test_without_keys_the_clients_header_passes_through_as_before() -> None:
    async def scenario() -> None:
        async with proxy_stack(stub_api_key=UPSTREAM_KEY) as stack:
            status, reply, _ = await _post(
                stack, "/v1/completions", COMPLETION, _bearer(UPSTREAM_KEY)
            )
            assert status == 200, reply
            status, _, _ = await _post(stack, "/v1/completions", COMPLETION)
            assert status == 401  # the upstream's own refusal, passed on
            assert stack.prefills[0].unauthorized == 1

    run(scenario())
