"""The pure decoders of every wire, fuzzed: a message or a ProtocolError, nothing else.

For each codec (master RPC both ways, data plane both ways, P→D pulls both ways, the
store connector's lookup channel both ways):

- a body decodes into one of the wire's message types, or raises
  :class:`~kvpool.errors.ProtocolError` (never another exception); what decodes encodes
  back to the same message;
- a header is accepted exactly when its magic is right and its sizes are within the
  codec's limits;
- :class:`~kvpool.protocol.codec.FrameDecoder` gives the same events however the stream
  is cut into chunks: each good frame's message, a ProtocolError per bad body (and it goes
  on), and after a bad header an error on every later call.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ProtocolError
from kvpool.protocol.codec import HEADER_SIZE, MAGIC, FrameDecoder
from tests.fuzz.frames import (
    FUZZ,
    Wire,
    body_bytes,
    header,
    junk_bodies,
    mutated_frames,
    split_points,
)
from tests.fuzz.wires import WIRES

pytestmark = pytest.mark.timeout(120)


def members(wire: Wire) -> tuple[type, ...]:
    return typing.get_args(wire.message_type) or (wire.message_type,)


@pytest.mark.parametrize("wire", WIRES, ids=repr)
@FUZZ
@given(data=st.data())
def test_a_body_is_a_message_or_a_protocol_error(wire: Wire, data: st.DataObject) -> None:
    body = data.draw(body_bytes(wire))
    try:
        message = wire.codec.decode_body(body)
    except ProtocolError:
        return
    assert isinstance(message, members(wire))
    encoded = msgspec.msgpack.encode(message)  # bytes, not ==: a NaN is not equal to itself
    assert msgspec.msgpack.encode(wire.codec.decode_body(encoded)) == encoded


@pytest.mark.parametrize("wire", WIRES, ids=repr)
@FUZZ
@given(
    magic=st.sampled_from([MAGIC]) | st.binary(min_size=4, max_size=4),
    body_length=st.integers(0, 2**32 - 1),
    payload_length=st.integers(0, 2**32 - 1),
)
def test_a_header_is_accepted_exactly_within_the_limits(
    wire: Wire, magic: bytes, body_length: int, payload_length: int
) -> None:
    codec = wire.codec
    valid = (
        magic == MAGIC and 0 < body_length <= codec.max_body and payload_length <= codec.max_payload
    )
    raw = header(body_length, payload_length, magic)
    if valid:
        assert codec.parse_header(raw) == (body_length, payload_length)
    else:
        with pytest.raises(ProtocolError):
            codec.parse_header(raw)


@pytest.mark.parametrize("wire", WIRES, ids=repr)
@FUZZ
@given(data=st.data())
def test_short_or_long_headers_are_protocol_errors(wire: Wire, data: st.DataObject) -> None:
    raw = data.draw(st.binary(max_size=40).filter(lambda b: len(b) != HEADER_SIZE))
    with pytest.raises(ProtocolError):
        wire.codec.parse_header(raw)


def events(wire: Wire, chunks: list[bytes]) -> list[Any]:
    """What a FrameDecoder yields for ``chunks``: messages, payloads and errors in order;
    ``"broken"`` once it refuses to go on (a bad header)."""
    decoder: FrameDecoder[Any] = FrameDecoder(wire.codec)
    out: list[Any] = []
    for chunk in chunks:
        try:
            decoder.feed(chunk)
        except ProtocolError:
            out.append("broken")
            return out
        while True:
            try:
                frame = decoder.next_frame()
            except ProtocolError as exc:
                if _broken(decoder):
                    out.append("broken")
                    return out
                out.append(("error", type(exc)))
                continue
            if frame is None:
                break
            out.append((frame.message, frame.payload))
    return out


def _broken(decoder: FrameDecoder[Any]) -> bool:
    try:
        decoder.feed(b"")
    except ProtocolError:
        return True
    return False


@pytest.mark.parametrize("wire", WIRES, ids=repr)
@settings(FUZZ, max_examples=100)  # streams of up to five frames: the slowest to draw
@given(data=st.data())
def test_the_stream_decoder_does_not_care_how_the_stream_is_cut(
    wire: Wire, data: st.DataObject
) -> None:
    frames = data.draw(st.lists(mutated_frames(wire, payload_room=64), min_size=1, max_size=5))
    stream = b"".join(frames)
    whole = events(wire, [stream])
    chunked = events(wire, data.draw(split_points(stream)))
    assert chunked == whole
    for event in whole:
        assert event == "broken" or event[0] == "error" or isinstance(event[0], members(wire))


@pytest.mark.parametrize("wire", WIRES, ids=repr)
@FUZZ
@given(data=st.data())
def test_a_bad_body_costs_only_its_own_frame(wire: Wire, data: st.DataObject) -> None:
    bad = data.draw(junk_bodies(wire).filter(lambda b: not _decodes(wire, b)))
    good = data.draw(st.sampled_from(wire.samples))
    body = msgspec.msgpack.encode(good)
    stream = header(len(bad), 0) + bad + header(len(body), 0) + body if bad else b""
    if not stream:  # an empty body is a bad *header* (length 0): covered above
        return
    got = events(wire, data.draw(split_points(stream)))
    assert got == [("error", ProtocolError), (good, b"")]


def _decodes(wire: Wire, body: bytes) -> bool:
    try:
        wire.codec.decode_body(body)
    except ProtocolError:
        return False
    return True
