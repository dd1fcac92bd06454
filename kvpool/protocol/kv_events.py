"""vLLM's KV cache events on the wire: msgpack ``KVEventBatch`` frames, in both directions.

The same structs as ``vllm/distributed/kv_events.py`` (vLLM 0.30–0.32), so that kvpool
reads what vLLM publishes and publishes what an llm-d- or Dynamo-style indexer reads,
without importing vLLM.  A ZMQ message is ``(topic, seq as 8 big-endian bytes, payload)``;
a replay request is the first wanted seq, answered up to an end marker of seq -1.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]

MEDIUM_GPU = "GPU"  # an instance's own KV cache (vLLM's name, on CPU builds too)
MEDIUM_CPU = "CPU"  # host memory: kvpool's memory tier
MEDIUM_DISK = "DISK"  # kvpool's SSD tier
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# vLLM's ExternalBlockHash: bytes, or an int in older releases
BlockHash = bytes | int


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's KVCacheEvent: tagged by class name."""


class BlockStored(_Event):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ENCODER = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """One published batch; ``msgspec.DecodeError`` (a ``ValueError``) for anything else."""
    return _DECODER.decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)
