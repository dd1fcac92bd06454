from __future__ import annotations

import asyncio
import struct

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import ProtocolError
from kvpool.protocol.codec import HEADER_SIZE, MAGIC, Codec, Frame, FrameDecoder


class Ping(msgspec.Struct, tag=True):
    n: int


class Note(msgspec.Struct, tag=True):
    text: str


class Unknown(msgspec.Struct, tag=True):
    x: int


Msg = Ping | Note
codec: Codec[Msg] = Codec(Msg, max_body=1024, max_payload=4096)


def header(magic: bytes, body: int, payload: int) -> bytes:
    return struct.pack("!4sII", magic, body, payload)


def test_encode_then_decode_round_trips_message_and_payload_length() -> None:
    data = codec.encode(Ping(7), payload_length=3)
    parsed = codec.decode_header(data[:HEADER_SIZE])
    assert data[:4] == MAGIC
    assert parsed.payload_length == 3
    assert parsed.body_length == len(data) - HEADER_SIZE
    assert codec.decode_body(data[HEADER_SIZE:]) == Ping(7)


def test_bad_magic_is_a_protocol_error_naming_it() -> None:
    with pytest.raises(ProtocolError, match="bad frame magic"):
        codec.decode_header(header(b"HTTP", 4, 0))


def test_oversized_body_and_payload_are_refused_from_the_header() -> None:
    with pytest.raises(ProtocolError, match="body of 1025 bytes exceeds"):
        codec.decode_header(header(MAGIC, 1025, 0))
    with pytest.raises(ProtocolError, match="payload of 4097 bytes exceeds"):
        codec.decode_header(header(MAGIC, 10, 4097))
    with pytest.raises(ProtocolError, match="empty body"):
        codec.decode_header(header(MAGIC, 0, 0))


def test_encoding_a_too_large_message_or_payload_is_refused() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.encode(Note("x" * 2000))
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.encode(Ping(1), payload_length=5000)


def test_unknown_tag_and_garbage_bodies_are_protocol_errors() -> None:
    other: Codec[Unknown] = Codec(Unknown)
    body = other.encode(Unknown(1))[HEADER_SIZE:]
    with pytest.raises(ProtocolError, match="invalid message"):
        codec.decode_body(body)
    with pytest.raises(ProtocolError, match="undecodable"):
        codec.decode_body(b"\xc1\xc1")
    with pytest.raises(ProtocolError, match="invalid message"):
        codec.decode_body(msgspec.msgpack.encode({"type": "Ping", "n": "seven"}))


def test_incremental_decoder_handles_byte_by_byte_feeding() -> None:
    stream = codec.encode(Ping(1), 2) + b"ab" + codec.encode(Note("hi"))
    decoder = FrameDecoder(codec)
    frames: list[Frame[Msg]] = []
    for i in range(len(stream)):
        decoder.feed(stream[i : i + 1])
        frames.extend(decoder.frames())
    assert frames == [Frame(Ping(1), b"ab"), Frame(Note("hi"), b"")]
    assert decoder.buffered == 0


def test_decoder_survives_a_bad_body_but_not_a_bad_header() -> None:
    other: Codec[Unknown] = Codec(Unknown)
    decoder = FrameDecoder(codec)
    decoder.feed(other.encode(Unknown(1), 0) + codec.encode(Ping(2)))
    with pytest.raises(ProtocolError):
        decoder.next_frame()
    assert decoder.next_frame() == Frame(Ping(2), b"")

    decoder.feed(header(b"XXXX", 1, 0))
    with pytest.raises(ProtocolError, match="magic"):
        decoder.next_frame()
    with pytest.raises(ProtocolError, match="magic"):
        decoder.feed(codec.encode(Ping(3)))


def test_decoder_rejects_oversized_frame_before_buffering_it() -> None:
    decoder = FrameDecoder(codec)
    decoder.feed(header(MAGIC, 10, 10**9))
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.frames()


@given(
    st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.binary(max_size=64)), max_size=8),
    st.integers(1, 50),
)
def test_any_chunking_of_a_stream_yields_the_same_frames(
    items: list[tuple[int, bytes]], chunk: int
) -> None:
    stream = b"".join(codec.encode(Ping(n), len(p)) + p for n, p in items)
    decoder = FrameDecoder(codec)
    frames: list[Frame[Msg]] = []
    for i in range(0, len(stream), chunk):
        decoder.feed(stream[i : i + chunk])
        frames.extend(decoder.frames())
    assert frames == [Frame(Ping(n), p) for n, p in items]


def test_decoder_drives_an_asyncio_stream_over_a_real_socket() -> None:
    async def scenario() -> tuple[list[Frame[Msg]], list[Frame[Msg]]]:
        received: list[Frame[Msg]] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            decoder = FrameDecoder(codec)
            while data := await reader.read(7):  # tiny reads: frames span many chunks
                decoder.feed(data)
                for frame in decoder.frames():
                    received.append(frame)
                    writer.write(codec.encode(Note("ack")))
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(codec.encode(Ping(1), 3) + b"xyz" + codec.encode(Note("n")))
        await writer.drain()
        acks: list[Frame[Msg]] = []
        client = FrameDecoder(codec)
        while len(acks) < 2:
            client.feed(await reader.read(100))
            acks += client.frames()
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()
        return received, acks

    received, acks = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert received == [Frame(Ping(1), b"xyz"), Frame(Note("n"), b"")]
    assert acks == [Frame(Note("ack"), b"")] * 2


def test_a_payload_free_codec_refuses_any_payload_from_the_header() -> None:
    codec: Codec[Ping] = Codec(Ping, max_payload=0)
    with pytest.raises(ProtocolError, match="announces a payload of 1 bytes"):
        codec.decode_header(MAGIC + struct.pack("!II", 8, 1))
    assert codec.decode_header(MAGIC + struct.pack("!II", 8, 0)).payload_length == 0
