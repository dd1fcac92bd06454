"""The first-token split's pure parts: P's and D's requests, and one answer from both."""

from __future__ import annotations

from typing import Any

import msgspec

from kvpool.proxy.first_token import (
    decode_request,
    ends_the_answer,
    first_token,
    fix_usage,
    merge_whole,
    p_only_reply,
    prefill_request_for,
    refusal,
    splittable,
)
from kvpool.proxy.openai import CHAT, COMPLETIONS
from kvpool.proxy.splice import DONE, Splice
from kvpool.proxy.stops import StopAcross, straddling_stop


def p_reply(text: str = " Hel", finish: str = "length", kind: str = COMPLETIONS) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": [7],
                              "stop_reason": None}  # fmt: skip
    reply: dict[str, Any] = {"id": "cmpl-r", "created": 1, "model": "m",
                             "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                       "total_tokens": 4},
                             "kv_transfer_params": {"remote_request_id": "r"}}  # fmt: skip
    if kind == COMPLETIONS:
        choice.update(text=text, prompt_token_ids=[1, 2, 3])
    else:
        choice["message"] = {"role": "assistant", "content": text}
        reply["prompt_token_ids"] = [1, 2, 3]
    reply["choices"] = [choice]
    return reply


def test_several_answers_are_refused_with_the_field_named() -> None:
    assert refusal({"n": 2}) is not None and "'n' must be 1" in str(refusal({"n": 2}))
    assert "'best_of'" in str(refusal({"best_of": 3}))
    assert refusal({"n": 1, "prompt": "x"}) is None


def test_what_d_cannot_continue_takes_the_sequential_path() -> None:
    assert splittable(COMPLETIONS, {"prompt": "x"})
    assert splittable(COMPLETIONS, {"prompt": [1, 2]})
    assert not splittable(COMPLETIONS, {"prompt": ["a", "b"]})  # a batch
    assert not splittable(COMPLETIONS, {"prompt": "x", "echo": True})
    assert not splittable(COMPLETIONS, {"prompt": "x", "presence_penalty": 0.5})
    assert not splittable(CHAT, {"messages": [], "response_format": {"type": "json_object"}})
    assert not splittable(CHAT, {"messages": [], "tools": [{}]})
    assert splittable(CHAT, {"messages": [], "tools": [{}], "tool_choice": "none"})


def test_p_is_asked_for_token_ids_and_a_one_token_answer_keeps_no_kv() -> None:
    p = prefill_request_for(COMPLETIONS, {"prompt": "x", "max_tokens": 5, "min_tokens": 3})
    assert p["return_token_ids"] is True and p["max_tokens"] == 1 and p["min_tokens"] == 1
    assert p["kv_transfer_params"] == {"do_remote_decode": True}
    one = prefill_request_for(CHAT, {"messages": [], "max_completion_tokens": 1})
    assert "kv_transfer_params" not in one


def test_d_continues_from_the_prompt_ids_plus_ps_token() -> None:
    first = first_token(COMPLETIONS, p_reply())
    assert first is not None and not ends_the_answer(COMPLETIONS, {"max_tokens": 5}, first)
    d = decode_request(COMPLETIONS, {"prompt": "x", "max_tokens": 5, "min_tokens": 3}, first)
    assert d["prompt"] == [1, 2, 3, 7] and d["max_tokens"] == 4 and d["min_tokens"] == 2
    assert d["kv_transfer_params"] == {"remote_request_id": "r"}
    chat = first_token(CHAT, p_reply(kind=CHAT))
    assert chat is not None
    d = decode_request(CHAT, {"messages": [{"role": "user", "content": "x"}]}, chat)
    assert d["kv_transfer_params"]["prompt_token_ids"] == [1, 2, 3, 7]
    assert "max_tokens" not in d  # no cap: vLLM's default reaches the same end


def test_a_token_inside_a_multibyte_character_shows_no_text_yet() -> None:
    for text, split in ((" Hel", False), ("", True), ("ab\ufffd", True)):
        first = first_token(COMPLETIONS, p_reply(text))
        assert first is not None and first.split is split
        assert first.text == ("" if split else text)
        d = decode_request(COMPLETIONS, {"prompt": "x", "max_tokens": 5}, first)
        assert d.get("return_token_ids", False) is split  # D's ids, to mend its first text


def test_a_reply_without_token_ids_is_not_a_first_token() -> None:
    reply = p_reply()
    del reply["choices"][0]["token_ids"]
    assert first_token(COMPLETIONS, reply) is None


def test_p_ends_the_answer_on_a_stop_or_at_max_tokens_one() -> None:
    stopped = first_token(COMPLETIONS, p_reply(finish="stop"))
    assert stopped is not None and ends_the_answer(COMPLETIONS, {}, stopped)
    capped = first_token(COMPLETIONS, p_reply())
    assert capped is not None and ends_the_answer(COMPLETIONS, {"max_tokens": 1}, capped)
    alone = p_only_reply(COMPLETIONS, {}, capped)
    assert alone["kv_transfer_params"] is None and "token_ids" not in alone["choices"][0]


def test_usage_counts_ps_token_as_output() -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}
    assert fix_usage(usage) == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}


def test_whole_answers_merge_text_logprobs_and_ids() -> None:
    p = p_reply()
    p["choices"][0]["logprobs"] = {"tokens": [" Hel"], "token_logprobs": [-1.0],
                                   "top_logprobs": [None], "text_offset": [0]}  # fmt: skip
    first = first_token(COMPLETIONS, p)
    assert first is not None
    d = {"choices": [{"index": 0, "text": "lo", "finish_reason": "length", "token_ids": [8],
                      "prompt_token_ids": [1, 2, 3, 7],
                      "logprobs": {"tokens": ["lo"], "token_logprobs": [-2.0],
                                   "top_logprobs": [None], "text_offset": [0]}}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}  # fmt: skip
    out = merge_whole(COMPLETIONS, {"return_token_ids": True}, first, d)
    choice = out["choices"][0]
    assert choice["text"] == " Hello" and choice["token_ids"] == [7, 8]
    assert choice["prompt_token_ids"] == [1, 2, 3]
    assert choice["logprobs"]["text_offset"] == [0, 4]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_a_stop_string_across_the_two_texts_cuts_the_whole_answer() -> None:
    first = first_token(COMPLETIONS, p_reply(" Hel"))
    assert first is not None
    d = {"choices": [{"index": 0, "text": "lo world", "finish_reason": "length"}]}
    out = merge_whole(COMPLETIONS, {"stop": "llo"}, first, d)
    assert out["choices"][0]["text"] == " He"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["stop_reason"] == "llo"
    assert straddling_stop(" Hel", "lo", ["xyz"]) is None


def test_streaming_holds_back_only_what_may_begin_a_stop() -> None:
    watch = StopAcross("Hello a", ["ab"], include_stop=False)
    assert watch.first_out == "Hello "
    assert watch.feed("b c") == ("", "ab")
    watch = StopAcross("Hello a", ["ab"], include_stop=False)
    assert watch.feed("x") == ("ax", None) and not watch.active
    assert StopAcross("Hello", ["zz"], include_stop=False).first_out == "Hello"


def _events(data: bytes) -> list[Any]:
    out = []
    for raw in data.split(b"\n\n"):
        if raw.startswith(b"data: "):
            body = raw[len(b"data: ") :]
            out.append(body.decode() if body == b"[DONE]" else msgspec.json.decode(body))
    return out


def test_a_chat_stream_opens_with_ps_token_and_drops_ds_role_event() -> None:
    first = first_token(CHAT, p_reply(kind=CHAT))
    assert first is not None
    body = {"stream": True, "stream_options": {"include_usage": True}}
    splice = Splice(CHAT, body, first)
    head = _events(splice.head(ends=False))
    assert head[0]["choices"][0]["delta"]["role"] == "assistant"
    assert head[1]["choices"][0]["delta"]["content"] == " Hel"
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None}]}  # fmt: skip
    piece = {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1,
                                      "total_tokens": 5}}  # fmt: skip
    d = b"".join(b"data: " + msgspec.json.encode(e) + b"\n\n" for e in (role, piece, usage))
    # split mid-event: D's bytes arrive in arbitrary pieces
    out = _events(splice.feed(d[:30]) + splice.feed(d[30:] + DONE))
    assert [e if e == "[DONE]" else e["choices"] for e in out][:2] == [piece["choices"], []]
    assert out[1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert out[-1] == "[DONE]" and splice.done


def test_a_stream_cut_by_a_straddling_stop_ends_with_usage_and_done() -> None:
    first = first_token(COMPLETIONS, p_reply(" Hel"))
    assert first is not None
    body = {"stream": True, "stop": ["llo"], "stream_options": {"include_usage": True}}
    splice = Splice(COMPLETIONS, body, first)
    assert _events(splice.head(ends=False))[0]["choices"][0]["text"] == " He"
    piece = {"choices": [{"index": 0, "text": "lo", "finish_reason": None}]}
    out = _events(splice.feed(b"data: " + msgspec.json.encode(piece) + b"\n\n"))
    assert out[0]["choices"][0]["text"] == ""
    assert out[0]["choices"][0]["finish_reason"] == "stop"
    assert out[1]["usage"]["completion_tokens"] == 2 and out[-1] == "[DONE]"
    assert splice.done
