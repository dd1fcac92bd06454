"""Every frame codec kvpool speaks, with a few good messages of each (the fuzz targets)."""

from __future__ import annotations

from kvpool.connectors.store import lookup
from kvpool.protocol import data, messages, pull
from tests.fuzz.frames import Wire

__all__ = ["WIRES"]

WIRES = (
    Wire(
        "master-request",
        messages.MASTER_REQUEST_CODEC,
        messages.MasterRequest,
        (
            messages.Exists("k"),
            messages.PutStart("c", "k", 10),
            messages.BatchPutStart("c", ["a", "b"], [1, 2], ["p", None]),
            messages.Restore("c", "s", [("k", 0, 1, 2)]),
            messages.Stats(),
        ),
    ),
    Wire(
        "master-reply",
        messages.MASTER_REPLY_CODEC,
        messages.MasterReply,
        (
            messages.Placement(True, "k", "s", offset=4, size=8),
            messages.HeartbeatReply([("k", "s", 0, 1, 2)], ["x"]),
            messages.StatsReply({"a": 1, "b": [1, "x"]}),
            data.Error("NOT_FOUND", "k"),
        ),
    ),
    Wire(
        "data-request",
        data.DATA_REQUEST_CODEC,
        data.DataRequest,
        (
            data.SegmentRead("seg0", 0, 8),
            data.SegmentWrite("seg0", 0, 0),
            data.SegmentDemote("seg0", 0, 8, "k", 1),
            data.SsdRemove(["k"]),
        ),
    ),
    Wire(
        "data-reply",
        data.DATA_REPLY_CODEC,
        data.DataReply,
        (data.Ok(3), data.SegmentInfoReply("s", 8, "n", "h"), data.Error("PROTOCOL", "x")),
    ),
    Wire(
        "pull-request",
        pull.PULL_REQUEST_CODEC,
        pull.PullRequest,
        (
            pull.Pull("r", [1, 2], 0, 2, ["l0"], 0, 1, 128, "g"),
            pull.PullDone("r", 0, 1),
        ),
    ),
    Wire(
        "pull-reply",
        pull.PULL_REPLY_CODEC,
        pull.PullReply,
        (pull.Layer(0, 64), pull.Done(9), pull.Refused("no")),
    ),
    Wire(
        "lookup-request",
        lookup.LOOKUP_CODEC,
        lookup.Lookup,
        (lookup.Lookup(["a", "b"]), lookup.Lookup([])),
    ),
    Wire(
        "lookup-reply",
        lookup.REPLY_CODEC,
        lookup.Found | lookup.Failed,
        (lookup.Found(2), lookup.Failed("boom")),
    ),
)
