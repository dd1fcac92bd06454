from __future__ import annotations

import json

import pytest

from kvpool.proxy.openai import (
    CHAT,
    COMPLETIONS,
    decode_request,
    error_body,
    prefill_request,
    stream_error_event,
    upstream_error,
    validate_request,
)


@pytest.mark.parametrize(
    ("kind", "body", "problem"),
    [
        (COMPLETIONS, [], "JSON object"),
        (COMPLETIONS, {"model": "m"}, "missing required field 'prompt'"),
        (COMPLETIONS, {"prompt": 3}, "'prompt' must be"),
        (COMPLETIONS, {"prompt": []}, "'prompt' must be"),
        (CHAT, {"prompt": "x"}, "missing required field 'messages'"),
        (CHAT, {"messages": "hi"}, "'messages' must be"),
        (CHAT, {"messages": ["hi"]}, "every item"),
        (COMPLETIONS, {"prompt": "x", "stream": 1}, "'stream'"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "'max_tokens'"),
        (CHAT, {"messages": [{}], "max_completion_tokens": -1}, "'max_completion_tokens'"),
        (COMPLETIONS, {"prompt": "x", "kv_transfer_params": []}, "'kv_transfer_params'"),
    ],
)
def test_validate_request_names_the_problem(kind: str, body: object, problem: str) -> None:
    found = validate_request(kind, body)
    assert found is not None and problem in found


def test_validate_request_accepts_routable_requests() -> None:
    assert (
        validate_request(COMPLETIONS, {"prompt": [1, 2], "stream": True, "max_tokens": 5}) is None
    )
    assert validate_request(CHAT, {"messages": [{"role": "user", "content": "hi"}]}) is None


def test_prefill_request_is_one_token_unstreamed_with_remote_decode() -> None:
    body = {
        "prompt": "x",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 10,
        "temperature": 0,
    }
    p = prefill_request(COMPLETIONS, body)
    assert p == {
        "prompt": "x",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert decode_request(body, None)["min_tokens"] == 10  # D keeps it
    assert body["max_tokens"] == 50 and body["stream"] is True  # the original is untouched
    chat = prefill_request(CHAT, {"messages": [{}], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    assert "max_completion_tokens" not in prefill_request(CHAT, {"messages": [{}]})


def test_decode_request_is_the_original_plus_p_params() -> None:
    body = {"prompt": "x", "stream": True}
    kv = {"do_remote_prefill": True, "remote_engine_id": "p0"}
    assert decode_request(body, kv) == {**body, "kv_transfer_params": kv}
    assert decode_request(body, None) == body


def test_upstream_error_reads_both_vllm_shapes_and_plain_text() -> None:
    nested = json.dumps({"error": {"message": "too long", "type": "BadRequestError", "code": 400}})
    assert upstream_error(400, nested.encode()) == ("too long", "BadRequestError")
    flat = json.dumps({"object": "error", "message": "no model", "type": "NotFoundError"})
    assert upstream_error(404, flat.encode()) == ("no model", "NotFoundError")
    assert upstream_error(500, b"Internal Server Error") == (
        "Internal Server Error",
        "server_error",
    )
    assert upstream_error(502, b"") == ("upstream answered HTTP 502", "bad_gateway")
    assert upstream_error(400, b'{"error": "bad"}') == ("bad", "invalid_request_error")


def test_error_shapes() -> None:
    assert error_body(503, "none left") == {
        "error": {"message": "none left", "type": "service_unavailable", "param": None, "code": 503}
    }
    event = stream_error_event(502, "gone")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["error"]["message"] == "gone"
