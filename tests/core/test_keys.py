from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.keys import BlockKey, KeyNamespace, chunk_keys, group_key, layer_key

NS = KeyNamespace(model="tiny-llama", kv_dtype="float32", chunk_size=4)


def test_only_full_chunks_are_keyed() -> None:
    assert chunk_keys(list(range(3)), NS) == []
    assert len(chunk_keys(list(range(4)), NS)) == 1
    assert len(chunk_keys(list(range(11)), NS)) == 2


def test_keys_chain_so_equal_chunks_after_different_prefixes_differ() -> None:
    a = chunk_keys([1, 2, 3, 4, 9, 9, 9, 9], NS)
    b = chunk_keys([5, 6, 7, 8, 9, 9, 9, 9], NS)
    assert a[1] != b[1]


def test_shared_prefix_gives_shared_leading_keys() -> None:
    a = chunk_keys([1, 2, 3, 4, 5, 6, 7, 8], NS)
    b = chunk_keys([1, 2, 3, 4, 0, 0, 0, 0], NS)
    assert a[0] == b[0]
    assert a[1] != b[1]


def test_extending_from_a_parent_equals_hashing_the_whole_prefix() -> None:
    tokens = list(range(12))
    whole = chunk_keys(tokens, NS)
    tail = chunk_keys(tokens[4:], NS, parent=whole[0])
    assert whole[1:] == tail


@pytest.mark.parametrize(
    "other",
    [
        KeyNamespace("other-model", "float32", 4),
        KeyNamespace("tiny-llama", "bfloat16", 4),
        KeyNamespace("tiny-llama", "float32", 4, layout="mla"),
        KeyNamespace("tiny-llama", "float32", 4, tp_rank=1, tp_size=2),
        KeyNamespace("tiny-llama", "float32", 4, tp_rank=0, tp_size=2),
        KeyNamespace("tiny-llama", "float32", 4, tenant="acme"),
    ],
)
def test_every_namespace_field_changes_the_keys(other: KeyNamespace) -> None:
    tokens = [1, 2, 3, 4]
    assert chunk_keys(tokens, NS) != chunk_keys(tokens, other)


def test_namespace_fields_are_length_prefixed_not_concatenated() -> None:
    a = KeyNamespace("ab", "c", 4)
    b = KeyNamespace("a", "bc", 4)
    assert a.root() != b.root()


def test_key_is_typed_and_round_trips_through_hex() -> None:
    key = chunk_keys([1, 2, 3, 4], NS)[0]
    assert isinstance(key, BlockKey)
    assert len(key.hex) == 32
    assert BlockKey.from_hex(key.hex) == key
    with pytest.raises(ValueError):
        BlockKey(b"short")


def test_bad_token_ids_and_namespaces_are_rejected() -> None:
    with pytest.raises(ValueError, match="token ids"):
        chunk_keys([1, 2, 3, -1], NS)
    with pytest.raises(ValueError, match="chunk_size"):
        KeyNamespace("m", "f", 0)
    with pytest.raises(ValueError, match="tp_rank"):
        KeyNamespace("m", "f", 4, tp_rank=2, tp_size=2)


def test_for_rank_changes_only_the_rank() -> None:
    ns = KeyNamespace("m", "f", 4, tp_rank=0, tp_size=2)
    assert ns.for_rank(1) == KeyNamespace("m", "f", 4, tp_rank=1, tp_size=2)


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40))
def test_keys_are_a_pure_function_of_tokens(tokens: list[int]) -> None:
    assert chunk_keys(tokens, NS) == chunk_keys(list(tokens), NS)
    assert len(chunk_keys(tokens, NS)) == len(tokens) // 4


_PROBE = (
    "from kvpool.core.keys import KeyNamespace, chunk_keys;"
    "ns = KeyNamespace('m', 'float16', 16, 'default', 1, 2, 't');"
    "print(','.join(k.hex for k in chunk_keys(list(range(64)), ns)));"
    "print(hash('make sure the seed really differs'))"
)


def test_keys_are_identical_across_processes_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
        )
        keys, py_hash = done.stdout.split()
        outputs.append((keys, py_hash))
    assert len({keys for keys, _ in outputs}) == 1
    # the processes really did hash differently, or the test proves nothing
    assert len({py_hash for _, py_hash in outputs}) > 1
    # and the keys are the ones this process computes too
    ns = KeyNamespace("m", "float16", 16, "default", 1, 2, "t")
    assert outputs[0][0] == ",".join(k.hex for k in chunk_keys(list(range(64)), ns))


def test_group_keys_are_pinned_values_distinct_from_chunk_keys() -> None:
    """A group key is a fixed function of (chunk key, group): the value is pinned so that a
    change to it (which would orphan every stored object) is a deliberate one."""
    (key,) = chunk_keys([1, 2, 3, 4], NS)
    assert group_key(key, 0) != key and group_key(key, 0) != group_key(key, 1)
    assert group_key(key, 1) == group_key(BlockKey(key.digest), 1)
    assert group_key(BlockKey(bytes(16)), 7).hex == "b2ae3400e563a39fffb644417dd0a6bc"
    with pytest.raises(ValueError, match="group must be in"):
        group_key(key, -1)


def test_layer_keys_are_pinned_values_distinct_from_chunk_and_group_keys() -> None:
    (key,) = chunk_keys([1, 2, 3, 4], NS)
    layers = {layer_key(key, i) for i in range(64)}
    groups = {group_key(key, i) for i in range(64)}
    assert len(layers) == 64 and key not in layers and not layers & groups
    assert layer_key(BlockKey(bytes(16)), 7).hex == "db0a5118b7c83b2f175fb3a4788d712d"
    with pytest.raises(ValueError, match="layer must be in"):
        layer_key(key, -1)
