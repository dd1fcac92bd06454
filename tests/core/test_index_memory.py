"""The index's memory per object, counted with tracemalloc (bytes, not time): a pool of a
few TB in small pages is tens of millions of objects, and every byte here is master memory
(docs/benchmarks.md, "The master at scale", compares it with ``mooncake_master``)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from kvpool.core.index import ObjectIndex
from kvpool.core.objects import IndexConfig, State

N = 20_000
CHAIN = 64  # blocks per request: each put names the previous block as its parent
# Bytes per READY object, its key included: 1,100 before records dropped their cached
# Location and empty holds dict, writers their expiry heap, the policy its OrderedDicts,
# a chain's parent its dict of one child and the allocator its map of live extents.
BOUND = 560


def wire(text: str) -> str:
    """A string as the server's decoder hands it over: a new object, never a shared one."""
    return "".join(list(text))


def wire_int(value: int) -> int:
    return int(str(value))


@pytest.mark.parametrize("policy", ["prefix_aware", "lru"])
def test_an_object_costs_the_index_at_most_the_bound(policy: str) -> None:
    idx = ObjectIndex(IndexConfig(policy=policy))
    idx.register_client("node", 0)
    idx.add_segment("node", "node/mem", 1 << 40)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(N):
            key = f"{i:032x}"
            parent = None if i % CHAIN == 0 else wire(f"{i - 1:032x}")
            now = wire_int(1_000_000 + i)
            idx.put_start(wire(key), wire_int(16_384), wire("writer"), now, parent)
            idx.put_end(wire(key), "writer", now, checksum=wire_int(0x9E3779B9 + i))
        gc.collect()
        per_object = (tracemalloc.get_traced_memory()[0] - before) / N
    finally:
        tracemalloc.stop()
    assert idx.count(state=State.READY) == N
    assert per_object <= BOUND, f"{per_object:.0f} bytes an object (bound {BOUND})"
