"""A first token that ends inside a character, with a byte-level BPE tokenizer made here
whose tokens split CJK characters and emoji: D's first text, detokenized after a prompt
that ends inside a character (as vLLM primes its ``DecodeStream``), is mended so that the
spliced answer reads exactly as a plain instance's stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvpool.ops.up.tiny_model import TinyModelSpec, train_tokenizer
from kvpool.proxy.first_token import can_mend, decode_request, first_token, mended_text
from kvpool.proxy.openai import CHAT, COMPLETIONS
from kvpool.proxy.splice import DONE, Splice

ANSWER = "世界 😀 字 the pool"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(TinyModelSpec(), path)
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def stream(tok: Tokenizer, prompt: list[int], answer: list[int]) -> list[str]:
    """Each token's text as vLLM streams it (None: held back, sent as "")."""
    s = DecodeStream(ids=prompt, skip_special_tokens=True)
    return [s.step(tok, t) or "" for t in answer]


def split_case(tok: Tokenizer) -> tuple[list[int], list[int]]:
    prompt = tok.encode("the pool serves ").ids
    answer = tok.encode(ANSWER).ids
    assert tok.decode(answer[:1]).endswith("\ufffd"), "the first token must split a character"
    return prompt, answer


def event(kind: str, text: str, ids: list[int], finish: str | None = None) -> bytes:
    if kind == COMPLETIONS:
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
    else:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    choice["token_ids"] = ids
    return b"data: " + msgspec.json.encode({"id": "d", "choices": [choice]}) + b"\n\n"


def p_reply(kind: str, prompt: list[int], token: int) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "token_ids": [token]}
    reply: dict[str, Any] = {"id": "p", "created": 1, "model": "m", "choices": [choice]}
    if kind == COMPLETIONS:
        choice.update(text="", prompt_token_ids=prompt)
    else:
        choice["message"] = {"role": "assistant", "content": ""}
        reply["prompt_token_ids"] = prompt
    return reply


def texts(kind: str, out: bytes) -> str:
    joined = ""
    for raw in out.split(b"\n\n"):
        if not raw.startswith(b"data: {"):
            continue
        obj = msgspec.json.decode(raw[6:])
        for choice in obj.get("choices") or []:
            assert "token_ids" not in choice, "the proxy's own token ids reached the client"
            piece = choice.get("text") if kind == COMPLETIONS else choice["delta"].get("content")
            joined += piece or ""
    return joined


def test_vllms_priming_puts_the_prompt_in_ds_first_text(tok: Tokenizer) -> None:
    # the behaviour being mended: D primed with P's split token sends the prompt's text
    prompt, answer = split_case(tok)
    plain = stream(tok, prompt, answer)
    d = stream(tok, [*prompt, answer[0]], answer[1:])
    assert "".join(plain) == ANSWER
    assert "".join(d).startswith(tok.decode(prompt)) and "".join(d) != ANSWER


@pytest.mark.parametrize("kind", [COMPLETIONS, CHAT])
def test_the_spliced_stream_reads_as_a_plain_instances(tok: Tokenizer, kind: str) -> None:
    prompt, answer = split_case(tok)
    first = first_token(kind, p_reply(kind, prompt, answer[0]))
    assert first is not None and first.split and first.text == ""
    body = {"model": "m", "stream": True, "max_tokens": 50}
    splice = Splice(kind, body, first)
    out = splice.head(ends=False)
    mends = 0
    for token, piece in zip(answer[1:], stream(tok, [*prompt, answer[0]], answer[1:]), strict=True):
        out += splice.feed(event(kind, piece, [token]))
        while splice.wants is not None:
            ids, seen = splice.wants
            assert ids == answer[: len(ids)]  # P's token, then D's so far
            mended = mended_text(seen, tok.decode(ids))  # what vLLM's /detokenize answers
            assert mended is not None
            out += splice.mend(mended)
            mends += 1
    out += splice.feed(DONE)
    assert mends == 1 and out.endswith(DONE)
    assert texts(kind, out) == "".join(stream(tok, prompt, answer)) == ANSWER


def test_d_is_asked_for_its_token_ids_only_for_a_split_token(tok: Tokenizer) -> None:
    prompt, answer = split_case(tok)
    first = first_token(COMPLETIONS, p_reply(COMPLETIONS, prompt, answer[0]))
    assert first is not None
    d = decode_request(COMPLETIONS, {"prompt": "x", "max_tokens": 9}, first)
    assert d["return_token_ids"] is True and d["prompt"] == [*prompt, answer[0]]


def test_mending_checks_what_it_replaces() -> None:
    assert mended_text("the prompt 世", "世") == "世"
    # a tokenizer whose lone tokens decode otherwise: the prompt's text is cut instead
    assert mended_text("the prompt 世", "▁世") is None  # the prompt's text is needed
    assert mended_text("the prompt 世", "▁世", "the prompt ") == "世"
    # P's token was BOS (no text, skipped): D's detokenizer was primed as usual
    assert mended_text("psneeds", "<s>psneeds", "<s>the prompt ") == "psneeds"


def test_what_d_matched_against_its_first_text_takes_the_sequential_way() -> None:
    assert can_mend({"prompt": "x"})
    assert not can_mend({"prompt": "x", "stop": ["\n"]})
    assert not can_mend({"prompt": "x", "logprobs": 2})
