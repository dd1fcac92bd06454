"""The P→D pull protocol: typed messages over kvpool's frame codec (no sockets here).

A decode (D) rank pulls a request's KV pages from the prefill (P) rank that computed it,
on P's ``kv_port``, one exchange per request on one connection.
"""

from __future__ import annotations

import msgspec

from kvpool.protocol.codec import Codec

__all__ = [
    "PULL_REPLY_CODEC",
    "PULL_REQUEST_CODEC",
    "Done",
    "Layer",
    "Pull",
    "PullDone",
    "PullReply",
    "PullRequest",
    "Refused",
]


# One connection from a D rank to a P rank carries one exchange per request::
#
#     D → P   Pull(request_id, block_ids, head_start, head_count, layers, dst_rank, ...)
#     P → D   Layer(index=0, page_bytes)  + payload: one page slice per block, in block order
#             Layer(index=1, page_bytes)  + payload
#             ...
#             Done(nbytes)
#       or at any point
#     P → D   Refused(reason)              and no more frames for this pull
#
#     D → P   PullDone(request_id, dst_rank)  D needs nothing (full local hit, abort, failure)
#     P → D   Done(0)
class Pull(msgspec.Struct, tag="pull", frozen=True):
    """Send me these heads of these blocks of a request you hold."""

    request_id: str
    block_ids: list[int]
    head_start: int
    head_count: int
    layers: list[str]
    dst_rank: int
    dst_tp_size: int
    page_bytes: int  # bytes of one page slice as D computes it; P checks it matches its own
    group: str | None = None  # D's pairing group (engine_id); None when D has none
    # A hybrid model's request is one pull per KV cache group (each group has its own
    # blocks and page geometry); only the last of a D rank's pulls is final, and P holds
    # the blocks until the final one is served.
    final: bool = True


# ``PullDone`` is not the master's ``Release`` (a read lease given back): it tells P that
# this D rank is done with the request's blocks without pulling them, so P may free them
# before ``hold_timeout_ms``.
class PullDone(msgspec.Struct, tag="pull_done", frozen=True):
    """D rank ``dst_rank`` will not pull this request: P may stop holding it for that rank."""

    request_id: str
    dst_rank: int
    dst_tp_size: int
    group: str | None = None


# A *page slice* is ``cache[layer][block_id, head_start : head_start + head_count]``: the
# heads this D rank needs of one whole block.  Blocks travel as opaque pages (the CPU
# kernel does not keep tokens in position order inside a block), and one page slice is
# contiguous in both caches, so it is sent from and received into the KV caches with no
# staging copy.
class Layer(msgspec.Struct, tag="layer", frozen=True):
    """One layer's page slices follow as the payload, ``page_bytes`` each, in block order."""

    index: int
    page_bytes: int


class Done(msgspec.Struct, tag="done", frozen=True):
    nbytes: int


class Refused(msgspec.Struct, tag="refused", frozen=True):
    """P cannot serve the pull; D reports a load error and vLLM recomputes."""

    reason: str


PullRequest = Pull | PullDone
PullReply = Layer | Done | Refused

# Pull requests never carry a payload: a header announcing one is refused at once.
PULL_REQUEST_CODEC: Codec[PullRequest] = Codec(PullRequest, max_payload=0)
PULL_REPLY_CODEC: Codec[PullReply] = Codec(PullReply)
