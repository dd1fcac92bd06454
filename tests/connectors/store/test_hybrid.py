"""Hybrid models' KV cache groups in the store connector: hit rules, plans, worker pages.

The hit rules are vLLM's own managers' (real vLLM spec objects here); the scheduler and the
worker run on plain objects and the in-memory fake pool.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool.config.kv_transfer import parse_store_config
from kvpool.connectors.store.groups import ATTENTION, STATE, CacheGroup, CacheGroups, HeadGroups
from kvpool.connectors.store.hybrid import cache_groups, group_tag, vllm_hit_rule
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.scheduler import StoreScheduler
from kvpool.connectors.store.worker import StoreWorker
from kvpool.core.keys import KeyNamespace, chunk_keys
from kvpool.errors import ConfigError
from tests.connectors.store.fake_pool import FakePool
from tests.connectors.store.test_scheduler import Req, make
from tests.waiting import wait_until

from vllm.v1.kv_cache_interface import (  # isort: skip
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

# vLLM's managers import torch's JIT helpers, which warn of their own deprecation
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BS = 4
NS = KeyNamespace("m", "float32", BS, layout="cpu:hybrid:test")
T, F = True, False


def full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)


def window(tokens: int, bs: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=tokens
    )


def mamba(mode: str = "align", bs: int = BS) -> MambaSpec:
    return MambaSpec(
        block_size=bs,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode=mode,
    )


# ------------------------------------------------------------------ vLLM's hit rules


def test_a_window_needs_only_the_chunks_it_still_sees() -> None:
    # window 9 tokens at blocks of 4: a hit at n chunks needs chunks n-2 and n-1 (vLLM's
    # SlidingWindowManager: cdiv(window - 1, block) blocks before the hit)
    rule = vllm_hit_rule([full(), window(9)], BS)
    assert rule([[T] * 6, [F, F, F, F, T, T]], 6) == 6
    assert rule([[T] * 6, [F, F, T, T, F, T]], 6) == 4  # chunks 2, 3 serve a hit of 4
    assert rule([[T] * 6, [F, F, F, F, F, T]], 6) == 0  # no two chunks in a row
    assert rule([[T, T, T, F, T, T], [T] * 6], 6) == 3  # full attention needs all
    assert rule([[T] * 6, [T] * 6], 4) == 4  # never past the limit


def test_a_state_needs_only_the_block_where_the_hit_ends() -> None:
    rule = vllm_hit_rule([mamba(), full()], BS)
    assert rule([[F, F, F, T, F], [T] * 5], 5) == 4
    assert rule([[F, T, F, F, T], [T, T, T, F, F]], 5) == 2  # narrowed to what all hold
    assert rule([[F] * 5, [T] * 5], 5) == 0


def test_groups_of_one_spec_hit_together() -> None:
    rule = vllm_hit_rule([window(9), window(9), full()], BS)
    assert rule([[T, T, T, T], [T, T, F, T], [T] * 4], 4) == 2


# ------------------------------------------------------------------ groups from vLLM's config


def config_of(*specs: Any, cacheable: tuple[int, ...] | None = None) -> Any:
    groups = [
        SimpleNamespace(kv_cache_spec=spec, layer_names=[f"layer.{i}"])
        for i, spec in enumerate(specs)
    ]
    ids = tuple(range(len(specs))) if cacheable is None else cacheable
    return SimpleNamespace(kv_cache_groups=groups, prefix_cacheable_group_ids=ids)


def vllm_config(tp: int = 1) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 1),
    )


def no_node() -> Any:
    raise AssertionError("the master is given")


STORE = parse_store_config(
    "kv_both", {"backend": "kvpool", "master": "127.0.0.1:1"}, env={}, load_node=no_node
)


def test_kinds_heads_and_tags_of_a_hybrid_model() -> None:
    groups, layout = cache_groups(vllm_config(2), config_of(mamba(), full()), STORE)
    state, attention = groups
    assert (state.kind, attention.kind) == (STATE, ATTENTION)
    assert state.heads == HeadGroups(2, 1, 2)  # a state is per rank, never split by head
    assert attention.heads.num_kv_heads == 1 and attention.heads.tp_size == 2
    assert "tp2" in state.tag and "tp" not in attention.tag  # attention is layout-free
    assert state.tag in layout and attention.tag in layout and groups.hybrid


def test_what_cannot_be_stored_is_refused_in_one_line_naming_the_group() -> None:
    with pytest.raises(ConfigError, match=r"group 0 \(MambaSpec\).*'none'.*--enable-prefix"):
        cache_groups(vllm_config(), config_of(mamba("none"), full()), STORE)
    cross = CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"group 1 \(CrossAttentionSpec\)"):
        cache_groups(vllm_config(), config_of(full(), cross), STORE)
    with pytest.raises(ConfigError, match=r"block sizes \[4, 8\]") as refused:
        cache_groups(vllm_config(), config_of(full(), window(9, bs=8)), STORE)
    assert "\n" not in str(refused.value)


def test_groups_vllm_does_not_prefix_cache_are_not_stored() -> None:
    groups, _ = cache_groups(vllm_config(), config_of(full(), window(9), cacheable=(0,)), STORE)
    assert [g.group_id for g in groups] == [0]


def test_a_changed_spec_is_another_namespace() -> None:
    assert group_tag(window(9), 1) != group_tag(window(17), 1)
    assert group_tag(mamba(), 1) != group_tag(mamba(), 2)


# ------------------------------------------------------------------ the scheduler


def hybrid_groups() -> CacheGroups:
    """group 0: a window of 9 tokens; group 1: a state; group 2: full attention."""
    return CacheGroups(
        (
            CacheGroup(0, ATTENTION, HeadGroups()),
            CacheGroup(1, STATE, HeadGroups()),
            CacheGroup(2, ATTENTION, HeadGroups()),
        ),
        vllm_hit_rule([window(9), mamba(), full()], BS),
        hybrid=True,
    )


def scheduler(pool: FakePool, groups: CacheGroups) -> StoreScheduler:
    return make(pool, ns=NS, load_async=True, groups=groups)


def step(new: Any = (), cached: Any = (), tables: Any = None) -> Any:
    """A scheduler output of a hybrid model: ``new`` and ``cached`` are (req_id, block ids
    of each group or None, computed, scheduled); ``tables`` vLLM's block state."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=c) for r, b, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached],
            resumed_req_ids=set(),
            new_block_ids=[b for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
        ),
        num_scheduled_tokens={r: n for r, _, _, n in [*new, *cached]},
        kv_connector_block_state=tables,
    )


def key_of(groups: CacheGroups, tokens: list[int], g: int, chunk: int) -> str:
    return groups.keys(g, [chunk_keys(tokens, NS)[chunk]])[0][0]


def test_each_group_has_its_own_keys_and_loads_only_what_vllm_allocated() -> None:
    pool, groups = FakePool(), hybrid_groups()
    tokens = list(range(25))  # six full chunks
    for chunk in range(6):  # everything in the pool but the state of chunks 0-3 and 5
        for g in (0, 2):
            pool.objects[key_of(groups, tokens, g, chunk)] = b"x"
    pool.objects[key_of(groups, tokens, 1, 4)] = b"x"
    keys = {key_of(groups, tokens, g, 2) for g in range(3)}
    assert len(keys) == 3 and chunk_keys(tokens, NS)[2].hex not in keys
    sched = scheduler(pool, groups)
    req = Req("h", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (20, True)  # the state ends at 5
    # vLLM allocates what each group needs (0 is its null block)
    allocated = ([0, 0, 0, 11, 12, 13], [0, 0, 0, 0, 21, 22], [31, 32, 33, 34, 35, 36])
    sched.update_state_after_alloc(req, allocated, 20)
    plan = sched.build_plan(step(new=[("h", allocated, 20, 5)]))
    loads = {spec.group: spec for spec in plan.loads}
    assert loads[0].block_ids == (11, 12) and loads[1].block_ids == (21,)
    assert loads[2].block_ids == (31, 32, 33, 34, 35)
    assert loads[1].keys == ((key_of(groups, tokens, 1, 4),),)
    assert all(spec.is_async for spec in plan.loads)
    assert len({spec.owners for spec in plan.loads}) == 1  # one request, one set of pins


class Tables:
    """vLLM's KVConnectorBlockState: current tables and boundary-state hand-offs."""

    def __init__(self, tables: dict[str, tuple[list[int], ...]], offers: Any) -> None:
        self._tables = tables
        self.boundary_state_offloads = offers

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        return self._tables.get(req_id)


def test_saves_skip_null_blocks_and_take_states_where_vllm_names_them() -> None:
    pool, groups = FakePool(), hybrid_groups()
    tokens = list(range(14))  # three full chunks
    sched = scheduler(pool, groups)
    req = Req("s", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, ((), (), ()), 0)
    first = ([1, 2, 3, 4], [0, 0, 7, 0], [8, 9, 10, 11])
    table = ([0, 2, 3, 4], [0, 0, 7, 0], [8, 9, 10, 11])  # a window nulled chunk 0 since
    # the state after 12 tokens is in block 7; after 10 tokens is no chunk boundary
    offers = Tables({"s": table}, {"s": [(1, 7, 12), (1, 5, 10)]})
    plan = sched.build_plan(step(new=[("s", first, 0, 14)], tables=offers))
    saves = {spec.group: spec for spec in plan.saves}
    assert saves[0].block_ids == (2, 3) and saves[2].block_ids == (8, 9, 10)
    assert saves[1].block_ids == (7,) and saves[1].keys == ((key_of(groups, tokens, 1, 2),),)
    assert saves[0].parents == (key_of(groups, tokens, 0, 0),)  # the chain of its own group
    # the same state handed off again is not saved twice
    again = Tables({"s": table}, {"s": [(1, 7, 12)]})
    assert sched.build_plan(step(cached=[("s", None, 14, 1)], tables=again)).saves == ()


def test_a_failed_hybrid_load_saves_what_the_request_recomputes() -> None:
    pool, groups = FakePool(), hybrid_groups()
    tokens = list(range(14))
    for chunk in range(3):
        for g in (0, 2):
            pool.objects[key_of(groups, tokens, g, chunk)] = b"x"
    pool.objects[key_of(groups, tokens, 1, 2)] = b"x"
    sched = scheduler(pool, groups)
    req = Req("f", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    table = ([0, 2, 3, 4], [0, 0, 7, 0], [8, 9, 10, 11])
    sched.update_state_after_alloc(req, table, 12)
    sched.build_plan(step(new=[("f", table, 12, 2)]))
    sched.on_failed_loads({"f"})  # vLLM recomputes it from the start
    out = step(cached=[("f", None, 0, 14)], tables=Tables({"f": table}, {"f": [(1, 7, 12)]}))
    saves = {spec.group: spec for spec in sched.build_plan(out).saves}
    assert saves[2].block_ids == (8, 9, 10) and saves[1].block_ids == (7,)


# ------------------------------------------------------------------ the worker


def state_cache(seed: int, blocks: int = 6, used: int = 40, padded: int = 64) -> torch.Tensor:
    """A Mamba layer as vLLM-CPU registers it: int8 rows of ``used`` bytes in blocks padded
    to the attention page (``padded``)."""
    g = torch.Generator().manual_seed(seed)
    backing = torch.randint(-128, 127, (blocks, padded), generator=g, dtype=torch.int8)
    return backing.as_strided((blocks, 1, 1, used), (padded, used, used, 1))


def attention_cache(seed: int, blocks: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, 1, BS, 4, generator=g)


def worker_groups() -> CacheGroups:
    return CacheGroups(
        (
            CacheGroup(0, STATE, HeadGroups(), ("ssm.0", "ssm.1")),
            CacheGroup(1, ATTENTION, HeadGroups(), ("attn.0",)),
        ),
        hybrid=True,
    )


def worker(pool: FakePool, caches: dict[str, torch.Tensor], **extra: Any) -> StoreWorker:
    def handle() -> PoolHandle:
        return PoolHandle(lambda: pool, reconnect_interval_s=60, describe="fake")

    w = StoreWorker(
        tp_rank=0,
        pool=handle(),
        loader_pool=handle(),
        logger=logging.getLogger("t"),
        groups=worker_groups(),
        **extra,
    )
    w.register(caches)
    return w


def caches(seed: int) -> dict[str, torch.Tensor]:
    return {
        "ssm.0": state_cache(seed),
        "ssm.1": state_cache(seed + 1),
        "attn.0": attention_cache(seed + 2),
    }


def plans(load_blocks: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[StorePlan, StorePlan]:
    save = StorePlan(
        saves=(
            SaveSpec("w", (2,), (("s2",),), (None,), group=0),
            SaveSpec("w", (0, 1), (("a0", "a1"),), (None,), group=1),
        )
    )
    load = StorePlan(
        loads=(
            LoadSpec("r", load_blocks[0], (("s2",),), True, group=0),
            LoadSpec("r", load_blocks[1], (("a0", "a1"),), True, group=1),
        )
    )
    return save, load


@pytest.mark.parametrize("off_the_step", [False, True])
def test_each_group_moves_its_own_pages_padded_states_included(off_the_step: bool) -> None:
    pool = FakePool()
    extra = {"save_buffer_bytes": 1 << 20} if off_the_step else {}
    src, dst = caches(1), caches(10)
    save, load = plans(((5,), (3, 4)))
    saver = worker(pool, src, **extra)
    saver.save(save)
    assert saver.wait_saved(10)
    assert len(pool.objects["s2"]) == 80 and len(pool.objects["a0"]) == BS * 4 * 4
    padding = dst["ssm.0"].as_strided((6, 64), (64, 1))[5, 40:].clone()
    loader = worker(pool, dst)
    loader.start_loads(load)
    wait_until(lambda: loader.finished_loads(set()) == {"r"}, 10)
    assert torch.equal(dst["ssm.0"][5], src["ssm.0"][2])
    assert torch.equal(dst["ssm.1"][5], src["ssm.1"][2])
    assert torch.equal(dst["attn.0"][3:5], src["attn.0"][0:2])
    # the padding after a state's bytes is another group's business: untouched
    assert torch.equal(dst["ssm.0"].as_strided((6, 64), (64, 1))[5, 40:], padding)
    assert loader.take_failed_requests() == set() and loader.take_invalid_block_ids() == set()


def test_a_failure_in_any_group_fails_the_request_not_its_blocks() -> None:
    pool = FakePool()
    save, load = plans(((5,), (3, 4)))
    worker(pool, caches(1)).save(save)
    del pool.objects["a1"]
    loader = worker(pool, caches(10))
    loader.start_loads(load)
    wait_until(lambda: loader.finished_loads(set()) == {"r"}, 10)
    assert loader.take_failed_requests() == {"r"}
    assert loader.take_invalid_block_ids() == set()  # vLLM refuses them for hybrid models


def test_an_inline_async_load_is_done_by_the_step_that_starts_it() -> None:
    """A hybrid model's loads are async for vLLM but run in the engine step: no loader
    thread waits for cores that vLLM's own threads keep busy."""
    pool = FakePool()
    src, dst = caches(1), caches(10)
    save, load = plans(((5,), (3, 4)))
    worker(pool, src).save(save)
    loader = worker(pool, dst, inline_async=True)
    loader.start_loads(load)
    # the bytes are in place before start_loads returns, and the very next poll reports it
    assert torch.equal(dst["attn.0"][3:5], src["attn.0"][0:2])
    assert torch.equal(dst["ssm.1"][5], src["ssm.1"][2])
    assert loader.finished_loads(set()) == {"r"}
    assert loader.finished_loads(set()) == set()  # once
