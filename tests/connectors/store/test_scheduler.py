from __future__ import annotations

import logging
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.connectors.store.groups import CacheGroups, HeadGroups
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.scheduler import StoreScheduler
from kvpool.core.keys import KeyNamespace, chunk_keys, group_key
from tests.connectors.store.fake_pool import FakePool

BS = 4
NS = KeyNamespace("m", "float32", BS, layout="cpu:test", tp_size=1)


class Req:
    def __init__(self, req_id: str, tokens: Sequence[int], **extra: Any) -> None:
        self.request_id = req_id
        self.all_token_ids = list(tokens)
        self.mm_features: list[Any] = []
        self.prompt_embeds = None
        self.lora_request = None
        self.cache_salt: str | None = None
        self.num_prompt_tokens = len(self.all_token_ids)  # as vLLM's Request counts
        self.max_tokens = 16
        for name, value in extra.items():
            setattr(self, name, value)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


def make(
    pool: FakePool,
    *,
    ns: KeyNamespace = NS,
    saves: bool = True,
    load_async: bool = False,
    groups: CacheGroups | HeadGroups | None = None,
    read_your_writes: bool = True,
) -> StoreScheduler:
    handle = PoolHandle(lambda: pool, reconnect_interval_s=60, describe="fake")
    return StoreScheduler(
        namespace=ns,
        pool=handle,
        saves=saves,
        load_async=load_async,
        logger=logging.getLogger("test"),
        groups=groups,
        read_your_writes=read_your_writes,
    )


def step(
    new: Sequence[tuple[str, list[int], int, int]] = (),
    cached: Sequence[tuple[str, list[int] | None, int, int]] = (),
    resumed: set[str] | None = None,
) -> Any:
    """new: (req_id, block_ids, num_computed, num_scheduled); cached likewise."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached],
            resumed_req_ids=resumed or set(),
            new_block_ids=[None if b is None else (b,) for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
        ),
        num_scheduled_tokens={r: n for r, _, _, n in [*new, *cached]},
    )


def fill(
    pool: FakePool, tokens: Sequence[int], ns: KeyNamespace = NS, upto: int | None = None
) -> None:
    for key in chunk_keys(tokens, ns)[:upto]:
        pool.objects[key.hex] = b"x"


def test_miss_then_save_plan_with_key_chain() -> None:
    pool = FakePool()
    sched = make(pool)
    req = Req("a", range(10))  # 2 full blocks + 2 tokens
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, ([],), 0)
    plan = sched.build_plan(step(new=[("a", [7, 8, 9], 0, 10)]))
    assert plan.loads == ()
    (save,) = plan.saves
    keys = [k.hex for k in chunk_keys(list(range(10)), NS)]
    assert save.block_ids == (7, 8) and save.keys == (tuple(keys),) and save.parents == (None,)
    # Nothing new next step until another block fills.
    req.all_token_ids.append(10)
    plan = sched.build_plan(step(cached=[("a", None, 10, 1)]))
    assert plan.saves == ()
    req.all_token_ids.append(11)
    plan = sched.build_plan(step(cached=[("a", None, 11, 1)]))
    (save,) = plan.saves
    keys = [k.hex for k in chunk_keys(list(range(12)), NS)]
    assert save.block_ids == (9,) and save.keys == ((keys[2],),) and save.parents == (keys[1],)


def test_a_step_that_may_end_an_answer_names_its_request_for_commit() -> None:
    # A P/D prefill (max_tokens 1) ends with the step that completes its prompt: that
    # step's saves must be in the pool before its answer leaves.
    pool = FakePool()
    sched = make(pool)
    pd = Req("pd", range(10), max_tokens=1)
    sched.get_num_new_matched_tokens(pd, 0)
    sched.update_state_after_alloc(pd, ([1, 2, 3],), 0)
    plan = sched.build_plan(step(new=[("pd", [1, 2, 3], 0, 10)]))
    assert plan.saves and plan.commit == ("pd",)
    # A chunked prompt: the first chunk's step answers nothing yet.
    chunked = Req("chunked", range(10), max_tokens=1)
    sched.get_num_new_matched_tokens(chunked, 0)
    sched.update_state_after_alloc(chunked, ([4, 5, 6],), 0)
    plan = sched.build_plan(step(new=[("chunked", [4, 5, 6], 0, 8)]))
    assert plan.saves and plan.commit == ()
    assert sched.build_plan(step(cached=[("chunked", None, 8, 2)])).commit == ("chunked",)
    # A request that goes on decoding: its first token's step does not wait (that would
    # add the put to its TTFT); any step after it may be its last, and waits.
    chat = Req("chat", range(10))
    sched.get_num_new_matched_tokens(chat, 0)
    sched.update_state_after_alloc(chat, ([7, 8, 9],), 0)
    assert sched.build_plan(step(new=[("chat", [7, 8, 9], 0, 10)])).commit == ()
    chat.all_token_ids.append(10)
    assert sched.build_plan(step(cached=[("chat", None, 10, 1)])).commit == ("chat",)
    # Nothing saved, nothing to wait for; and read_your_writes off never waits.
    short = Req("short", range(3), max_tokens=1)
    sched.get_num_new_matched_tokens(short, 0)
    sched.update_state_after_alloc(short, ([10],), 0)
    assert sched.build_plan(step(new=[("short", [10], 0, 3)])).commit == ()
    off = make(pool, read_your_writes=False)
    again = Req("again", range(20, 30), max_tokens=1)
    off.get_num_new_matched_tokens(again, 0)
    off.update_state_after_alloc(again, ([1, 2, 3],), 0)
    plan = off.build_plan(step(new=[("again", [1, 2, 3], 0, 10)]))
    assert plan.saves and plan.commit == ()


def test_hit_leaves_one_token_and_plans_the_load() -> None:
    pool = FakePool()
    tokens = list(range(100, 112))  # exactly 3 blocks
    fill(pool, tokens)
    sched = make(pool)
    req = Req("b", tokens)
    # All 3 blocks are cached and one token must be left to compute: the last block is
    # loaded all the same, and vLLM computes one token (its own cache recomputes 4).
    assert sched.get_num_new_matched_tokens(req, 0) == (11, False)
    assert sched.get_num_new_matched_tokens(req, 4) == (7, False)  # local hit of 1 block
    sched.update_state_after_alloc(req, ([5, 6, 7],), 7)
    plan = sched.build_plan(step(new=[("b", [5, 6, 7], 11, 1)]))
    (load,) = plan.loads
    keys = [k.hex for k in chunk_keys(tokens, NS)]
    assert load.block_ids == (6, 7) and load.keys == ((keys[1], keys[2]),) and not load.is_async
    # A prompt that does not end on a block boundary loads its full blocks only.
    assert make(pool).get_num_new_matched_tokens(Req("c", [*tokens, 1]), 0) == (12, False)
    assert make(pool).get_num_new_matched_tokens(Req("d", tokens[:11]), 0) == (8, False)
    # The third block was in the pool at lookup: it is not written again.
    assert plan.saves == ()
    # Counted once, at admission, with what vLLM took (not at each lookup).
    assert sched.counters["hit_tokens"] == 7 and sched.counters["lookups"] == 1
    assert sched.counters["query_tokens"] == 8
    # A later step must not re-emit the load.
    assert sched.build_plan(step(cached=[("b", None, 12, 1)])).loads == ()


def test_async_flag_and_partial_prefix() -> None:
    pool = FakePool()
    tokens = list(range(20))
    fill(pool, tokens, upto=2)
    sched = make(pool, load_async=True)
    assert sched.get_num_new_matched_tokens(Req("c", tokens), 0) == (8, True)


def fill_group(pool: FakePool, tokens: Sequence[int], group: int, upto: int) -> None:
    for key in chunk_keys(tokens, NS)[:upto]:
        pool.objects[group_key(key, group).hex] = b"x"


def test_every_head_group_must_hold_the_chunk() -> None:
    pool = FakePool()
    tokens = list(range(17))
    fill_group(pool, tokens, 0, upto=4)
    fill_group(pool, tokens, 1, upto=2)
    groups = HeadGroups(num_kv_heads=2, group_size=1, tp_size=2)
    sched = make(pool, groups=groups)
    req = Req("d", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, False)
    sched.update_state_after_alloc(req, ([1, 2, 3, 4, 5],), 8)
    (load,) = sched.build_plan(step(new=[("d", [1, 2, 3, 4, 5], 8, 9)])).loads
    assert len(load.keys) == 2 and load.keys[0] != load.keys[1]
    chain = chunk_keys(tokens, NS)[:2]
    assert load.keys[1] == tuple(group_key(k, 1).hex for k in chain)
    # All groups were probed in one round trip.
    assert pool.calls["batch_exists"] == 1 and pool.calls["prefix_lookup"] == 0


def test_group_keys_do_not_depend_on_the_readers_tp_size() -> None:
    """A TP-1 and a TP-2 reader of a 2-head model probe and load the very same objects."""
    tokens = list(range(17))
    plans = []
    for tp in (1, 2):
        pool = FakePool()
        fill_group(pool, tokens, 0, upto=4)
        fill_group(pool, tokens, 1, upto=4)
        sched = make(pool, groups=HeadGroups(2, 1, tp))
        req = Req("e", tokens)
        assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
        sched.update_state_after_alloc(req, ([1, 2, 3, 4, 5],), 16)
        (load,) = sched.build_plan(step(new=[("e", [1, 2, 3, 4, 5], 16, 1)])).loads
        assert len(load.owners) == tp  # one pin owner per rank
        plans.append(load.keys)
    assert plans[0] == plans[1]


def test_dead_pool_is_a_miss_and_probing_takes_no_lease() -> None:
    pool = FakePool()
    sched = make(pool)
    pool.down = True
    assert sched.get_num_new_matched_tokens(Req("e", range(50)), 0) == (0, False)
    assert sched.counters["lookup_errors"] == 1
    # Marked down: the next lookup does not even reach the pool.
    calls = pool.calls["prefix_lookup"]
    assert sched.get_num_new_matched_tokens(Req("f", range(50)), 0) == (0, False)
    assert pool.calls["prefix_lookup"] == calls
    assert pool.leases == 0 and pool.calls["batch_get_parts"] == 0


def test_consumer_without_put_saves_nothing() -> None:
    sched = make(FakePool(), saves=False)
    req = Req("g", range(9))
    sched.get_num_new_matched_tokens(req, 0)
    assert sched.build_plan(step(new=[("g", [0, 1, 2], 0, 9)])).saves == ()


def test_short_prompt_skips_the_pool() -> None:
    pool = FakePool()
    sched = make(pool)
    assert sched.get_num_new_matched_tokens(Req("h", range(3)), 0) == (0, False)
    assert pool.calls["prefix_lookup"] == 0
    # one whole block: its first three tokens can come from the pool
    fill(pool, range(4))
    assert sched.get_num_new_matched_tokens(Req("i", range(4)), 0) == (3, False)


def test_failed_load_moves_the_save_mark_back() -> None:
    pool = FakePool()
    tokens = list(range(13))
    fill(pool, tokens)
    sched = make(pool)
    req = Req("i", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
    sched.update_state_after_alloc(req, ([3, 4, 5, 6],), 12)
    sched.build_plan(step(new=[("i", [3, 4, 5, 6], 12, 1)]))
    sched.on_load_errors({5})
    # vLLM recomputes from block index 2; after that step the blocks are saved again.
    plan = sched.build_plan(step(cached=[("i", None, 8, 5)]))
    (save,) = plan.saves
    assert save.block_ids == (5,)


def test_resumed_request_replaces_block_ids_and_finished_is_forgotten() -> None:
    sched = make(FakePool())
    req = Req("j", range(6))
    sched.get_num_new_matched_tokens(req, 0)
    sched.build_plan(step(new=[("j", [1, 2], 0, 6)]))
    req.all_token_ids.extend([6, 7])
    plan = sched.build_plan(step(cached=[("j", [8, 9], 0, 8)], resumed={"j"}))
    (save,) = plan.saves
    assert save.block_ids == (9,)
    sched.request_finished(req)
    assert sched.num_tracked == 0


def test_unaligned_external_hit_is_rejected() -> None:
    sched = make(FakePool())
    req = Req("k", range(20))
    sched.get_num_new_matched_tokens(req, 0)
    with pytest.raises(ValueError, match="block-aligned"):
        sched.update_state_after_alloc(req, ([1, 2, 3],), 5)


def test_lora_and_cache_salt_get_their_own_keys_and_multimodal_is_skipped() -> None:
    pool = FakePool()
    tokens = list(range(13))
    fill(pool, tokens)
    sched = make(pool)
    assert sched.get_num_new_matched_tokens(Req("plain", tokens), 0) == (12, False)
    lora = SimpleNamespace(lora_name="sql-adapter")
    assert sched.get_num_new_matched_tokens(Req("l", tokens, lora_request=lora), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(Req("s", tokens, cache_salt="tenant-b"), 0) == (
        0,
        False,
    )
    image = Req("mm", tokens, mm_features=[object()])
    calls = pool.calls["prefix_lookup"]
    assert sched.get_num_new_matched_tokens(image, 0) == (0, False)
    assert pool.calls["prefix_lookup"] == calls  # not even asked
    assert sched.build_plan(step(new=[("mm", [0, 1, 2, 3], 0, 13)])).saves == ()
    # The salted request saves under its own chain, which a plain request never reads.
    plan = sched.build_plan(step(new=[("s", [4, 5, 6, 7], 0, 13)]))
    (save,) = plan.saves
    assert set(save.keys[0]).isdisjoint(pool.objects)
