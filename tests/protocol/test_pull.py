from __future__ import annotations

import struct

import pytest

from kvpool.errors import ProtocolError
from kvpool.protocol import messages
from kvpool.protocol.codec import HEADER_SIZE, MAGIC
from kvpool.protocol.pull import (
    PULL_REPLY_CODEC,
    PULL_REQUEST_CODEC,
    Done,
    Layer,
    Pull,
    PullDone,
    Refused,
)


def test_pulls_and_their_replies_round_trip() -> None:
    pull = Pull("r", [3, 4], 0, 2, ["l0", "l1"], 1, 2, 128, "g")
    for request in (pull, PullDone("r", 1, 2), PullDone("r", 0, 1, "g")):
        body = PULL_REQUEST_CODEC.encode(request)[HEADER_SIZE:]
        assert PULL_REQUEST_CODEC.decode_body(body) == request
    for reply in (Layer(0, 128), Done(256), Refused("not held")):
        body = PULL_REPLY_CODEC.encode(reply, 256 if isinstance(reply, Layer) else 0)
        assert PULL_REPLY_CODEC.decode_body(body[HEADER_SIZE:]) == reply


def test_decode_is_done_is_not_the_master_s_lease_release() -> None:
    # The P→D "done with these blocks" message and the master's read-lease release are
    # different messages with different names and wire tags.
    assert not hasattr(messages, "PullDone")
    assert PullDone.__struct_config__.tag == "pull_done"
    assert messages.Release.__struct_config__.tag != PullDone.__struct_config__.tag


def test_a_pull_request_announcing_a_payload_is_refused_from_its_header() -> None:
    # P's pull server never reads a request payload; one announced is refused before a
    # byte of it is read, never buffered or mistaken for the next frame.
    header = MAGIC + struct.pack("!II", 64, 1 << 30)
    with pytest.raises(ProtocolError, match="carry none"):
        PULL_REQUEST_CODEC.parse_header(header)
