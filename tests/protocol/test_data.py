from __future__ import annotations

from kvpool.errors import KVPoolError, UnknownSegment
from kvpool.protocol.codec import HEADER_SIZE, Codec
from kvpool.protocol.data import (
    DataReply,
    DataRequest,
    Error,
    Ok,
    SegmentInfoReply,
    SegmentRead,
    SegmentWrite,
    error_reply,
)


def test_requests_and_replies_round_trip_through_their_codecs() -> None:
    requests: Codec[DataRequest] = Codec(DataRequest)
    replies: Codec[DataReply] = Codec(DataReply)
    for message in (SegmentWrite("s", 8, 16), SegmentRead("s", 0, 1)):
        assert requests.decode_body(requests.encode(message)[HEADER_SIZE:]) == message
    for reply in (Ok(), Ok(5), Error("NOT_FOUND", "x"), SegmentInfoReply("s", 1, "n", "t")):
        assert replies.decode_body(replies.encode(reply)[HEADER_SIZE:]) == reply


def test_error_reply_carries_the_class_back() -> None:
    err = error_reply(UnknownSegment("segment 'a' is not served here"))
    assert err == Error("UNKNOWN_SEGMENT", "segment 'a' is not served here")
    back = err.to_exception()
    assert type(back) is UnknownSegment
    assert str(back) == "segment 'a' is not served here"


def test_foreign_exceptions_become_internal_errors() -> None:
    err = error_reply(ValueError())
    assert err.code == "INTERNAL"
    assert err.message == "ValueError"
    assert type(err.to_exception()) is KVPoolError
