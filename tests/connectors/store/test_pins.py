"""Request-owned pins of looked-up blocks: taken at lookup, ended by the load, by the
request's end or abort, or by the TTL, whichever comes first.

The scheduler and worker halves are driven as vLLM drives them (plain objects for vLLM's
requests and scheduler outputs), first over the fake pool, whose clock the tests move, then
over the embedded engine, whose index evicts for real.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch

from kvpool.connectors.store.groups import HeadGroups
from kvpool.connectors.store.plan import SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.scheduler import StoreScheduler, pin_owner
from kvpool.connectors.store.worker import StoreWorker
from kvpool.core.keys import KeyNamespace, chunk_keys
from kvpool.core.objects import IndexConfig
from kvpool.embedded import EmbeddedPool
from kvpool.engines import EmbeddedEngine, PoolEngine
from kvpool.errors import KVPoolError, NoSpace, ObjectBusy
from tests.connectors.store.fake_pool import FakePool
from tests.connectors.store.test_scheduler import Req, step
from tests.connectors.store.test_worker import BS, kv_caches
from tests.waiting import wait_until

NS = KeyNamespace("m", "float32", BS, layout="cpu:test", tp_size=1)
TOKENS = list(range(100, 113))  # 3 full blocks + 1 token: a hit of 3 blocks
LOG = logging.getLogger("test")
Caches = dict[str, torch.Tensor]


def handle(pool: PoolEngine | FakePool) -> PoolHandle:
    return PoolHandle(lambda: pool, reconnect_interval_s=60, describe="test")  # type: ignore[arg-type,return-value]


def scheduler(
    pool: PoolEngine | FakePool,
    *,
    load_async: bool = False,
    pins: bool = True,
    ns: KeyNamespace = NS,
    groups: HeadGroups | None = None,
) -> StoreScheduler:
    return StoreScheduler(
        groups=groups,
        namespace=ns,
        pool=handle(pool),
        saves=True,
        load_async=load_async,
        logger=LOG,
        pin_hits=pins,
        pin_scope="test",
    )


def worker(
    pool: PoolEngine | FakePool,
    seed: int = 2,
    rank: int = 0,
    caches: Caches | None = None,
    groups: HeadGroups | None = None,
) -> StoreWorker:
    w = StoreWorker(
        tp_rank=rank, pool=handle(pool), loader_pool=handle(pool), logger=LOG, groups=groups
    )
    w.register(kv_caches(seed) if caches is None else caches)
    return w


def stored_keys(tokens: Sequence[int] = TOKENS, ns: KeyNamespace = NS) -> list[str]:
    return [k.hex for k in chunk_keys(list(tokens), ns)]


def store(pool: PoolEngine | FakePool, tokens: Sequence[int] = TOKENS) -> list[str]:
    """Save the prompt's full blocks, as another instance that computed them would."""
    keys = stored_keys(tokens)
    block_ids = tuple(range(len(keys)))
    parents = (None,)
    worker(pool, seed=1).save(
        StorePlan(saves=(SaveSpec("other", block_ids, (tuple(keys),), parents),))
    )
    return keys


def admit(sched: StoreScheduler, req: Req, block_ids: list[int]) -> StorePlan:
    """Look the request up and let vLLM admit it with the hit; this step's plan."""
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, (block_ids,), hit)
    return sched.build_plan(step(new=[(req.request_id, block_ids, hit, len(TOKENS) - hit)]))


OWNER = pin_owner("test", "r", 0)


# ---------------------------------------------------------------- over the fake pool


def test_a_lookup_pins_the_hit_for_its_request_and_the_load_releases_it() -> None:
    pool = FakePool()
    keys = store(pool)
    sched, w = scheduler(pool), worker(pool)
    req = Req("r", TOKENS)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
    assert pool.pinned() == set(keys) and set(pool.pins) == {OWNER}
    assert pool.fill() == 0  # other traffic cannot evict what the request is about to load
    sched.update_state_after_alloc(req, ([4, 5, 6, 7],), 12)
    plan = sched.build_plan(step(new=[("r", [4, 5, 6, 7], 12, 1)]))
    (load,) = plan.loads
    assert load.owners == (OWNER,)
    w.start_loads(plan)
    assert w.take_invalid_block_ids() == set() and w.counters["loaded_blocks"] == 3
    assert pool.pinned() == set()  # released as soon as the copy is done
    sched.request_finished(req)
    assert pool.calls["release"] == 1  # the worker's: the scheduler had nothing left to end


def test_an_unreadable_pinned_block_is_unpinned_and_dropped() -> None:
    pool = FakePool()
    keys = store(pool)
    sched, w = scheduler(pool), worker(pool)
    plan = admit(sched, Req("r", TOKENS), [4, 5, 6, 7])
    pool.corrupt.add(keys[1])
    w.start_loads(plan)
    assert w.take_invalid_block_ids() == {5, 6}
    # Released before the drop (a pinned object cannot be removed), so vLLM's recomputed
    # copy can replace the corrupt one.
    assert keys[1] not in pool.objects and w.counters["dropped_blocks"] == 1
    assert pool.pinned() == set() and pool.calls["release"] == 1


def test_an_async_load_releases_when_it_ends() -> None:
    pool = FakePool()
    store(pool)
    sched, w = scheduler(pool, load_async=True), worker(pool)
    w.start_loads(admit(sched, Req("r", TOKENS), [4, 5, 6, 7]))
    wait_until(lambda: w.finished_loads(()) == {"r"}, timeout_s=30, what="the async load")
    assert pool.pinned() == set() and w.take_invalid_block_ids() == set()


def test_an_aborted_async_load_releases_its_pins_too() -> None:
    pool = FakePool()
    store(pool)
    sched, w = scheduler(pool, load_async=True), worker(pool)
    req = Req("r", TOKENS)
    w.start_loads(admit(sched, req, [4, 5, 6, 7]))
    sched.request_finished(req)  # aborted: vLLM tells both halves
    wait_until(lambda: w.finished_loads({"r"}) == {"r"}, timeout_s=30, what="the cancelled load")
    assert pool.pinned() == set()


def test_admitted_without_a_load_releases_at_once() -> None:
    pool = FakePool()
    store(pool)
    sched = scheduler(pool)
    req = Req("r", TOKENS)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
    sched.update_state_after_alloc(req, ([],), 0)  # vLLM chose not to load (e.g. no blocks)
    assert pool.pinned() == set()


def test_a_request_that_finishes_or_aborts_before_its_load_releases() -> None:
    pool = FakePool()
    store(pool)
    sched = scheduler(pool)
    req = Req("r", TOKENS)
    sched.get_num_new_matched_tokens(req, 0)
    sched.get_num_new_matched_tokens(req, 0)  # still waiting: asked again next step
    assert pool.pinned() and set(pool.pins) == {OWNER}
    sched.request_finished(req)  # aborted while waiting
    assert pool.pinned() == set() and sched.num_tracked == 0


def test_a_preempted_requests_next_lookup_pins_under_a_new_owner() -> None:
    pool = FakePool()
    keys = store(pool)
    sched = scheduler(pool)
    req = Req("r", TOKENS)
    (first,) = admit(sched, req, [4, 5, 6, 7]).loads  # handed to a worker
    assert sched.get_num_new_matched_tokens(req, 0) == (12, False)  # preempted, asked again
    (second,) = {o for o in pool.pins if o not in first.owners}
    assert second == pin_owner("test", "r", 0, generation=2)
    pool.release(first.owners[0])  # the first load's worker releases in its own time
    assert pool.pinned() == set(keys)  # ... which leaves the new lookup's pins alone
    sched.request_finished(req)
    assert pool.pinned() == set()


def test_pins_nobody_releases_end_at_the_ttl() -> None:
    pool = FakePool()
    keys = store(pool)
    sched = scheduler(pool)
    sched.get_num_new_matched_tokens(Req("r", TOKENS), 0)  # then the scheduler is gone
    pool.now_ms += pool.lease_ttl_ms - 1
    assert pool.pinned() == set(keys) and pool.fill() == 0
    pool.now_ms += 1
    assert pool.pinned() == set()
    assert pool.fill() == len(keys)


def test_a_miss_and_vllms_own_hit_pin_nothing() -> None:
    pool = FakePool()
    store(pool)
    sched = scheduler(pool)
    assert sched.get_num_new_matched_tokens(Req("miss", range(13)), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(Req("local", TOKENS), 12) == (0, False)
    assert pool.calls["pin"] == 0


def test_only_the_blocks_beyond_vllms_hit_are_pinned() -> None:
    pool = FakePool()
    keys = store(pool)
    sched = scheduler(pool)
    assert sched.get_num_new_matched_tokens(Req("r", TOKENS), 4) == (8, False)
    assert pool.pinned() == set(keys[1:])


def test_a_block_evicted_between_probe_and_pin_shortens_the_hit() -> None:
    class RacingPool(FakePool):
        def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
            self.objects.pop(stolen, None)  # another put evicted it right after the probe
            return super().pin(keys, owner, ttl_ms)

    pool = RacingPool()
    keys = store(pool)
    stolen = keys[1]
    sched = scheduler(pool)
    assert sched.get_num_new_matched_tokens(Req("r", TOKENS), 0) == (4, False)
    assert pool.calls["prefix_lookup"] == 2  # asked again once the rest was pinned


def test_a_failed_pin_leaves_the_hit_unprotected_but_a_hit() -> None:
    class NoPins(FakePool):
        def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
            raise ObjectBusy("no pins here")

    pool = NoPins()
    store(pool)
    sched = scheduler(pool)
    assert sched.get_num_new_matched_tokens(Req("r", TOKENS), 0) == (12, False)
    assert sched.counters["pin_errors"] == 1


def test_pins_can_be_turned_off_to_measure_them() -> None:
    pool = FakePool()
    store(pool)
    sched = scheduler(pool, pins=False)
    (load,) = admit(sched, Req("r", TOKENS), [4, 5, 6, 7]).loads
    assert pool.calls["pin"] == 0 and load.owners == ()


def test_each_tp_rank_has_its_own_owner_and_releases_only_its_own() -> None:
    groups = HeadGroups(num_kv_heads=4, group_size=1, tp_size=2)  # 2 heads per rank
    pool = FakePool()
    keys = groups.keys(chunk_keys(TOKENS, NS))
    for rank in range(2):
        w = worker(pool, seed=1, rank=rank, groups=groups)
        w.save(StorePlan(saves=(SaveSpec("o", (0, 1, 2), keys, (None,) * 4),)))
    assert len(pool.objects) == 12  # 3 chunks x 4 groups, each written once
    sched = scheduler(pool, groups=groups)
    plan = admit(sched, Req("r", TOKENS), [4, 5, 6, 7])
    (load,) = plan.loads
    assert load.owners == (pin_owner("test", "r", 0), pin_owner("test", "r", 1))
    assert sched.counters["pinned_blocks"] == 3  # counted in blocks, not objects
    worker(pool, rank=1, groups=groups).start_loads(plan)
    assert set(pool.pins) == {load.owners[0]}  # rank 0 has not loaded yet: still pinned
    worker(pool, rank=0, groups=groups).start_loads(plan)
    assert pool.pinned() == set()


# ---------------------------------------------------------------- over the embedded engine

PAGE = 576  # bytes of one page of tests.connectors.store.test_worker's caches


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000

    def __call__(self) -> int:
        return self.now_ms


@contextlib.contextmanager
def embedded(pages: int, clock: Clock) -> Iterator[EmbeddedEngine]:
    """A real in-process pool of ``pages`` pages, no watermark rounds, leases of 5 s on
    ``clock``."""
    config = IndexConfig(high_watermark=1.0, lease_ttl_ms=5_000)
    engine = EmbeddedEngine(EmbeddedPool(pages * PAGE, config=config, clock=clock))
    try:
        yield engine
    finally:
        engine.close()


def fill_with_others(engine: EmbeddedEngine, n: int, tag: str) -> list[KVPoolError | None]:
    keys = [f"{tag}-{i:04d}" for i in range(n)]
    return engine.batch_put_parts(keys, [[bytes(PAGE)]] * n)


def test_pinned_blocks_survive_a_fill_that_would_evict_them() -> None:
    clock = Clock()
    with embedded(6, clock) as engine:
        keys = store(engine)
        dst = kv_caches(2)
        sched, w = scheduler(engine), worker(engine, caches=dst)
        req = Req("r", TOKENS)
        assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
        # Other traffic fills the pool twice over: only the 3 free pages are reused.
        results = fill_with_others(engine, 12, "other")
        assert results[:3] == [None] * 3 and all(isinstance(r, NoSpace) for r in results[3:])
        assert engine.batch_exists(keys) == [True] * 3
        sched.update_state_after_alloc(req, ([4, 5, 6, 7],), 12)
        plan = sched.build_plan(step(new=[("r", [4, 5, 6, 7], 12, 1)]))
        w.start_loads(plan)
        assert w.take_invalid_block_ids() == set() and w.counters["loaded_blocks"] == 3
        src = kv_caches(1)  # what store() saved, blocks 0..2
        for name in src:
            for s, d in ((0, 4), (1, 5), (2, 6)):
                assert torch.equal(src[name][s], dst[name][d])
        # Loaded and released: the next fill (a pool's worth) may evict them.
        assert fill_with_others(engine, 6, "later") == [None] * 6
        assert engine.batch_exists(keys) == [False] * 3


def test_a_pool_full_of_pins_refuses_puts_until_the_pins_end() -> None:
    clock = Clock()
    with embedded(3, clock) as engine:
        keys = store(engine)
        scheduler(engine).get_num_new_matched_tokens(Req("r", TOKENS), 0)  # never loaded
        assert all(isinstance(r, NoSpace) for r in fill_with_others(engine, 2, "refused"))
        clock.now_ms += 5_000  # the pool's lease TTL: the pins end
        assert fill_with_others(engine, 3, "stored") == [None] * 3
        assert engine.batch_exists(keys) == [False] * 3
