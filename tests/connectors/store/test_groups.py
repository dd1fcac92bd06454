"""KV-head groups: the mapping (properties), and pages moved between TP layouts.

The worker tests save with one TP layout and load with another through a real in-process
pool (the embedded engine), as two vLLM instances of different TP sizes would through a
master: a TP-2 instance's ranks each hold one half of the heads of a TP-1 instance's
cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpool.connectors.store.groups import HeadGroups
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle
from kvpool.connectors.store.worker import StoreWorker
from kvpool.core.keys import BlockKey, KeyNamespace, chunk_keys, group_key, layer_key
from kvpool.engines import EmbeddedEngine
from kvpool.errors import ConfigError

LOG = logging.getLogger("test")
NS = KeyNamespace("m", "float32", 4, layout="cpu:test")
CHAIN = chunk_keys(list(range(12)), NS)  # 3 chunks
BLOCKS, BS, ROW, LAYERS = 8, 4, 6, 3


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int]:
    """(num_kv_heads, group_size, tp_size) that vLLM can shard and groups can split."""
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tp = draw(
        st.sampled_from([t for t in (1, 2, 4, 8, 16, 32) if t % heads == 0 or heads % t == 0])
    )
    per_rank = max(1, heads // tp)
    group = draw(st.sampled_from([g for g in range(1, per_rank + 1) if per_rank % g == 0]))
    return heads, group, tp


@given(layouts())
def test_every_head_is_read_by_its_holders_and_written_exactly_once(
    layout: tuple[int, int, int],
) -> None:
    heads, group, tp = layout
    groups = HeadGroups(heads, group, tp)
    written: list[int] = []
    for rank in range(tp):
        reads = groups.reads(rank)
        # a rank's groups tile its local heads in order
        assert [s.head_start for s in reads] == list(range(0, len(reads) * group, group))
        assert all(s.count == group for s in reads)
        assert groups.writes(rank) in ((), reads)
        written += [s.group for s in groups.writes(rank)]
    assert sorted(written) == list(range(groups.num_groups))  # each group once, none missing
    assert groups.reads_per_chunk >= groups.num_groups


@given(layouts(), st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_pool_keys_are_the_same_in_every_tp_layout(layout: tuple[int, int, int], tp: int) -> None:
    heads, group, _ = layout
    per_rank = max(1, heads // tp)
    if (heads % tp and tp % heads) or per_rank % group:
        return  # a layout this group size does not fit (refused at start, tested below)
    a, b = HeadGroups(heads, group, layout[2]), HeadGroups(heads, group, tp)
    assert a.keys(CHAIN) == b.keys(CHAIN)


def test_group_keys_are_distinct_and_never_the_chunk_key() -> None:
    key = CHAIN[0]
    derived = {group_key(key, g) for g in range(64)}
    assert len(derived) == 64 and key not in derived
    assert group_key(key, 3) == group_key(BlockKey(key.digest), 3)  # deterministic
    assert HeadGroups(1, 1, 4).keys(CHAIN)[0] == tuple(k.hex for k in CHAIN)  # one group


def test_layer_wise_columns_are_every_layer_of_every_group() -> None:
    groups = HeadGroups(4, 1, 2, layers=3)  # 4 groups of one head, 3 layers, TP 2
    keys = groups.keys(CHAIN)
    assert groups.num_columns == len(keys) == 12 and groups.reads_per_chunk == 12
    # column g * layers + l is layer l of group g, and no two columns share a key
    assert keys[1 * 3 + 2][0] == layer_key(group_key(CHAIN[0], 1), 2).hex
    assert len({k for column in keys for k in column}) == 12 * len(CHAIN)
    slot = groups.reads(1)[0]  # rank 1's first group is group 2
    assert list(groups.columns(slot)) == [6, 7, 8]
    one = HeadGroups(1, 1, 1, layers=2)  # one group: the layers of the chunk key itself
    assert one.keys(CHAIN)[1][0] == layer_key(CHAIN[0], 1).hex
    assert HeadGroups(4, 1, 2).keys(CHAIN) == tuple(
        tuple(group_key(k, g).hex for k in CHAIN) for g in range(4)
    )  # layers 1: a column is a group, as before


def test_a_group_size_that_does_not_fit_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="head_group_size: 2 does not divide the 1 KV heads"):
        HeadGroups(num_kv_heads=4, group_size=2, tp_size=4)
    with pytest.raises(ConfigError, match="cannot be sharded"):
        HeadGroups(num_kv_heads=6, group_size=1, tp_size=4)


# ------------------------------------------------------------------ pages across layouts


def full_caches(seed: int, heads: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(BLOCKS, heads, BS, ROW, generator=g) for i in range(LAYERS)}


def rank_caches(full: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of ``tp`` holds of ``full`` (vLLM's even split of the heads)."""
    heads = next(iter(full.values())).shape[1]
    n = max(1, heads // tp)
    first = rank * n if tp <= heads else rank // (tp // heads)
    return {name: t[:, first : first + n].clone() for name, t in full.items()}


def workers(
    pool: EmbeddedEngine, caches: list[dict[str, torch.Tensor]], groups: HeadGroups, staged: bool
) -> list[StoreWorker]:
    out = []
    for rank, c in enumerate(caches):
        handle = PoolHandle(lambda: pool, reconnect_interval_s=60, describe="test")
        w = StoreWorker(tp_rank=rank, pool=handle, loader_pool=handle, logger=LOG, groups=groups)
        w.register(c, staged=staged or None)
        out.append(w)
    return out


def save(ws: list[StoreWorker], groups: HeadGroups, block_ids: tuple[int, ...]) -> None:
    keys = groups.keys(CHAIN)
    plan = StorePlan(saves=(SaveSpec("w", block_ids, keys, (None,) * groups.num_groups),))
    for w in ws:
        w.save(plan)


def load(ws: list[StoreWorker], groups: HeadGroups, block_ids: tuple[int, ...]) -> None:
    plan = StorePlan(loads=(LoadSpec("r", block_ids, groups.keys(CHAIN), is_async=False),))
    for w in ws:
        w.start_loads(plan)
        assert w.take_invalid_block_ids() == set()
        assert w.counters["loaded_blocks"] == len(block_ids)


@pytest.fixture
def pool() -> Iterator[EmbeddedEngine]:
    engine = EmbeddedEngine.create(1 << 20)
    yield engine
    engine.close()


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize(("write_tp", "read_tp"), [(2, 1), (1, 2), (1, 4), (4, 2)])
def test_what_one_tp_layout_saves_another_loads(
    pool: EmbeddedEngine, write_tp: int, read_tp: int, staged: bool
) -> None:
    heads = 4 if 4 in (write_tp, read_tp) else 2
    src, dst = full_caches(1, heads), full_caches(2, heads)
    wg, rg = HeadGroups(heads, 1, write_tp), HeadGroups(heads, 1, read_tp)
    save(
        workers(pool, [rank_caches(src, write_tp, r) for r in range(write_tp)], wg, staged),
        wg,
        (5, 0, 3),
    )
    every = [k for group_keys in wg.keys(CHAIN) for k in group_keys]
    assert len(every) == 3 * heads and all(pool.batch_exists(every))  # one per chunk and head
    readers = [rank_caches(dst, read_tp, r) for r in range(read_tp)]
    load(workers(pool, readers, rg, staged), rg, (1, 2, 6))
    for rank, got in enumerate(readers):
        want = rank_caches(src, read_tp, rank)
        for name in got:
            for s, d in ((5, 1), (0, 2), (3, 6)):
                assert torch.equal(got[name][d], want[name][s]), (rank, name, s)


def test_mla_one_latent_head_is_written_by_rank_0_only_and_read_by_all(
    pool: EmbeddedEngine,
) -> None:
    latent = full_caches(3, heads=1)
    groups = HeadGroups(1, 1, 2)  # MLA at TP 2: every rank holds the one latent head
    ranks = workers(pool, [latent, {n: t.clone() for n, t in latent.items()}], groups, False)
    ranks[1].save(StorePlan(saves=(SaveSpec("w", (0, 1, 2), groups.keys(CHAIN), (None,)),)))
    chunks = [k.hex for k in CHAIN]  # one group: the chunk keys themselves
    assert pool.batch_exists(chunks) == [False] * 3 and ranks[1].counters["saved_blocks"] == 0
    ranks[0].save(StorePlan(saves=(SaveSpec("w", (0, 1, 2), groups.keys(CHAIN), (None,)),)))
    assert pool.batch_exists(chunks) == [True] * 3 and ranks[0].counters["saved_blocks"] == 3
    readers = [full_caches(4, heads=1) for _ in range(3)]
    load(workers(pool, readers, HeadGroups(1, 1, 3), False), HeadGroups(1, 1, 3), (4, 5, 6))
    for got in readers:
        for name in got:
            assert torch.equal(got[name][4:7], latent[name][0:3])


def test_a_rank_whose_caches_disagree_with_the_groups_is_refused(pool: EmbeddedEngine) -> None:
    with pytest.raises(
        ConfigError, match=r'shows 1 KV heads per block but .* give it 2.*"head_group_size": 2'
    ):
        workers(pool, [full_caches(1, heads=1)], HeadGroups(4, 1, 2), False)
    # one group per rank moves the page whole, whatever the layout shows
    workers(pool, [full_caches(1, heads=1)], HeadGroups(4, 2, 2), False)
