"""The per-instance block index kv_aware routes on: content keys, events, bounds."""

from __future__ import annotations

from kvpool.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.proxy.block_index import BlockIndex, content_keys

BS = 4


def stored(hashes: list[bytes], tokens: list[int], parent: bytes | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_content_keys_depend_on_every_token_before_and_only_full_blocks() -> None:
    a = content_keys(list(range(10)), BS)
    assert len(a) == 2  # the trailing partial block has none
    b = content_keys([*range(4), 99, 5, 6, 7, 8, 9], BS)
    assert a[0] == b[0] and a[1] != b[1]
    assert content_keys(list(range(10)), BS) == a  # no seed anywhere


def test_an_instances_hashes_map_to_the_keys_a_prompt_has() -> None:
    index = BlockIndex()
    tokens = list(range(12))
    # the instance's own hashes are opaque (seeded per process); the tokens decide
    index.apply([stored([b"h0", b"h1"], tokens[:8]), stored([b"h2"], tokens[8:], parent=b"h1")])
    assert index.prefix(content_keys(tokens, BS)) == 3
    assert index.prefix(content_keys([*tokens[:4], 0, 0, 0, 0], BS)) == 1
    index.apply([BlockRemoved(block_hashes=[b"h1"], medium="GPU")])
    assert index.prefix(content_keys(tokens, BS)) == 1  # a hole ends the prefix
    index.apply([AllBlocksCleared()])
    assert len(index) == 0 and index.stats.cleared == 1


def test_a_block_whose_parent_is_unknown_is_left_out() -> None:
    index = BlockIndex()
    index.apply([stored([b"x"], [1, 2, 3, 4], parent=b"never-seen")])
    assert len(index) == 0 and index.stats.unchained == 1


def test_one_block_held_under_two_hashes_stays_held_until_both_go() -> None:
    index = BlockIndex()
    tokens = [5, 6, 7, 8]
    index.apply([stored([b"group0"], tokens), stored([b"group1"], tokens)])
    key = content_keys(tokens, BS)
    index.apply([BlockRemoved(block_hashes=[b"group0"], medium="GPU")])
    assert index.prefix(key) == 1
    index.apply([BlockRemoved(block_hashes=[b"group1"], medium="GPU")])
    assert index.prefix(key) == 0


def test_memory_stays_bounded_under_a_flood_of_events() -> None:
    index = BlockIndex(max_blocks=1000)
    parent = None
    for i in range(50_000):  # one long chain: each block's parent is the one before
        h = i.to_bytes(8, "big")
        index.apply([stored([h], [i, i, i, i], parent=parent)])
        parent = h
    assert index.hashes == 1000 and len(index) == 1000
    assert index.stats.dropped == 49_000


def test_forget_takes_what_a_misprediction_showed_is_gone() -> None:
    index = BlockIndex()
    tokens = list(range(8))
    index.apply([stored([b"a", b"b"], tokens)])
    keys = content_keys(tokens, BS)
    assert index.forget(keys[1:]) == 1 and index.prefix(keys) == 1


def test_a_malformed_store_is_refused_whole() -> None:
    index = BlockIndex()
    try:
        index.apply([stored([b"a", b"b"], [1, 2, 3])])  # 3 tokens for 2 blocks of 4
    except ValueError as exc:
        assert "3 token ids for 2 blocks" in str(exc)
    else:
        raise AssertionError("a malformed event was taken")
    assert len(index) == 0
