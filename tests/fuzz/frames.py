"""Hypothesis strategies for kvpool's wire: valid frames and every kind of broken one.

A *wire* is one of kvpool's frame codecs (:mod:`kvpool.protocol.codec`) with the message
types it decodes and a few known-good messages.  :func:`mutated_frames` draws the bytes a
hostile or broken peer may send on it: random bytes, truncated frames, a wrong magic,
announced sizes at, within and beyond the limits, unknown tags, valid-but-wrong-typed
bodies, flipped bytes; and, as a control, valid frames.  Every fuzz test in this folder
draws from here, so the pure decoders and the real servers meet the same mutations.

The settings are shared too: bounded in examples, no per-example deadline (a real server
round trip on a loaded 2-core machine varies), no example database written into the tree.
"""

from __future__ import annotations

import itertools
import struct
import typing
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvpool.protocol.codec import MAGIC, Codec

__all__ = [
    "FUZZ",
    "FUZZ_SOCKET",
    "Wire",
    "body_bytes",
    "header",
    "json_like",
    "junk_bodies",
    "mutated_frames",
    "near_valid_bodies",
    "split_points",
    "tags_of",
    "typed_bodies",
]

#: pure decoders: cheap, so the full budget
FUZZ = settings(max_examples=200, deadline=None, database=None, print_blob=True)
#: real servers: each example is a connection and a well-formed check afterwards
FUZZ_SOCKET = settings(
    FUZZ,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_HEADER = struct.Struct("!4sII")


def header(body_length: int, payload_length: int, magic: bytes = MAGIC) -> bytes:
    return _HEADER.pack(magic, body_length, payload_length)


def tags_of(message_type: Any) -> dict[str, tuple[str, ...]]:
    """``{tag: field names}`` of every struct in a tagged union (or of one struct)."""
    members = typing.get_args(message_type) or (message_type,)
    return {cls.__struct_config__.tag: cls.__struct_fields__ for cls in members}


@dataclass(frozen=True)
class Wire:
    """One frame codec under test: its name, codec, message union and good examples."""

    name: str
    codec: Codec[Any]
    message_type: Any
    samples: tuple[Any, ...]

    @property
    def tags(self) -> dict[str, tuple[str, ...]]:
        return tags_of(self.message_type)

    def __repr__(self) -> str:  # pytest ids and hypothesis reports
        return self.name


#: any msgpack-encodable value, nested a little
json_like: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=24)
    | st.binary(max_size=24),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


_INTS = (
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)])
    | st.integers(min_value=-2, max_value=16)  # block ids, ranks, head counts, small sizes
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
)
_STRINGS = st.sampled_from(["", "seg0", "k", "a/b", "../x", "\0", "é" * 40]) | st.text(max_size=30)


def _typed(t: mi.Type, strings: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """Values of msgspec type ``t`` (any value, right type): edge-case ints and names."""
    if isinstance(t, mi.StrType):
        return strings
    if isinstance(t, mi.IntType):
        return _INTS
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.FloatType):
        return st.floats()
    if isinstance(t, mi.ListType):
        return st.lists(_typed(t.item_type, strings), max_size=6)
    if isinstance(t, mi.TupleType):
        return st.tuples(*(_typed(i, strings) for i in t.item_types)).map(list)
    if isinstance(t, mi.DictType):
        keys, values = _typed(t.key_type, strings), _typed(t.value_type, strings)
        return st.dictionaries(keys, values, max_size=4)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(_typed(i, strings) for i in t.types))
    return json_like  # object / Any


def typed_bodies(
    wire: Wire, strings: st.SearchStrategy[str] = _STRINGS
) -> st.SearchStrategy[bytes]:
    """Bodies that decode: each of the wire's messages with every field of the right type
    and any value (negative sizes, huge offsets, odd names), some fields left out."""
    encode = msgspec.msgpack.encode
    members = typing.get_args(wire.message_type) or (wire.message_type,)

    def of(cls: Any) -> st.SearchStrategy[bytes]:
        info = _struct(cls)
        required = {f.encode_name: _typed(f.type, strings) for f in info.fields if f.required}
        optional = {f.encode_name: _typed(f.type, strings) for f in info.fields if not f.required}
        return st.fixed_dictionaries(
            {info.tag_field or "type": st.just(info.tag), **required}, optional=optional
        ).map(encode)

    return st.one_of(*(of(cls) for cls in members))


@st.composite
def _near_valid(
    draw: st.DrawFn, samples: tuple[Any, ...], strings: st.SearchStrategy[str]
) -> bytes:
    sample = draw(st.sampled_from(samples))
    fields = {f.encode_name: f.type for f in _struct(type(sample)).fields}
    raw = msgspec.to_builtins(sample)
    if not fields:  # nothing to change (Stats())
        return msgspec.msgpack.encode(raw)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2)):
        raw[name] = draw(_typed(fields[name], strings))
    return msgspec.msgpack.encode(raw)


def near_valid_bodies(
    samples: tuple[Any, ...], strings: st.SearchStrategy[str] = _STRINGS
) -> st.SearchStrategy[bytes]:
    """A good message with one or two fields given another value of their type: the
    mutation that gets past a server's first checks to the ones behind them."""
    return _near_valid(samples, strings)


def _struct(cls: Any) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


def junk_bodies(wire: Wire) -> st.SearchStrategy[bytes]:
    """Bodies that mostly do not decode: random bytes, random msgpack, unknown tags, and
    known tags with fields of any type."""
    encode = msgspec.msgpack.encode
    tags = wire.tags

    def fields_of(tag: str) -> st.SearchStrategy[bytes]:
        names = tags[tag]
        return st.fixed_dictionaries(
            {"type": st.just(tag)}, optional={name: json_like for name in names}
        ).map(encode)

    known = st.sampled_from(sorted(tags)).flatmap(fields_of)
    unknown = st.builds(
        lambda tag, rest: encode({"type": tag, **rest}),
        st.text(max_size=12).filter(lambda t: t not in tags),
        st.dictionaries(st.text(max_size=8), json_like, max_size=3),
    )
    return st.one_of(st.binary(max_size=200), json_like.map(encode), unknown, known)


def body_bytes(
    wire: Wire,
    strings: st.SearchStrategy[str] = _STRINGS,
    samples: tuple[Any, ...] = (),
) -> st.SearchStrategy[bytes]:
    """Bodies a decoder may meet: junk (:func:`junk_bodies`), right-typed messages with
    any values, good messages with a field or two changed, and the good ones."""
    samples = samples or wire.samples
    good = st.sampled_from(samples).map(msgspec.msgpack.encode)
    return st.one_of(
        junk_bodies(wire),
        typed_bodies(wire, strings),
        near_valid_bodies(samples, strings),
        good,
    )


def _frame(wire: Wire, body: bytes, payload: bytes = b"") -> bytes:
    return header(len(body), len(payload)) + body + payload


def mutated_frames(
    wire: Wire,
    *,
    payload_room: int = 4096,
    strings: st.SearchStrategy[str] = _STRINGS,
    samples: tuple[Any, ...] = (),
) -> st.SearchStrategy[bytes]:
    """The bytes of one (possibly broken) frame on ``wire``.

    ``payload_room`` caps the payload bytes actually sent; an announced size above it is
    sent short (a truncated frame), which is what a huge announced size looks like.
    """
    codec = wire.codec
    bodies = body_bytes(wire, strings, samples)
    sizes = st.sampled_from(
        sorted(
            {
                0,
                1,
                codec.max_payload,
                codec.max_payload + 1,
                codec.max_body,
                codec.max_body + 1,
                2**31,
                2**32 - 1,
            }
        )
    ) | st.integers(min_value=0, max_value=2**32 - 1)

    def well_framed(body: bytes, payload: bytes) -> bytes:
        return _frame(wire, body, payload)

    whole = st.builds(well_framed, bodies, st.binary(max_size=64) | st.just(b""))

    def truncate(data: bytes, at: int) -> bytes:
        return data[: max(1, at % max(1, len(data)))]

    truncated = st.builds(truncate, whole, st.integers(min_value=0))
    bad_magic = st.builds(
        lambda magic, rest: magic + rest[4:],
        st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC),
        whole,
    )
    announced = st.builds(
        lambda body_len, payload_len, body, sent: (
            header(body_len, payload_len) + body + b"\0" * min(sent, payload_len, payload_room)
        ),
        sizes,
        sizes,
        bodies,
        st.integers(min_value=0, max_value=payload_room),
    )

    def flip(data: bytes, at: int, bits: int) -> bytes:
        raw = bytearray(data)
        raw[at % len(raw)] ^= bits
        return bytes(raw)

    flipped = st.builds(flip, whole, st.integers(min_value=0), st.integers(1, 255))
    junk = st.binary(min_size=1, max_size=300)
    return st.one_of(whole, truncated, bad_magic, announced, flipped, junk)


def split_points(data: bytes) -> st.SearchStrategy[list[bytes]]:
    """``data`` cut into chunks at random places (how a stream delivers it)."""

    def cut(points: list[int]) -> list[bytes]:
        marks = sorted({p % (len(data) + 1) for p in points})
        edges = [0, *marks, len(data)]
        return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]

    return st.lists(st.integers(min_value=0), max_size=8).map(cut)
