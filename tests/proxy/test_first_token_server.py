"""The proxy's first-token path over real sockets, with stub upstreams that return token
ids: what D is sent, when D is not called, and D failing after P's token went out.
(Answers equal to a plain vLLM's: tests/e2e/test_pd_first_token.py.)"""

from __future__ import annotations

from typing import Any

from tests.proxy.harness import parse_sse, proxy_stack, run
from tests.proxy.stub_upstream import MODEL, reference_tokens

BODY: dict[str, Any] = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


async def _post(stack: Any, body: dict[str, Any]) -> tuple[int, bytes]:
    async with stack.session.post(stack.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


def test_d_gets_the_prompt_ids_plus_ps_token_and_one_token_less() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            stack.prefills[0].token_ids = True
            status, raw = await _post(stack, {**BODY, "stream": True})
            assert status == 200
            text, done, _ = parse_sse(raw)
            p_token = reference_tokens({**BODY, "max_tokens": 1})[0]
            assert done and text.startswith(p_token)
            ((_, sent),) = stack.decodes[0].received
            assert sent["prompt"] == [1, 2, 3, 100] and sent["max_tokens"] == 3
            assert sent["kv_transfer_params"]["do_remote_prefill"] is True

    run(scenario())


def test_a_one_token_answer_is_ps_alone() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            stack.prefills[0].token_ids = True
            for stream in (False, True):
                status, _ = await _post(stack, {**BODY, "max_tokens": 1, "stream": stream})
                assert status == 200
            assert stack.decodes[0].received == []
            (_, p_body), _ = stack.prefills[0].received
            assert "kv_transfer_params" not in p_body  # nothing for a D to pull

    run(scenario())


def test_d_failing_after_ps_token_is_an_error_event_and_the_proxy_keeps_serving() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            stack.prefills[0].token_ids = True
            stack.decodes[0].fail_next.append((400, "prompt too long for this decode"))
            status, raw = await _post(stack, {**BODY, "stream": True})
            assert status == 200  # went out with P's token
            text, done, events = parse_sse(raw)
            assert not done and text == reference_tokens({**BODY, "max_tokens": 1})[0]
            assert events[-1]["error"]["code"] == 400
            assert "prompt too long" in events[-1]["error"]["message"]
            status, raw = await _post(stack, {**BODY, "stream": True})
            assert status == 200 and parse_sse(raw)[1]

    run(scenario())


def test_n_above_one_is_a_400_before_p_is_called() -> None:
    async def scenario() -> None:
        async with proxy_stack() as stack:
            status, raw = await _post(stack, {**BODY, "n": 2})
            assert status == 400 and b"'n' must be 1" in raw
            assert stack.prefills[0].received == []

    run(scenario())


def test_first_token_from_decode_keeps_the_two_full_legs() -> None:
    async def scenario() -> None:
        async with proxy_stack(first_token_from="decode") as stack:
            stack.prefills[0].token_ids = True
            status, _ = await _post(stack, {**BODY, "stream": True})
            assert status == 200
            ((_, sent),) = stack.decodes[0].received
            assert sent["prompt"] == "hello" and sent["max_tokens"] == 4

    run(scenario())
