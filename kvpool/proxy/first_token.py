"""The answer starts with the prefill's token: what P and D are asked, and how their two
replies become the one a plain instance gives.  Pure: dicts in, dicts out.

D gets the prompt's token ids plus P's token and one token less to make, so it continues
the same answer from P's KV.  What D cannot continue (structured output, penalties on
output tokens, echo) is served the sequential way; n > 1 is refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvpool.proxy.openai import CHAT, COMPLETIONS, prefill_request
from kvpool.proxy.stops import stop_strings, straddling_stop

__all__ = [
    "FirstToken",
    "can_mend",
    "decode_request",
    "ends_the_answer",
    "first_token",
    "fix_usage",
    "mended_text",
    "merge_whole",
    "p_only_reply",
    "prefill_request_for",
    "refusal",
    "splittable",
]

# Fields whose meaning spans the whole answer in a way a continuation cannot honour: the
# constraint or parser state would restart at D's first token, or P's token would count
# as prompt instead of output.  Such requests take the sequential path.
_WHOLE_ANSWER = (
    "echo",
    "prompt_logprobs",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logits_processors",
)
_OUTPUT_PENALTIES = ("presence_penalty", "frequency_penalty")


def refusal(body: dict[str, Any]) -> str | None:
    """Why the proxy refuses the request (a 400), or ``None``.  Several answers to one
    prompt would each need their own first token and their own D request."""
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is not None and value != 1:
            return (
                f"'{field}' must be 1 through kvpool proxy (got {value!r}): each answer's "
                "first token comes from the prefill instance; send one request per answer"
            )
    if body.get("use_beam_search"):
        return "'use_beam_search' is not supported through kvpool proxy; send it to one instance"
    return None


def splittable(kind: str, body: dict[str, Any]) -> bool:
    """Whether D can continue P's answer token-identically to a plain instance."""
    if any(body.get(field) not in (None, False) for field in _WHOLE_ANSWER):
        return False
    if any(body.get(field) not in (None, 0, 0.0) for field in _OUTPUT_PENALTIES):
        return False
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return False
    if kind == CHAT:
        return not body.get("tools") or body.get("tool_choice") == "none"
    prompt = body.get("prompt")
    # one prompt only: a batch has one answer per prompt (a list of ints is one prompt)
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and all(type(t) is int for t in prompt)
    )


def _limit(kind: str, body: dict[str, Any]) -> int | None:
    """The client's cap on generated tokens (chat: vLLM prefers max_completion_tokens)."""
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        return int(body["max_completion_tokens"])
    value = body.get("max_tokens")
    return None if value is None else int(value)


def prefill_request_for(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """P's request: one token and, for the continuation, the prompt's token ids.  A
    one-token answer is P's alone, so then P is not asked to keep its KV for a D."""
    request = prefill_request(kind, body)
    request["return_token_ids"] = True
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens >= 1:
        request["min_tokens"] = 1  # P's token must not be EOS either
    if _limit(kind, body) == 1:
        request.pop("kv_transfer_params", None)
    return request


@dataclass(frozen=True, slots=True)
class FirstToken:
    """P's reply, as far as the continuation needs it."""

    reply: dict[str, Any]
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    # P's token ends inside a multi-byte character (byte-level BPE splits rarer CJK
    # characters and emoji): it shows no text yet, as on a plain instance, and D's first
    # text must be mended (:func:`mended_text`)
    split: bool = False


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(type(t) is int for t in value):
        return value
    return None


def first_token(kind: str, reply: Any) -> FirstToken | None:
    """P's token from its reply; ``None`` when the reply lacks the token ids (a vLLM
    without ``return_token_ids``), and the request then takes the sequential path."""
    try:
        choice = reply["choices"][0]
        if kind == COMPLETIONS:
            text, prompt_ids = choice["text"], _ints(choice.get("prompt_token_ids"))
        else:
            text, prompt_ids = (
                choice["message"].get("content"),
                _ints(reply.get("prompt_token_ids")),
            )
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    token_ids = _ints(choice.get("token_ids"))
    if not prompt_ids or token_ids is None:
        return None
    kv = reply.get("kv_transfer_params")
    text = text or ""
    # vLLM holds back a token's text until its character is whole: "" (or U+FFFD where
    # it flushed at the end) is a token inside a character
    split = bool(token_ids) and (not text or text.endswith("\ufffd"))
    return FirstToken(
        reply=reply,
        text="" if split else text,
        token_ids=token_ids,
        prompt_token_ids=prompt_ids,
        finish_reason=choice.get("finish_reason"),
        kv_transfer_params=kv if isinstance(kv, dict) else None,
        split=split,
    )


def ends_the_answer(kind: str, body: dict[str, Any], first: FirstToken) -> bool:
    """P's token is the whole answer: it stopped (EOS, a stop string or token), or the
    client asked for one token.  Then D is not called."""
    return first.finish_reason != "length" or _limit(kind, body) == 1 or not first.token_ids


def can_mend(body: dict[str, Any]) -> bool:
    """Whether D's answer can be mended after a split first token.  D's detokenizer, primed
    with a prompt that ends inside a character, gives its first text together with the
    whole prompt's (vLLM 0.32's DecodeStream priming): the proxy replaces that one piece
    (:func:`mended_text`), but D has already matched stop strings and counted logprob
    text offsets against it, so such requests take the sequential way."""
    return not stop_strings(body) and body.get("logprobs") in (None, False)


def mended_text(seen: str, tail: str | None, prompt: str | None = None) -> str | None:
    """D's first text as a plain instance gives it.  ``seen``: what D sent (the prompt's
    text, then the answer's); ``tail``: the answer's tokens so far detokenized on their
    own (P's and D's; None: not known); ``prompt``: the prompt's tokens detokenized.
    None: ``tail`` is not the end of ``seen`` and ``prompt`` is needed.  A ``seen`` that
    does not begin with the prompt's text needs no mending: P's token was a special one
    (BOS, skipped from the text, which is why it showed none), and D's detokenizer was
    primed as usual."""
    if tail is not None and seen.endswith(tail):
        return tail
    if prompt is None:
        return None
    return seen[len(prompt) :] if prompt and seen.startswith(prompt) else seen


def decode_request(kind: str, body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
    """D's request: the prompt plus P's token as token ids, one token less to make."""
    request = dict(body)
    for field in ("max_tokens", "max_completion_tokens"):
        if request.get(field) is not None:
            request[field] = int(request[field]) - len(first.token_ids)
    min_tokens = request.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        request["min_tokens"] = max(0, min_tokens - len(first.token_ids))
    ids = [*first.prompt_token_ids, *first.token_ids]
    if first.split:
        request["return_token_ids"] = True  # D's tokens, for mending its first text
    kv = dict(first.kv_transfer_params or {})
    if kind == COMPLETIONS:
        request["prompt"] = ids
    else:
        kv["prompt_token_ids"] = ids  # vLLM >= 0.30 then skips the chat template
    if kv:
        request["kv_transfer_params"] = kv
    else:
        request.pop("kv_transfer_params", None)
    return request


def fix_usage(usage: Any, moved: int = 1) -> Any:
    """D's usage as the whole answer's: P's token counts as output, not as prompt."""
    if not isinstance(usage, dict):
        return usage
    usage = dict(usage)
    for field, delta in (("prompt_tokens", -moved), ("completion_tokens", moved)):
        if isinstance(usage.get(field), int):
            usage[field] += delta
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        cap = usage.get("prompt_tokens", details["cached_tokens"])
        usage["prompt_tokens_details"] = dict(
            details, cached_tokens=min(details["cached_tokens"], cap)
        )
    return usage


def _strip_ids(body: dict[str, Any], container: dict[str, Any], choice: dict[str, Any]) -> None:
    """Token ids the proxy asked for on its own account stay out of the client's answer."""
    if not body.get("return_token_ids"):
        container.pop("prompt_token_ids", None)
        choice.pop("prompt_token_ids", None)
        choice.pop("token_ids", None)


def p_only_reply(kind: str, body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
    """The whole answer when P's token ends it."""
    reply = copy.deepcopy(first.reply)
    reply["kv_transfer_params"] = None
    _strip_ids(body, reply, reply["choices"][0])
    return reply


def merge_logprobs(kind: str, first: Any, then: Any, offset: int) -> Any:
    """P's logprobs followed by D's (completions: D's text offsets shifted past P's text)."""
    if not isinstance(first, dict) or not isinstance(then, dict):
        return first if then is None else then
    if kind == CHAT:
        return dict(then, content=[*(first.get("content") or []), *(then.get("content") or [])])
    merged = dict(then)
    for field in ("tokens", "token_logprobs", "top_logprobs"):
        merged[field] = [*(first.get(field) or []), *(then.get(field) or [])]
    merged["text_offset"] = [
        *(first.get("text_offset") or []),
        *(o + offset for o in then.get("text_offset") or []),
    ]
    return merged


def merge_whole(
    kind: str,
    body: dict[str, Any],
    first: FirstToken,
    d_reply: dict[str, Any],
    mended: str | None = None,
) -> dict[str, Any]:
    """One whole answer from P's token and D's whole reply (``mended``: the answer's
    whole text after a split first token, see :func:`mended_text`)."""
    reply = copy.deepcopy(d_reply)
    choice = reply["choices"][0]
    p_choice = first.reply["choices"][0]
    holder = choice if kind == COMPLETIONS else choice.setdefault("message", {})
    key = "text" if kind == COMPLETIONS else "content"
    then = (holder.get(key) or "") if mended is None else mended
    holder[key] = first.text + then
    hit = straddling_stop(first.text, then, stop_strings(body))
    if hit is not None:  # begun by P's token, so D could not see it
        at, stop = hit
        include = bool(body.get("include_stop_str_in_output"))
        holder[key] = holder[key][:at] + (stop if include else "")
        choice["finish_reason"], choice["stop_reason"] = "stop", stop
    if p_choice.get("logprobs") is not None or choice.get("logprobs") is not None:
        choice["logprobs"] = merge_logprobs(
            kind, p_choice.get("logprobs"), choice.get("logprobs"), len(first.text)
        )
    if body.get("return_token_ids"):
        if kind == COMPLETIONS:
            choice["prompt_token_ids"] = first.prompt_token_ids
        else:
            reply["prompt_token_ids"] = first.prompt_token_ids
        choice["token_ids"] = [*first.token_ids, *(choice.get("token_ids") or [])]
    _strip_ids(body, reply, choice)
    reply["usage"] = fix_usage(reply.get("usage"), len(first.token_ids))
    return reply
