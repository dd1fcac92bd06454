"""The proxy end to end against stub upstreams on real sockets (127.0.0.1)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.proxy.harness import Stack, proxy_stack, read_sse, run
from tests.proxy.stub_upstream import MODEL, reference_text, reference_tokens

COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6}
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "max_completion_tokens": 5,
}


def _strip(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "_headers"}


async def _post(stack: Stack, path: str, body: Any) -> tuple[int, Any]:
    async with stack.session.post(stack.url + path, json=body) as resp:
        return resp.status, await resp.json()


def _assert_two_legs(stack: Stack, sent: dict[str, Any]) -> None:
    [(p_path, p_body)] = stack.prefills[0].received
    [(d_path, d_body)] = stack.decodes[0].received
    assert p_path == d_path
    # the P leg: one token, no streaming, keep the KV for a remote decode
    assert p_body["max_tokens"] == 1
    assert p_body["stream"] is False
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream_options" not in p_body
    # the D leg: the original request plus exactly what P returned
    kv = d_body.pop("kv_transfer_params")
    assert kv["remote_engine_id"] == "p0"
    assert kv["do_remote_prefill"] is True
    assert kv["remote_request_id"] == p_body["_headers"]["X-Request-Id"]
    assert _strip(d_body) == sent
    assert p_body["_headers"]["X-Request-Id"] == d_body["_headers"]["X-Request-Id"]


def test_completion_goes_to_p_with_one_token_then_to_d_with_p_kv_params() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            status, reply = await _post(stack, "/v1/completions", COMPLETION)
            assert status == 200
            assert reply["choices"][0]["text"] == reference_text(COMPLETION)
            _assert_two_legs(stack, COMPLETION)

    run(scenario())


def test_client_request_id_and_authorization_reach_both_legs() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            headers = {"X-Request-Id": "req-42", "Authorization": "Bearer sk-test"}
            url = stack.url + "/v1/completions"
            async with stack.session.post(url, json=COMPLETION, headers=headers) as resp:
                assert resp.status == 200
            for stub in (stack.prefills[0], stack.decodes[0]):
                assert stub.received[0][1]["_headers"] == headers
            kv = stack.decodes[0].received[0][1]["kv_transfer_params"]
            assert kv["remote_request_id"] == "req-42"

    run(scenario())


def test_streamed_completion_passes_d_chunks_through_to_done() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            sent = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
            async with stack.session.post(stack.url + "/v1/completions", json=sent) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                text, done, events = await read_sse(resp)
            assert text == reference_text(COMPLETION)
            assert done
            assert len(events) == COMPLETION["max_tokens"] + 1  # one per token + finish
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            _assert_two_legs(stack, sent)

    run(scenario())


def test_server_timing_splits_the_hop_into_the_p_leg_and_d_to_first_bytes() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            for sent in (COMPLETION, {**COMPLETION, "stream": True}):
                async with stack.session.post(stack.url + "/v1/completions", json=sent) as resp:
                    assert resp.status == 200
                    await resp.read()
                    timing = resp.headers["Server-Timing"]
                names = [part.split(";")[0].strip() for part in timing.split(",")]
                assert names == ["prefill", "decode_first"], timing
                durations = [float(part.split("dur=")[1]) for part in timing.split(",")]
                assert all(d >= 0 for d in durations), timing

    run(scenario())


def test_chat_caps_max_completion_tokens_on_p_and_keeps_it_on_d() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            status, reply = await _post(stack, "/v1/chat/completions", CHAT)
            assert status == 200
            assert reply["choices"][0]["message"]["content"] == reference_text(CHAT)
            assert stack.prefills[0].received[0][1]["max_completion_tokens"] == 1
            _assert_two_legs(stack, CHAT)

    run(scenario())


def test_streamed_chat_completion() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            sent = {**CHAT, "stream": True}
            async with stack.session.post(stack.url + "/v1/chat/completions", json=sent) as resp:
                assert resp.status == 200
                text, done, events = await read_sse(resp)
            assert text == reference_text(CHAT)
            assert done
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[0]["object"] == "chat.completion.chunk"
            _assert_two_legs(stack, sent)

    run(scenario())


def test_prefill_error_comes_back_with_its_status_and_message() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            stack.prefills[0].fail_next.append((400, "This model's maximum context is 2048"))
            async with stack.session.post(stack.url + "/v1/completions", json=COMPLETION) as r:
                assert r.status == 400
                assert r.headers["X-Kvpool-Upstream"] == stack.prefills[0].url
                reply = await r.json()
            assert reply["error"]["message"] == "This model's maximum context is 2048"
            assert reply["error"]["type"] == "BadRequestError"
            assert reply["error"]["code"] == 400
            assert stack.decodes[0].received == []  # D never saw it
            # a 4xx is the request's fault: the endpoint stays in rotation
            assert stack.proxy.prefill.upstreams[0].healthy
            status, _ = await _post(stack, "/v1/completions", COMPLETION)
            assert status == 200

    run(scenario())


def test_decode_5xx_comes_back_and_takes_the_endpoint_out_until_health_recovers() -> None:
    async def scenario() -> None:
        async with proxy_stack(health_interval_s=3600) as stack:
            stack.decodes[0].fail_next.append((500, "engine core died"))
            status, reply = await _post(stack, "/v1/completions", COMPLETION)
            assert status == 500
            assert reply["error"]["message"] == "engine core died"
            assert not stack.proxy.decode.upstreams[0].healthy
            status, reply = await _post(stack, "/v1/completions", COMPLETION)
            assert status == 503
            assert "no healthy decode endpoint" in reply["error"]["message"]
            async with stack.session.get(stack.url + "/health") as r:
                assert r.status == 503
            await stack.proxy.check_health()  # the stub's /health answers 200
            status, _ = await _post(stack, "/v1/completions", COMPLETION)
            assert status == 200

    run(scenario())


def test_bad_requests_get_400_and_the_server_keeps_serving() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            url = stack.url + "/v1/completions"
            bad_bodies: list[bytes] = [
                b"{not json",
                b"[1, 2]",
                b'{"model": "m"}',
                b'{"prompt": "x", "stream": "yes"}',
                b'{"prompt": "x", "max_tokens": 0}',
            ]
            for raw in bad_bodies:
                async with stack.session.post(url, data=raw) as resp:
                    assert resp.status == 400, raw
                    assert (await resp.json())["error"]["type"] == "invalid_request_error"
            status, reply = await _post(stack, "/v1/chat/completions", {"messages": []})
            assert status == 400 and "messages" in reply["error"]["message"]
            assert stack.prefills[0].received == []
            status, _ = await _post(stack, "/v1/completions", COMPLETION)
            assert status == 200

    run(scenario())


def test_client_disconnect_mid_stream_aborts_the_decode_request() -> None:
    async def scenario() -> None:
        async with proxy_stack(token_delay_s=0.05) as stack:
            sent = {**COMPLETION, "max_tokens": 400, "stream": True}
            resp = await stack.session.post(stack.url + "/v1/completions", json=sent)
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the first chunk arrived
            resp.close()  # the client goes away with ~20 s of tokens left
            await stack.decodes[0].wait_disconnect(timeout=10)
            assert stack.decodes[0].disconnects == 1
            for _ in range(100):  # the proxy notices too and frees the slot
                if stack.proxy.decode.upstreams[0].inflight == 0:
                    break
                await asyncio.sleep(0.05)
            assert stack.proxy.decode.upstreams[0].inflight == 0
            # a client leaving is not the endpoint's fault
            assert stack.proxy.decode.upstreams[0].healthy

    run(scenario())


def test_client_leaving_before_a_whole_answer_aborts_the_decode_request() -> None:
    async def scenario() -> None:
        async with proxy_stack(token_delay_s=0.5) as stack:
            body = {**COMPLETION, "max_tokens": 40}  # D answers after 20 s
            url = stack.url + "/v1/completions"
            waiting = asyncio.create_task(stack.session.post(url, json=body))
            for _ in range(200):
                if stack.decodes[0].received:
                    break
                await asyncio.sleep(0.05)
            assert stack.decodes[0].received
            waiting.cancel()  # the client gives up and drops its connection
            await stack.decodes[0].wait_disconnect(timeout=10)
            assert stack.decodes[0].disconnects == 1
            status, _ = await _post(stack, "/v1/completions", {**COMPLETION, "max_tokens": 1})
            assert status == 200

    run(scenario())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_decode_is_skipped_and_taken_out() -> None:
    async def scenario() -> None:
        dead = f"http://127.0.0.1:{_closed_port()}"
        async with proxy_stack(
            extra_decode=(dead,), policy="round_robin", health_interval_s=3600
        ) as stack:
            for _ in range(4):
                status, reply = await _post(stack, "/v1/completions", COMPLETION)
                assert status == 200
                assert reply["choices"][0]["text"] == reference_text(COMPLETION)
            assert not stack.proxy.decode.get(dead).healthy
            assert len(stack.decodes[0].received) == 4

    run(scenario())


def test_slow_decode_is_a_timeout_not_a_hang() -> None:
    async def scenario() -> None:
        async with proxy_stack(
            token_delay_s=20.0, read_timeout_s=1.0, health_interval_s=3600
        ) as stack:
            d = stack.decodes[0]
            url = stack.url + "/v1/completions"
            sent = {**COMPLETION, "max_tokens": 2}
            # a whole answer that does not come: 504
            status, reply = await _post(stack, "/v1/completions", sent)
            assert status == 504
            assert reply["error"]["message"].startswith("decode endpoint ")
            assert "timed out" in reply["error"]["message"]
            assert not stack.proxy.decode.upstreams[0].healthy
            await stack.proxy.check_health()  # alive, only slow: back in rotation
            # a stream whose first byte does not come: still a proper 504
            d.first_token_delay_s = 20.0
            async with stack.session.post(url, json={**sent, "stream": True}) as resp:
                assert resp.status == 504
                assert "timed out" in (await resp.json())["error"]["message"]
            await stack.proxy.check_health()
            # a stream that stalls after its first token: the 200 is out, so the error
            # arrives as an event, with no [DONE]
            d.first_token_delay_s = 0.0
            async with stack.session.post(url, json={**sent, "stream": True}) as resp:
                assert resp.status == 200
                text, done, events = await read_sse(resp)
            assert not done
            assert text == reference_tokens(sent)[0]
            assert events[-1]["error"]["code"] == 504

    run(scenario())


def test_models_come_from_decode_and_health_lists_endpoints() -> None:
    async def scenario() -> None:
        async with proxy_stack(n_decode=2) as stack:
            async with stack.session.get(stack.url + "/v1/models") as resp:
                assert resp.status == 200
                models = await resp.json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            async with stack.session.get(stack.url + "/health") as resp:
                assert resp.status == 200
                health = await resp.json()
            assert health["status"] == "ok"
            assert [d["url"] for d in health["decode"]] == [d.url for d in stack.decodes]

    run(scenario())


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_are_prometheus_text_and_move_with_traffic() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            async with stack.session.get(stack.url + "/metrics") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain; version=")
                before = _samples(await resp.text())
            await _post(stack, "/v1/completions", COMPLETION)
            await _post(stack, "/v1/completions", {"prompt": 1})
            async with stack.session.get(stack.url + "/metrics") as resp:
                after = _samples(await resp.text())
            ok = (
                "kvpool_proxy_requests_total",
                (("endpoint", "/v1/completions"), ("status", "200")),
            )
            bad = (
                "kvpool_proxy_requests_total",
                (("endpoint", "/v1/completions"), ("status", "400")),
            )
            assert before.get(ok, 0) == 0 and after[ok] == 1
            assert after[bad] == 1
            assert (
                after[
                    ("kvpool_proxy_errors_total", (("kind", "bad_request"), ("stage", "request")))
                ]
                == 1
            )
            for leg in ("prefill", "decode"):
                name = f"kvpool_proxy_{leg}_seconds_count"
                assert before[(name, ())] == 0 and after[(name, ())] == 1
            e2e = ("kvpool_proxy_request_seconds_count", (("endpoint", "/v1/completions"),))
            assert after[e2e] == 2
            assert after[("kvpool_proxy_inflight_requests", ())] == 0
            healthy = (
                "kvpool_proxy_upstream_healthy",
                (("role", "decode"), ("url", stack.decodes[0].url)),
            )
            assert after[healthy] == 1

    run(scenario())


def test_prefix_affinity_sends_a_shared_system_prompt_to_one_prefill() -> None:
    async def scenario() -> None:
        system = {"role": "system", "content": "You are a support agent for ACME. " * 20}
        async with proxy_stack(n_prefill=3, policy="prefix_affinity", prefix_chars=256) as stack:
            for i in range(6):
                body = {"messages": [system, {"role": "user", "content": f"question {i}"}]}
                status, _ = await _post(stack, "/v1/chat/completions", body)
                assert status == 200
            counts = sorted(len(p.received) for p in stack.prefills)
            assert counts == [0, 0, 6]

    run(scenario())


def test_concurrent_streaming_load_has_no_errors_and_exact_outputs() -> None:
    clients, per_client = 8, 10

    async def one_client(stack: Stack, c: int) -> list[str]:
        failures = []
        for i in range(per_client):
            if (c + i) % 2:
                path = "/v1/completions"
                body: dict[str, Any] = {"prompt": f"client {c} request {i}", "max_tokens": 8 + i}
            else:
                path = "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": f"c{c} r{i}"}], "max_tokens": 9}
            async with stack.session.post(stack.url + path, json={**body, "stream": True}) as r:
                text, done, _ = await read_sse(r)
                if r.status != 200 or not done or text != reference_text(body):
                    failures.append(f"{path} {body}: {r.status} {done} {text!r}")
        return failures

    async def scenario() -> None:
        async with proxy_stack(n_prefill=2, n_decode=2, policy="least_inflight") as stack:
            results = await asyncio.gather(*(one_client(stack, c) for c in range(clients)))
            assert [f for r in results for f in r] == []
            total = clients * per_client
            assert sum(len(p.received) for p in stack.prefills) == total
            assert sum(len(d.received) for d in stack.decodes) == total
            assert all(d.received for d in stack.decodes)  # both decodes took load
            async with stack.session.get(stack.url + "/metrics") as resp:
                samples = _samples(await resp.text())
            errors = [v for (name, _), v in samples.items() if name == "kvpool_proxy_errors_total"]
            assert sum(errors) == 0

    run(scenario(), timeout=120)
