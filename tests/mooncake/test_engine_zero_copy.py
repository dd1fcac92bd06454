"""The Mooncake engine moves a KV cache's pages in place: the tensor's storage is
registered once and each page is read and written where it is (header apart), whole or as
one part per layer; and the store connector's load of a registered cache makes no staging
copy (the engine's ``moved`` counts, as ``health()`` reports them)."""

from __future__ import annotations

import logging
from typing import Any

from kvpool.connectors.store.plan import LoadSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.worker import StoreWorker
from kvpool.mooncake.engine import MooncakeEngine
from tests.mooncake.host import corrupt, kv_cache_round_trip, run_on_mooncake, save_then_load

PAGE = 128 << 10


def test_kv_cache_pages_move_in_place() -> None:
    r = run_on_mooncake(kv_cache_round_trip)
    assert r["put"] == [None] * 4
    assert r["got"] == [PAGE] * 4 and r["equal"]
    assert r["regions"] == 1  # the cache's storage, registered once
    assert r["loose"] == [PAGE] and r["loose_equal"]  # outside the cache: staged
    assert r["wide"] == [-1]  # room for two pages: another size, a miss
    assert r["damaged"] == [-1]  # a damaged copy read in place is a miss
    assert r["moved"] == {"put_in_place": 4, "put_staged": 0, "get_in_place": 4, "get_staged": 1}


# ------------------------------------------------------------------ pages as layer parts

LAYER_PAGE = 32 << 10  # one block of one layer
BLOCKS = 512  # x LAYER_PAGE = 16 MiB per layer: each layer's tensor is registered in place


def _caches(blocks: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (blocks, 2, 16, LAYER_PAGE // 32)
    return {f"l{i}": torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for i in (0, 1)}


def parts_in_place(engine: MooncakeEngine) -> dict[str, Any]:
    """In the namespace: pages given as one part per layer of two registered layer tensors."""
    import torch

    kv = _caches(BLOCKS, 1)
    rows = [t.view(BLOCKS, -1) for t in kv.values()]

    def page(block: int) -> list[Any]:
        return [r[block] for r in rows]

    keys = [f"parts-{i}" for i in range(4)]
    put = engine.batch_put_parts(keys, [page(i) for i in range(4)])
    got = engine.batch_get_parts(keys, [page(10 + i) for i in range(4)])
    equal = all(torch.equal(r[i], r[10 + i]) for r in rows for i in range(4))
    moved = dict(engine.moved)
    # a part outside registered memory goes through the staging area, the rest in place
    loose = bytearray(LAYER_PAGE)
    mixed = engine.batch_get_parts(keys[:1], [[rows[0][20], loose]])
    mixed_equal = (
        torch.equal(rows[0][20], rows[0][0]) and bytes(loose) == rows[1][0].numpy().tobytes()
    )
    corrupt(engine, keys[1])
    damaged = engine.batch_get_parts(keys[1:2], [page(30)])
    other_size = engine.batch_get_parts(keys[2:3], [page(40)[:1]])  # half a page
    whole = bytearray(2 * LAYER_PAGE)  # a page stored in parts reads back as one buffer
    assert engine._registered is not None
    return {
        "put": put,
        "got": got,
        "equal": equal,
        "moved": moved,
        "mixed": mixed,
        "mixed_equal": mixed_equal,
        "damaged": damaged,
        "other_size": other_size,
        "whole": engine.batch_get_parts(keys[3:], [[whole]]),
        "whole_equal": bytes(whole) == b"".join(r[3].numpy().tobytes() for r in rows),
        "regions": len(engine._registered),
        "moved_after": dict(engine.moved),
    }


def test_pages_as_layer_parts_move_in_place() -> None:
    r = run_on_mooncake(parts_in_place)
    assert r["put"] == [None] * 4 and r["got"] == [2 * LAYER_PAGE] * 4 and r["equal"]
    assert r["moved"] == {"put_in_place": 4, "put_staged": 0, "get_in_place": 4, "get_staged": 0}
    assert r["regions"] == 2  # one per layer tensor, registered once
    assert r["mixed"] == [2 * LAYER_PAGE] and r["mixed_equal"]
    assert r["damaged"] == [-1] and r["other_size"] == [-1]  # misses, never wrong bytes
    assert r["whole"] == [2 * LAYER_PAGE] and r["whole_equal"]
    assert r["moved_after"]["get_staged"] == 2  # the mixed page and the whole-buffer read


def connector_load(engine: MooncakeEngine, blocks: int) -> dict[str, Any]:
    """In the namespace: the store connector's worker saves 20 blocks of a real KV cache
    shape and loads them back into other blocks; then a load meets a damaged object."""
    import torch

    src, dst = _caches(blocks, 2), _caches(blocks, 3)
    keys = tuple(f"blk-{blocks}-{i}" for i in range(20))
    saver, loader = _worker(engine, src), _worker(engine, dst)
    equal = save_then_load(saver, loader, keys, src, dst)
    moved = dict(engine.moved)
    invalid = sorted(loader.take_invalid_block_ids())
    corrupt(engine, keys[5])
    again = tuple(range(200, 220))
    loader.start_loads(StorePlan(loads=(LoadSpec("r3", again, (keys,), False),)))
    return {
        "saved": saver.counters["saved_blocks"],
        "equal": equal,
        "invalid": invalid,
        "moved": moved,
        "failed": sorted(loader.take_invalid_block_ids()),
        "good_before": all(torch.equal(dst[n][200:205], src[n][:5]) for n in src),
        "dropped": loader.counters["dropped_blocks"],
        "still_there": engine.batch_exists([keys[5]]),
    }


def _worker(engine: MooncakeEngine, caches: dict[str, Any]) -> StoreWorker:
    def handle() -> PoolHandle:
        return PoolHandle(lambda: engine, reconnect_interval_s=60, describe="mooncake")

    worker = StoreWorker(
        tp_rank=0, pool=handle(), loader_pool=handle(), logger=logging.getLogger("t")
    )
    worker.register(caches)
    return worker


def test_the_store_connector_loads_a_registered_cache_with_no_staging_copy() -> None:
    r = run_on_mooncake(connector_load, BLOCKS)
    assert r["saved"] == 20 and r["equal"] and r["invalid"] == []
    # every page went to and from the KV cache's own memory: the staging area held only
    # the 16-byte headers
    assert r["moved"] == {"put_in_place": 20, "put_staged": 0, "get_in_place": 20, "get_staged": 0}
    # a damaged object read in place: it and everything after it reported for recompute,
    # the blocks before it good, and the bad copy dropped so a recomputed one replaces it
    assert r["failed"] == list(range(205, 220)) and r["good_before"]
    assert r["dropped"] == 1 and r["still_there"] == [False]


def test_a_cache_too_small_to_register_moves_through_the_engines_staging_area() -> None:
    r = run_on_mooncake(connector_load, 256)  # 8 MiB per layer: under MIN_REGISTERED
    assert r["saved"] == 20 and r["equal"] and r["invalid"] == []
    assert r["moved"] == {"put_in_place": 0, "put_staged": 20, "get_in_place": 0, "get_staged": 20}
    assert r["failed"] == list(range(205, 220)) and r["good_before"]
