from __future__ import annotations

import msgspec

from kvpool.protocol import messages as m
from kvpool.protocol.codec import HEADER_SIZE


def test_placement_keeps_its_wire_field_name() -> None:
    # ``placed`` is the attribute; peers of every version read and write ``found``.
    wire = msgspec.msgpack.decode(m.MASTER_REPLY_CODEC.encode(m.Placement(True, "k"))[HEADER_SIZE:])
    assert wire["found"] is True and "placed" not in wire
    assert m.MASTER_REPLY_CODEC.decode_body(
        m.MASTER_REPLY_CODEC.encode(m.Placement(False, "k"))[HEADER_SIZE:]
    ) == m.Placement(False, "k")
