"""The client's stream when the answer starts with P's token: P's token as the first SSE
events, then D's events made to read as one answer.  Pure: bytes in, bytes out.

D's opening role-only chat event is dropped, usage counts P's token as output,
``text_offset`` moves past P's text, a stop string across the two texts ends the answer,
and after a split first token D's first text waits for its mending (:attr:`Splice.wants`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpool.proxy.first_token import FirstToken, fix_usage
from kvpool.proxy.openai import CHAT, COMPLETIONS
from kvpool.proxy.stops import StopAcross, stop_strings

__all__ = ["DONE", "Splice"]

DONE = b"data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class Splice:
    """One streamed answer: :meth:`head` once, then :meth:`feed` with D's bytes."""

    def __init__(self, kind: str, body: dict[str, Any], first: FirstToken) -> None:
        self.kind = kind
        self.body = body
        self.first = first
        options = body.get("stream_options")
        self._usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self._stops = StopAcross(
            first.text, stop_strings(body), bool(body.get("include_stop_str_in_output"))
        )
        self._buffer = b""
        self._d_pieces = 0  # D's events that carried text: its tokens, for a cut answer
        self.done = False
        # A split first token: the answer's token ids until D's first text, which is held
        # (``_held``) while the caller detokenizes ``wants`` = (those ids, D's text) and
        # hands back the mended text (:meth:`mend`).
        self._ids: list[int] | None = list(first.token_ids) if first.split else None
        self._held: dict[str, Any] | None = None
        self.wants: tuple[list[int], str] | None = None

    # -- P's part ----------------------------------------------------------------------

    def _base(self) -> dict[str, Any]:
        reply = self.first.reply
        obj = "text_completion" if self.kind == COMPLETIONS else "chat.completion.chunk"
        return {"id": reply.get("id"), "object": obj, "created": reply.get("created"),
                "model": reply.get("model")}  # fmt: skip

    def head(self, ends: bool) -> bytes:
        """P's token as the stream's first events; with ``ends`` the whole stream."""
        first, choice = self.first, self.first.reply["choices"][0]
        text = first.text if ends else self._stops.first_out
        finish = choice.get("finish_reason") if ends else None
        ids = bool(self.body.get("return_token_ids"))
        out = b""
        if self.kind == COMPLETIONS:
            stop_reason = choice.get("stop_reason") if ends else None
            c: dict[str, Any] = {"index": 0, "text": text, "logprobs": choice.get("logprobs"),
                                 "finish_reason": finish, "stop_reason": stop_reason}  # fmt: skip
            if ids:
                c.update(prompt_token_ids=first.prompt_token_ids, token_ids=first.token_ids)
            out += _event({**self._base(), "choices": [c]})
        else:
            role: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}  # fmt: skip
            opening = {**self._base(), "choices": [role]}
            if ids:
                opening["prompt_token_ids"] = first.prompt_token_ids
            c = {"index": 0, "delta": {"content": text}, "logprobs": choice.get("logprobs"),
                 "finish_reason": finish}  # fmt: skip
            if ends and choice.get("stop_reason") is not None:
                c["stop_reason"] = choice["stop_reason"]
            if ids:
                c["token_ids"] = first.token_ids
            out += _event(opening) + _event({**self._base(), "choices": [c]})
        if ends:
            out += self._tail(self.first.reply.get("usage"))
        return out

    def _tail(self, usage: Any) -> bytes:
        """The usage event (when asked for) and ``[DONE]``."""
        self.done = True
        if not self._usage:
            return DONE
        return _event({**self._base(), "choices": [], "usage": usage}) + DONE

    # -- D's part ----------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """D's next bytes → the client's; :attr:`done` once the answer has ended."""
        self._buffer += data
        out = b""
        while not self.done and self.wants is None and b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            out += self._one(raw)
        return out

    def _one(self, raw: bytes) -> bytes:
        line = raw.strip()
        if not line.startswith(b"data:"):
            return raw + b"\n\n" if line else b""
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return DONE
        try:
            obj = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            return raw + b"\n\n"
        if not isinstance(obj, dict) or "error" in obj:
            return raw + b"\n\n"
        if isinstance(obj.get("usage"), dict):
            obj["usage"] = fix_usage(obj["usage"], len(self.first.token_ids))
        obj.pop("prompt_token_ids", None)  # P's went out in the head
        choices = obj.get("choices") or []
        if self.kind == CHAT and choices and self._role_only(choices[0]):
            return b""
        if self._ids is not None and choices and self._hold(obj, choices[0]):
            return b""
        return self._rewrite(obj, choices)

    def mend(self, text: str) -> bytes:
        """The held event with D's first text replaced by ``text``, then whatever of D's
        bytes came after it."""
        obj, self._held, self.wants, self._ids = self._held, None, None, None
        assert obj is not None, "mend() without a held event"
        choice = obj["choices"][0]
        holder = choice if self.kind == COMPLETIONS else choice.get("delta") or {}
        holder["text" if self.kind == COMPLETIONS else "content"] = text
        return self._rewrite(obj, obj["choices"]) + self.feed(b"")

    def _hold(self, obj: dict[str, Any], choice: Any) -> bool:
        """Mending: count D's token ids; hold the event with D's first text."""
        assert self._ids is not None
        if not isinstance(choice, dict):
            return False
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self._ids.extend(ids)
        holder = choice if self.kind == COMPLETIONS else choice.get("delta") or {}
        piece = holder.get("text" if self.kind == COMPLETIONS else "content")
        if not isinstance(piece, str) or not piece:
            return False
        self._held, self.wants = obj, (list(self._ids), piece)
        return True

    def _rewrite(self, obj: dict[str, Any], choices: list[Any]) -> bytes:
        cut = None
        for choice in choices[:1]:
            choice.pop("prompt_token_ids", None)
            if not self.body.get("return_token_ids"):
                choice.pop("token_ids", None)  # asked for by the proxy (mending), not the client
            cut = self._choice(choice)
        if cut is not None:
            choices[0]["finish_reason"], choices[0]["stop_reason"] = "stop", cut
            obj.pop("usage", None)
            first = self.first.reply.get("usage") or {}
            prompt = first.get("prompt_tokens", 0)
            done = len(self.first.token_ids) + self._d_pieces
            usage = {"prompt_tokens": prompt, "completion_tokens": done,
                     "total_tokens": prompt + done}  # fmt: skip
            return _event(obj) + self._tail(usage)
        return _event(obj)

    @staticmethod
    def _role_only(choice: Any) -> bool:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        return (
            isinstance(delta, dict)
            and "role" in delta
            and not delta.get("content")
            and not delta.get("tool_calls")
            and choice.get("finish_reason") is None
        )

    def _choice(self, choice: dict[str, Any]) -> str | None:
        """Rewrite one choice of D's; the straddling stop string that ends it, if any."""
        holder: dict[str, Any] = choice if self.kind == COMPLETIONS else choice.get("delta") or {}
        key = "text" if self.kind == COMPLETIONS else "content"
        piece = holder.get(key)
        if isinstance(piece, str):
            if piece:
                self._d_pieces += 1
            final = choice.get("finish_reason") is not None
            holder[key], cut = self._stops.feed(piece, final)
            if cut is not None:
                return cut
        logprobs = choice.get("logprobs")
        if self.kind == COMPLETIONS and isinstance(logprobs, dict):
            offsets = logprobs.get("text_offset")
            if isinstance(offsets, list):
                shift = len(self.first.text)
                logprobs["text_offset"] = [o + shift for o in offsets]
        return None
