"""Layer-wise objects (``use_layerwise``): one pool object per layer of a group, and a
synchronous load that hands vLLM layer N while layer N+1 is still being read."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvpool.connectors.pages import block_pages
from kvpool.connectors.store.groups import HeadGroups
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.worker import StoreWorker
from kvpool.core.keys import BlockKey, KeyNamespace, chunk_keys
from kvpool.errors import ConfigError
from tests.connectors.store import test_worker as worker_tests
from tests.connectors.store.fake_pool import FakePool

NUM_BLOCKS, HEADS, BS, HEAD2, LAYERS = 12, 2, 4, 6, 3
NAMES = [f"layer.{i}" for i in range(LAYERS)]


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NUM_BLOCKS, HEADS, BS, HEAD2, generator=g) for n in NAMES}


def make(pool: FakePool, caches: dict[str, torch.Tensor], groups: HeadGroups) -> StoreWorker:
    return worker_tests.make(pool, caches, groups=groups)


def chain(n: int) -> list[BlockKey]:
    namespace = KeyNamespace(model="m", kv_dtype="float32", chunk_size=BS)
    return chunk_keys(list(range(n * BS)), namespace)


WHOLE = HeadGroups(HEADS, HEADS, 1, LAYERS)  # one group: each layer of a page is an object
PER_HEAD = HeadGroups(HEADS, 1, 1, LAYERS)  # two groups of one head, three layers each


def save(worker: StoreWorker, groups: HeadGroups, blocks: tuple[int, ...]) -> None:
    keys = groups.keys(chain(len(blocks)))
    worker.save(StorePlan(saves=(SaveSpec("w", blocks, keys, (None,) * len(keys)),)))


def load(worker: StoreWorker, groups: HeadGroups, blocks: tuple[int, ...]) -> set[int]:
    spec = LoadSpec("r", blocks, groups.keys(chain(len(blocks))), is_async=False)
    worker.start_loads(StorePlan(loads=(spec,)))
    for name in NAMES:  # what vLLM's attention layers do, in order
        worker.wait_layer(name)
    worker.finish_layer_loads()  # what wait_for_save does at the end of the step
    return worker.take_invalid_block_ids()


@pytest.mark.parametrize("groups", [WHOLE, PER_HEAD], ids=["one-group", "per-head"])
def test_each_layer_is_its_own_object_and_pages_round_trip(groups: HeadGroups) -> None:
    pool = FakePool()
    src, dst = kv_caches(1), kv_caches(2)
    save(make(pool, src, groups), groups, (3, 0, 7))
    # blocks x groups x layers objects, each one layer's bytes of its heads
    assert len(pool.objects) == 3 * groups.num_groups * LAYERS
    layer_bytes = HEADS * BS * HEAD2 * 4
    assert {len(v) for v in pool.objects.values()} == {layer_bytes // groups.num_groups}
    # each layer chains to the same layer of the chunk before it
    keys = groups.keys(chain(3))
    for column in keys:
        assert [pool.parents[k] for k in column] == [None, column[0], column[1]]
    worker = make(pool, dst, groups)
    assert load(worker, groups, (5, 6, 1)) == set()
    for name in NAMES:
        for s, d in ((3, 5), (0, 6), (7, 1)):
            assert torch.equal(src[name][s], dst[name][d])
    assert worker.counters["loaded_blocks"] == 3 and pool.leases == 0


class HeldLayers(FakePool):
    """Holds every read of a layer-1 object until ``go`` is set."""

    def __init__(self, layer1: set[str]) -> None:
        super().__init__()
        self.layer1 = layer1
        self.go = threading.Event()
        self.waiting = threading.Event()

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        if self.layer1 & set(keys):
            self.waiting.set()
            assert self.go.wait(30)
        return super().batch_get_parts(keys, parts)


def test_a_failed_layer_fails_its_block_and_later_ones_and_no_wait_hangs() -> None:
    pool = FakePool()
    src, dst = kv_caches(1), kv_caches(2)
    save(make(pool, src, WHOLE), WHOLE, (0, 1, 2, 3))
    keys = WHOLE.keys(chain(4))
    pool.corrupt.add(keys[1][2])  # layer 1 of block 2
    worker = make(pool, dst, WHOLE)
    assert load(worker, WHOLE, (8, 9, 10, 11)) == {10, 11}
    assert keys[1][2] not in pool.objects  # dropped, so the recomputed copy replaces it
    for name in NAMES:  # blocks before the failure are whole in every layer
        assert torch.equal(dst[name][8:10], src[name][0:2])
    # layer 2 was not read for the failed blocks at all
    assert pool.calls["batch_get_parts"] == 3
    assert worker.counters["loaded_blocks"] == 2 and worker.counters["failed_blocks"] == 2


def test_a_dead_pool_fails_every_block_and_releases_every_layer() -> None:
    pool = FakePool()
    worker = make(pool, kv_caches(2), WHOLE)
    pool.down = True
    assert load(worker, WHOLE, (1, 2)) == {1, 2}


def test_layer_wise_async_loads_report_once() -> None:
    pool = FakePool()
    src, dst = kv_caches(1), kv_caches(2)
    save(make(pool, src, WHOLE), WHOLE, (0, 1))
    worker = make(pool, dst, WHOLE)
    spec = LoadSpec("a", (6, 7), WHOLE.keys(chain(2)), is_async=True)
    worker.start_loads(StorePlan(loads=(spec,)))
    worker.wait_layer("layer.0")  # no layer-wise load in the step: returns at once
    assert worker_tests.wait_finished(worker) == {"a"}
    assert worker.finished_loads(set()) == set()  # reported once
    assert worker.take_invalid_block_ids() == set()
    assert all(torch.equal(dst[n][6:8], src[n][0:2]) for n in NAMES)


def test_a_layer_count_other_than_the_caches_is_refused() -> None:
    with pytest.raises(ConfigError, match="layers"):
        make(FakePool(), kv_caches(1), HeadGroups(HEADS, HEADS, 1, LAYERS + 1))


@pytest.mark.parametrize("groups", [WHOLE, PER_HEAD], ids=["one-group", "per-head"])
def test_caches_on_a_device_go_layer_by_layer_through_host_staging(groups: HeadGroups) -> None:
    """The device path, on CPU tensors: each layer is read into host staging and copied
    into the cache before its layer is handed over; a failure fails the same blocks."""
    pool = FakePool()
    src, dst = kv_caches(1), kv_caches(2)
    saver = make(pool, src, groups)
    saver.paged = block_pages(src, staged=True)
    save(saver, groups, (0, 1, 2))
    assert len(pool.objects) == 3 * groups.num_groups * LAYERS
    loader = make(pool, dst, groups)
    loader.paged = block_pages(dst, staged=True)
    assert load(loader, groups, (4, 5, 6)) == set()
    assert all(torch.equal(dst[n][4:7], src[n][0:3]) for n in NAMES)
    pool.corrupt.add(groups.keys(chain(3))[2][1])  # column 2, block 1
    assert load(loader, groups, (7, 8, 9)) == {8, 9}
    assert all(torch.equal(dst[n][7], src[n][0]) for n in NAMES)


def test_a_steps_loads_are_read_layer_major_so_layer_zero_waits_for_no_layer_one() -> None:
    keys_a, keys_b = WHOLE.keys(chain(2)), WHOLE.keys(chain(3)[1:])
    pool = HeldLayers(set(keys_a[1]) | set(keys_b[1]))  # layer 1 of both requests held
    src, dst = kv_caches(1), kv_caches(2)
    save(make(pool, src, WHOLE), WHOLE, (0, 1, 2))
    worker = make(pool, dst, WHOLE)
    a = LoadSpec("a", (4, 5), keys_a, is_async=False)
    b = LoadSpec("b", (6, 7), keys_b, is_async=False)
    worker.start_loads(StorePlan(loads=(a, b)))
    worker.wait_layer("layer.0")  # both requests' layer 0, with neither's layer 1 read
    assert pool.waiting.wait(30)
    assert torch.equal(dst["layer.0"][4:6], src["layer.0"][0:2])
    assert torch.equal(dst["layer.0"][6:8], src["layer.0"][1:3])
    assert not torch.equal(dst["layer.1"][4], src["layer.1"][0])  # still held
    pool.go.set()
    for name in NAMES[1:]:
        worker.wait_layer(name)
    worker.finish_layer_loads()
    assert worker.take_invalid_block_ids() == set()
    assert all(torch.equal(dst[n][4:6], src[n][0:2]) for n in NAMES)
    assert all(torch.equal(dst[n][6:8], src[n][1:3]) for n in NAMES)


def test_a_loader_that_crashes_fails_every_block_of_the_step() -> None:
    pool = FakePool()
    src, dst = kv_caches(1), kv_caches(2)
    save(make(pool, src, WHOLE), WHOLE, (0, 1))
    worker = make(pool, dst, WHOLE)

    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug")

    worker._read = broken  # type: ignore[method-assign]
    assert load(worker, WHOLE, (4, 5)) == {4, 5}  # nothing it wrote is trusted
