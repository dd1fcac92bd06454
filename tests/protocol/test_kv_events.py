"""kvpool's KV event structs are vLLM's on the wire, both ways (vLLM 0.32's own classes)."""

from __future__ import annotations

import msgspec
import pytest

from kvpool.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

# vLLM's module imports torch's JIT helpers, which warn of their own deprecation
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_what_vllm_publishes_kvpool_reads_and_the_reverse() -> None:
    from vllm.distributed import kv_events as v

    theirs = v.KVEventBatch(
        ts=2.5,
        events=[
            v.BlockStored(
                block_hashes=[b"\x01" * 32, 7],
                parent_block_hash=b"\x00" * 32,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=1,
            ),
            v.BlockRemoved(block_hashes=[7], medium="CPU"),
            v.AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    ours = decode_batch(msgspec.msgpack.encode(theirs))
    stored, removed, cleared = ours.events
    assert isinstance(stored, BlockStored) and stored.token_ids == list(range(8))
    assert stored.group_idx == 1 and stored.block_hashes == [b"\x01" * 32, 7]
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert isinstance(cleared, AllBlocksCleared) and ours.data_parallel_rank == 3
    back = msgspec.msgpack.Decoder(v.KVEventBatch).decode(encode_batch(ours))
    assert back == theirs


def test_garbage_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        decode_batch(b"\x93\x01\x02")
    with pytest.raises(ValueError):
        decode_batch(encode_batch(KVEventBatch(ts=1.0, events=[]))[:-1])
