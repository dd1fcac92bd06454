"""The P→D pull when Mooncake's Transfer Engine moves the pages (no sockets here).

The conversation is :mod:`kvpool.protocol.pull`'s; only the pages leave it: P answers with
where the page slices lie in its registered KV caches, D reads them with the Transfer
Engine straight into its own, then says so.
"""

from __future__ import annotations

import msgspec

from kvpool.protocol.codec import Codec
from kvpool.protocol.pull import Done, Pull, PullDone, Refused

__all__ = [
    "ENGINE_REPLY_CODEC",
    "ENGINE_REQUEST_CODEC",
    "EngineReply",
    "EngineRequest",
    "Pages",
    "Read",
    "Unread",
]


# D → P   Pull(request_id, block_ids, head_start, head_count, layers, ...)
# P → D   Pages(endpoint, layer_addrs, block_stride, head_bytes)   or Refused(reason)
# D → P   Read(nbytes)        every page slice is in D's cache
# P → D   Done(nbytes)        P counted the pull as served (its blocks may be freed)
#   or
# D → P   Unread(reason)      D's read failed: nothing was served (D recomputes)
#
# D → P   PullDone(request_id, dst_rank, ...)
# P → D   Done(0)  or Refused(reason)
#
# Why D reads rather than P writes: D's KV cache is written only while D's own thread is in
# the engine's (bounded) read call, so once D reports a failed load and vLLM reuses those
# blocks, no late write from P can land in them; P's memory is only ever read, and P frees
# the request's blocks only after D's ``Read``.  It also keeps the roles of the TCP pull: D
# decides what it wants and when it gives up.
#
# The page slice of block ``b``, layer ``i``, heads from ``h`` is at
# ``layer_addrs[i] + b * block_stride + h * head_bytes`` in P's memory (P's layout: its
# heads per block may differ from D's under heterogeneous TP), ``head_count * head_bytes``
# long and contiguous.
class Pages(msgspec.Struct, tag="pages", frozen=True):
    """P admitted the pull: read its page slices from P's registered memory."""

    endpoint: str  # P's Transfer Engine as "host:rpc_port" (its P2PHANDSHAKE name)
    layer_addrs: list[int]  # block 0, head 0 of each pulled layer, in the pull's order
    block_stride: int  # bytes from one block to the next in one of P's layers
    head_bytes: int  # bytes of one head of one block


class Read(msgspec.Struct, tag="read", frozen=True):
    """D has every page slice of the pull (``nbytes`` in all)."""

    nbytes: int


class Unread(msgspec.Struct, tag="unread", frozen=True):
    """D could not read the pages; P serves nothing (D follows with a ``PullDone``)."""

    reason: str


EngineRequest = Pull | PullDone | Read | Unread
EngineReply = Pages | Done | Refused

# Nothing but small messages travel on this connection: a header announcing a payload
# is refused at once.
ENGINE_REQUEST_CODEC: Codec[EngineRequest] = Codec(EngineRequest, max_payload=0)
ENGINE_REPLY_CODEC: Codec[EngineReply] = Codec(EngineReply, max_payload=0)
