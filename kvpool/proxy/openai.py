"""The OpenAI wire shapes the proxy reads and writes.  Pure: dicts in, dicts/bytes out."""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "decode_request",
    "error_body",
    "error_type_for",
    "prefill_request",
    "stream_error_event",
    "upstream_error",
    "validate_request",
]

COMPLETIONS = "completions"
CHAT = "chat"


def validate_request(kind: str, body: Any) -> str | None:
    """What is wrong with a request body, or ``None`` if the proxy can route it.  Only what
    the proxy itself relies on is checked; the model server validates the rest."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if kind == COMPLETIONS:
        prompt = body.get("prompt")
        if prompt is None:
            return "missing required field 'prompt'"
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            return "'prompt' must be a string or a non-empty list"
    else:
        messages = body.get("messages")
        if messages is None:
            return "missing required field 'messages'"
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
        if not all(isinstance(m, dict) for m in messages):
            return "every item of 'messages' must be an object"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "'stream' must be true or false"
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            return f"'{field}' must be a positive integer"
    if "kv_transfer_params" in body and not isinstance(body["kv_transfer_params"], dict):
        return "'kv_transfer_params' must be an object"
    return None


def prefill_request(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """The P leg: compute the prompt's KV and one token, and keep the KV for a remote decode.
    Streaming options are dropped because P answers in one JSON reply."""
    request = dict(body)
    request["max_tokens"] = 1
    if kind == CHAT and "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    request["stream"] = False
    request.pop("stream_options", None)
    # vLLM refuses min_tokens > max_tokens, and P only ever makes one token
    request.pop("min_tokens", None)
    request["kv_transfer_params"] = {"do_remote_decode": True}
    return request


# The D leg: the original request + P's kv_transfer_params.
def decode_request(
    body: dict[str, Any], kv_transfer_params: dict[str, Any] | None
) -> dict[str, Any]:
    """The D leg: the original request, plus where P left the KV (when P said so)."""
    request = dict(body)
    if kv_transfer_params is not None:
        request["kv_transfer_params"] = kv_transfer_params
    return request


def error_type_for(status: int) -> str:
    if status == 400:
        return "invalid_request_error"
    if status == 404:
        return "not_found_error"
    if status == 502:
        return "bad_gateway"
    if status == 503:
        return "service_unavailable"
    if status == 504:
        return "timeout"
    return "server_error" if status >= 500 else "invalid_request_error"


# OpenAI's error JSON.
def error_body(status: int, message: str, type_: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_ or error_type_for(status),
            "param": None,
            "code": status,
        }
    }


def upstream_error(status: int, raw: bytes) -> tuple[str, str]:
    """``(message, type)`` from an upstream error reply.  vLLM answers either
    ``{"error": {...}}`` or, in older versions, the fields at the top level; anything
    else is passed on as text."""
    text = raw.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        source = inner if isinstance(inner, dict) else parsed
        message = source.get("message")
        if isinstance(message, str):
            type_ = source.get("type")
            return message, type_ if isinstance(type_, str) else error_type_for(status)
        if isinstance(inner, str):
            return inner, error_type_for(status)
    return (text.strip()[:4000] or f"upstream answered HTTP {status}"), error_type_for(status)


def stream_error_event(status: int, message: str, type_: str | None = None) -> bytes:
    """An SSE event with an error, for failures after the 200 and the first chunks have
    gone out.  No ``[DONE]`` follows it, so even a client that ignores the error sees that
    the stream did not finish."""
    return b"data: " + json.dumps(error_body(status, message, type_)).encode() + b"\n\n"
