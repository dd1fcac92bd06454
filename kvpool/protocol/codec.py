"""Framing for kvpool's request/response RPC over a byte stream (pure: no sockets).

A frame is a 12-byte header (``"KVP1"``, body length u32, payload length u32, big-endian),
a msgpack body (one typed struct of a tagged union), and an optional raw payload that a
receiver can ``recv_into`` straight into its destination buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from kvpool.errors import ProtocolError

__all__ = [
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_PAYLOAD",
    "HEADER_SIZE",
    "MAGIC",
    "Codec",
    "Frame",
    "FrameDecoder",
    "FrameHeader",
]

# A frame is a fixed 12-byte header, a msgpack body, and an optional raw payload::
#
#     +--------+----------------+-------------------+----------------+-------------------+
#     | "KVP1" | body length u32 | payload length u32 | body (msgpack) | payload (raw)     |
#     +--------+----------------+-------------------+----------------+-------------------+
#       4 B        4 B, big-endian   4 B, big-endian     body length      payload length
#
# The body is one typed :class:`msgspec.Struct` from a tagged union (``tag=True``), so
# the receiver knows the message type from the body alone.  The payload is *not*
# msgpack: it is the value's bytes, declared in the header so a receiver can
# ``recv_into`` it straight into its destination buffer (a segment, a tensor) with no
# intermediate copy.
#
# Invariants:
#
# - The magic doubles as the version marker: a peer speaking another version is
#   rejected on its first frame, never misparsed.
# - Limits are checked on the header, before any body or payload byte is buffered, so an
#   oversized frame costs the receiver 12 bytes of memory.  A receiver whose requests never
#   carry a payload (the master's RPC, the lookup socket, P->D pull requests) sets
#   ``max_payload=0``, so a header announcing one is refused at once instead of buffered.
# - Every decoding failure (bad magic, oversized, truncated msgpack, wrong field types,
#   unknown message tag) raises :class:`kvpool.errors.ProtocolError` with a message that
#   says which.
MAGIC = b"KVP1"
_HEADER = struct.Struct("!4sII")
HEADER_SIZE = _HEADER.size
# Bodies carry metadata only (keys, offsets, a few hundred keys in a batch), so 4 MiB
# is generous; anything larger is a bug or an attack.
DEFAULT_MAX_BODY = 4 << 20
# One payload is one object; 1 GiB bounds what a malicious header can make us wait for.
DEFAULT_MAX_PAYLOAD = 1 << 30

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The decoded fixed header: how many body and payload bytes follow."""

    body_length: int
    payload_length: int


@dataclass(frozen=True, slots=True)
class Frame(Generic[M]):
    """One complete frame from :class:`FrameDecoder`: the message and its raw payload."""

    message: M
    payload: bytes = b""


class Codec(Generic[M]):
    """Encode and decode frames whose bodies are one of ``message_type``.

    ``message_type`` is a tagged :class:`msgspec.Struct` class or a union of them
    (``A | B``).  Decoders and encoders are built once here and reused.
    """

    def __init__(
        self,
        message_type: Any,
        *,
        max_body: int = DEFAULT_MAX_BODY,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        if max_body <= 0 or max_payload < 0:
            raise ValueError("max_body must be > 0 and max_payload >= 0")
        self.max_body = max_body
        self.max_payload = max_payload
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: M, payload_length: int = 0) -> bytes:
        """Header + body for ``message``; the caller sends ``payload_length`` bytes after it."""
        if not 0 <= payload_length <= self.max_payload:
            raise ProtocolError(
                f"payload of {payload_length} bytes exceeds the limit of {self.max_payload}"
            )
        body = self._encoder.encode(message)
        if len(body) > self.max_body:
            raise ProtocolError(f"message body of {len(body)} bytes exceeds {self.max_body}")
        return _HEADER.pack(MAGIC, len(body), payload_length) + body

    def decode_header(self, data: bytes | bytearray | memoryview) -> FrameHeader:
        """Parse and check the fixed header (exactly :data:`HEADER_SIZE` bytes)."""
        return FrameHeader(*self.parse_header(data))

    def parse_header(self, data: bytes | bytearray | memoryview) -> tuple[int, int]:
        """:meth:`decode_header` as a bare ``(body_length, payload_length)`` tuple (hot path)."""
        if len(data) != HEADER_SIZE:
            raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
        magic, body_length, payload_length = _HEADER.unpack(data)
        if magic != MAGIC:
            raise ProtocolError(
                f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): "
                "not a kvpool peer, or another protocol version"
            )
        if body_length == 0:
            raise ProtocolError("frame has an empty body")
        if body_length > self.max_body:
            raise ProtocolError(
                f"frame body of {body_length} bytes exceeds the limit of {self.max_body}"
            )
        if payload_length > self.max_payload:
            if not self.max_payload:
                raise ProtocolError(
                    f"frame announces a payload of {payload_length} bytes, but these "
                    "requests carry none"
                )
            raise ProtocolError(
                f"frame payload of {payload_length} bytes exceeds the limit of {self.max_payload}"
            )
        return body_length, payload_length

    def decode_body(self, body: bytes | bytearray | memoryview) -> M:
        """Decode a body into its typed message; any failure is a :class:`ProtocolError`."""
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            # Covers unknown tags ("Invalid value 'Foo' - at `$.type`") and wrong field types.
            raise ProtocolError(f"invalid message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable message body: {exc}") from None


# - :class:`FrameDecoder` holds at most one partial frame (header + ``max_body`` +
#   ``max_payload``) plus the bytes of one ``feed``: the caller bounds what it feeds, and
#   stops feeding while it cannot write replies (see the master's RPC protocol).
class FrameDecoder(Generic[M]):
    """Incremental frame decoder: feed stream bytes, take complete frames out.

    Sans-I/O, for asyncio protocols and streams::

        decoder = FrameDecoder(codec)
        decoder.feed(data)
        for frame in decoder.frames():
            handle(frame.message, frame.payload)

    After a bad *header* (magic, limits) the stream cannot be resynchronised: the
    decoder stays broken (every later call raises again) and the connection should be
    closed.  A bad *body* only costs that one frame.
    """

    def __init__(self, codec: Codec[M]) -> None:
        self._codec = codec
        self._buffer = bytearray()
        self._header: FrameHeader | None = None
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as part of a frame."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes; decoding happens in :meth:`frames`."""
        if self._error is not None:
            raise self._error
        self._buffer += data

    def next_frame(self) -> Frame[M] | None:
        """The next complete frame, or ``None`` when more bytes are needed.

        A bad body (unknown tag, wrong types) raises :class:`ProtocolError` after the
        frame has been consumed, so the caller may reply with an error and go on.
        """
        if self._error is not None:
            raise self._error
        if self._header is None:
            if len(self._buffer) < HEADER_SIZE:
                return None
            try:
                self._header = self._codec.decode_header(bytes(self._buffer[:HEADER_SIZE]))
            except ProtocolError as exc:
                self._error = exc
                raise
            del self._buffer[:HEADER_SIZE]
        header = self._header
        total = header.body_length + header.payload_length
        if len(self._buffer) < total:
            return None
        # Copies, not views: a live memoryview would pin the bytearray and make the
        # `del` below fail; bodies are small and payloads here are control-plane sized.
        body = bytes(self._buffer[: header.body_length])
        payload = bytes(self._buffer[header.body_length : total])
        del self._buffer[:total]
        self._header = None
        return Frame(self._codec.decode_body(body), payload)

    def frames(self) -> list[Frame[M]]:
        """Every complete frame buffered so far (possibly none)."""
        out: list[Frame[M]] = []
        while (frame := self.next_frame()) is not None:
            out.append(frame)
        return out
