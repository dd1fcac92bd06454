from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.connectors.pages import block_pages
from kvpool.connectors.store.groups import HeadGroups
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.worker import StoreWorker
from kvpool.errors import KVPoolError
from tests.connectors.store.fake_pool import FakePool
from tests.waiting import wait_until

NUM_BLOCKS, HEADS, BS, HEAD2 = 12, 2, 4, 6


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(NUM_BLOCKS, HEADS, BS, HEAD2, generator=g) for i in range(3)}


def make(
    pool: FakePool,
    caches: dict[str, torch.Tensor],
    rank: int = 0,
    groups: HeadGroups | None = None,
) -> StoreWorker:
    def handle() -> PoolHandle:
        return PoolHandle(lambda: pool, reconnect_interval_s=60, describe="fake")

    worker = StoreWorker(
        tp_rank=rank,
        pool=handle(),
        loader_pool=handle(),
        logger=logging.getLogger("t"),
        groups=groups,
    )
    worker.register(caches)
    return worker


def keys(n: int, tag: str = "k") -> tuple[str, ...]:
    return tuple(f"{tag}{i:031d}" for i in range(n))


def save_plan(block_ids: tuple[int, ...], ks: tuple[str, ...]) -> StorePlan:
    return StorePlan(saves=(SaveSpec("r", block_ids, (ks,), (None,)),))


def load_plan(block_ids: tuple[int, ...], ks: tuple[str, ...], is_async: bool = False) -> StorePlan:
    return StorePlan(loads=(LoadSpec("r2", block_ids, (ks,), is_async),))


def load_back(pool: FakePool, saved: dict[str, torch.Tensor]) -> StoreWorker:
    """Load ``keys(3)``, saved from blocks 3, 0, 7 of ``saved``, into blocks 5, 6, 1 of
    other caches, and check every layer's pages came back whole; the loading worker."""
    dst = kv_caches(2)
    worker = make(pool, dst)
    worker.start_loads(load_plan((5, 6, 1), keys(3)))
    assert worker.take_invalid_block_ids() == set()
    for name in saved:
        for s, d in ((3, 5), (0, 6), (7, 1)):
            assert torch.equal(saved[name][s], dst[name][d])
    return worker


def test_pages_round_trip_between_engines() -> None:
    pool = FakePool()
    src = kv_caches(1)
    make(pool, src).save(save_plan((3, 0, 7), keys(3)))
    assert len(pool.objects) == 3
    assert list(pool.parents.values()) == [None, keys(3)[0], keys(3)[1]]
    worker = load_back(pool, src)
    assert worker.counters["loaded_blocks"] == 3 and pool.leases == 0


def test_failed_block_and_everything_after_it_are_reported() -> None:
    pool = FakePool()
    src, dst = kv_caches(1), kv_caches(2)
    before = {n: t.clone() for n, t in dst.items()}
    make(pool, src).save(save_plan((0, 1, 2, 3), keys(4)))
    pool.corrupt.add(keys(4)[1])
    worker = make(pool, dst)
    worker.start_loads(load_plan((8, 9, 10, 11), keys(4)))
    assert worker.take_invalid_block_ids() == {9, 10, 11}
    assert worker.take_invalid_block_ids() == set()  # reported once
    # The unreadable object is dropped so that vLLM's recomputed copy can replace it.
    assert keys(4)[1] not in pool.objects and keys(4)[2] in pool.objects
    assert worker.counters["dropped_blocks"] == 1
    for name in src:
        assert torch.equal(dst[name][8], src[name][0])
        # read in place: the corrupt copy's bytes landed in block 9 before its checksum
        # failed, which is why it (and all after it) is reported for vLLM to recompute
        assert not torch.equal(dst[name][9], before[name][9])


def test_missing_short_and_dead_pool_are_failures() -> None:
    pool = FakePool()
    worker = make(pool, kv_caches(3))
    worker.start_loads(load_plan((1, 2), keys(2)))
    assert worker.take_invalid_block_ids() == {1, 2}
    pool.objects[keys(1, "s")[0]] = b"short"
    worker.start_loads(load_plan((4,), keys(1, "s")))
    assert worker.take_invalid_block_ids() == {4}
    pool.down = True
    worker.start_loads(load_plan((5,), keys(1)))
    assert worker.take_invalid_block_ids() == {5}
    assert pool.calls["remove"] == 2  # the two misses above; nothing while the pool is down


def wait_finished(worker: StoreWorker, finished: set[str] | None = None) -> set[str]:
    return wait_until(
        lambda: worker.finished_loads(finished or set()),
        timeout_s=10,
        interval_s=0.01,
        what="the async load to finish",
    )


def test_async_load_reports_once_with_its_failures() -> None:
    pool = FakePool()
    src, dst = kv_caches(1), kv_caches(2)
    make(pool, src).save(save_plan((0, 1), keys(2)))
    pool.objects.pop(keys(2)[1])
    worker = make(pool, dst)
    worker.start_loads(load_plan((6, 7), keys(2), is_async=True))
    assert wait_finished(worker) == {"r2"}
    assert worker.take_invalid_block_ids() == {7}
    assert worker.finished_loads(set()) == set()
    assert all(torch.equal(dst[n][6], src[n][0]) for n in src)
    worker.shutdown()


def test_aborted_async_load_is_still_reported() -> None:
    pool = FakePool()
    worker = make(pool, kv_caches(1))
    make(pool, kv_caches(2)).save(save_plan(tuple(range(12)), keys(12)))
    worker.start_loads(load_plan(tuple(range(12)), keys(12), is_async=True))
    assert wait_finished(worker, {"r2"}) == {"r2"}
    worker.shutdown()


def test_save_stops_at_a_full_pool_but_skips_a_conflict() -> None:
    pool = FakePool()
    worker = make(pool, kv_caches(1))
    pool.conflict.add(keys(3)[0])
    worker.save(save_plan((0, 1, 2), keys(3)))
    assert set(pool.objects) == set(keys(3)[1:])
    pool.down = True
    worker.save(save_plan((3, 4), keys(2, "z")))
    # one engine call per save, and none after the one the dead pool refused
    assert worker.counters["save_errors"] == 1 and pool.calls["batch_put_parts"] == 2


def test_rank_picks_the_keys_of_its_own_head_group() -> None:
    pool = FakePool()
    # 4 heads in groups of 2 over TP 2: rank 1 holds heads 2 and 3, which are group 1
    worker = make(pool, kv_caches(1), rank=1, groups=HeadGroups(4, 2, 2))
    plan = StorePlan(saves=(SaveSpec("r", (0,), (keys(1, "a"), keys(1, "b")), (None, None)),))
    worker.save(plan)
    assert list(pool.objects) == [keys(1, "b")[0]]


def test_a_request_moves_in_one_engine_call_per_batch() -> None:
    pool = FakePool()
    src, dst = kv_caches(1), kv_caches(2)
    make(pool, src).save(save_plan(tuple(range(12)), keys(12)))
    assert pool.calls["batch_put_parts"] == 1 and set(pool.calls) == {"health", "batch_put_parts"}
    assert list(pool.parents.values()) == [None, *keys(12)[:-1]]  # the chain is kept
    worker = make(pool, dst)
    worker.start_loads(load_plan(tuple(range(12)), keys(12)))
    assert pool.calls["batch_get_parts"] == 1
    assert set(pool.calls) == {"health", "batch_put_parts", "batch_get_parts"}
    assert worker.take_invalid_block_ids() == set()
    assert all(torch.equal(src[n], dst[n]) for n in src)


class OversizedPool(FakePool):
    """Reads a too-large object the way kvpool's client does: the batch raises."""

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        for key, ps in zip(keys, parts, strict=True):
            if len(self.objects.get(key, b"")) > sum(p.numel() * p.element_size() for p in ps):
                self.calls["batch_get_parts"] += 1
                raise ValueError(f"buffer too small for {key}")
        return super().batch_get_parts(keys, parts)


def test_an_object_larger_than_a_page_fails_its_own_block_and_is_dropped() -> None:
    pool = OversizedPool()
    src, dst = kv_caches(1), kv_caches(2)
    make(pool, src).save(save_plan((0, 1, 2), keys(3)))
    pool.objects[keys(3)[1]] += b"extra"
    worker = make(pool, dst)
    worker.start_loads(load_plan((4, 5, 6), keys(3)))
    assert worker.take_invalid_block_ids() == {5, 6}
    assert keys(3)[1] not in pool.objects and worker.counters["dropped_blocks"] == 1
    assert all(torch.equal(dst[n][4], src[n][0]) for n in src)


class PartsRecorder(FakePool):
    """Remembers the parts each get and put was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[Any]] = []

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        self.seen.extend(list(p) for p in parts)
        return super().batch_put_parts(keys, parts, parents=parents)

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        self.seen.extend(list(p) for p in parts)
        return super().batch_get_parts(keys, parts)


def test_cpu_pages_are_handed_over_in_place_one_part_per_layer() -> None:
    pool = PartsRecorder()
    src, dst = kv_caches(1), kv_caches(2)
    make(pool, src).save(save_plan((3, 0), keys(2)))
    worker = make(pool, dst)
    worker.start_loads(load_plan((5, 6), keys(2)))
    assert worker.take_invalid_block_ids() == set()
    saved, loaded = pool.seen[:2], pool.seen[2:]
    names = list(src)
    for parts, caches, blocks in ((saved, src, (3, 0)), (loaded, dst, (5, 6))):
        for page, block in zip(parts, blocks, strict=True):
            # the cache's own rows (no staging page): one per layer, in layer order
            assert [p.data_ptr() for p in page] == [caches[n][block].data_ptr() for n in names]
    assert all(torch.equal(src[n][3], dst[n][5]) for n in names)


def test_staged_caches_reuse_one_staging_batch_per_thread() -> None:
    pool = PartsRecorder()
    src, dst = kv_caches(1), kv_caches(2)
    saver = make(pool, src)
    saver.paged = block_pages(src, staged=True)  # the device path, on CPU tensors
    saver.save(save_plan((0, 1, 2), keys(3)))
    saver.save(save_plan((4,), keys(1, "z")))
    loader = make(pool, dst)
    loader.paged = block_pages(dst, staged=True)
    loader.start_loads(load_plan((7, 8, 9), keys(3)))
    loader.start_loads(load_plan((10,), keys(1, "z")))
    assert loader.take_invalid_block_ids() == set()
    assert all(
        torch.equal(src[n][:3], dst[n][7:10]) and torch.equal(src[n][4], dst[n][10]) for n in src
    )
    # one page per part, from one staging batch allocated once per worker, not per call
    starts = [page[0].data_ptr() for page in pool.seen]
    assert all(len(page) == 1 for page in pool.seen)
    assert starts[3] == starts[0] and starts[7] == starts[4]
    assert len(set(starts[:3])) == 3 and starts[0] != starts[4]  # two workers, two batches


def test_registering_the_caches_opens_the_pool() -> None:
    """A worker's pool is open from the start (on Mooncake: its segment is in the pool
    before the first request), the async loads' connection too (a fresh instance's first
    hit sets nothing up), and one that cannot be reached is tried again later."""
    opened: list[FakePool] = []

    def opener() -> FakePool:
        opened.append(FakePool())
        return opened[-1]

    worker = StoreWorker(
        tp_rank=0,
        pool=PoolHandle(opener, reconnect_interval_s=60, describe="fake"),
        loader_pool=PoolHandle(opener, reconnect_interval_s=60, describe="fake"),
        logger=logging.getLogger("t"),
    )
    assert opened == []
    worker.register(kv_caches(1))
    assert len(opened) == 2  # the worker's and the loader's
