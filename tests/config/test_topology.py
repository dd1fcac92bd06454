from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.config.topology import (
    HeadSlice,
    Topology,
    expected_pullers,
    local_heads,
    parse_topology,
    plan_pulls,
    rank_port,
)
from kvpool.errors import ConfigError


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int]:
    """(num_kv_heads, src_tp, dst_tp) that vLLM can shard: each tp divides or is divided by H."""
    heads = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))

    def tp() -> int:
        return draw(
            st.sampled_from(
                [t for t in (1, 2, 4, 8, 16, 32, 64) if t % heads == 0 or heads % t == 0]
            )
        )

    return heads, tp(), tp()


@given(layouts())
def test_every_head_of_every_decode_rank_is_covered_exactly_once(
    layout: tuple[int, int, int],
) -> None:
    heads, src_tp, dst_tp = layout
    for dst_rank in range(dst_tp):
        wanted = local_heads(heads, dst_tp, dst_rank)
        covered: list[int] = []
        plan = plan_pulls(heads, src_tp, dst_tp, dst_rank)
        # one slice per P rank: a D rank sends each P rank exactly one pull per request
        assert len({piece.src_rank for piece in plan}) == len(plan)
        for piece in plan:
            assert piece.count > 0
            src = local_heads(heads, src_tp, piece.src_rank)
            # the P rank really holds what it is asked for, and it is the same global head
            assert piece.src_start + piece.count <= len(src)
            for i in range(piece.count):
                global_head = src[piece.src_start + i]
                assert global_head == wanted[piece.dst_start + i]
                covered.append(piece.dst_start + i)
        assert sorted(covered) == list(range(len(wanted)))


@given(layouts())
def test_expected_pullers_is_the_inverse_of_the_plan(layout: tuple[int, int, int]) -> None:
    heads, src_tp, dst_tp = layout
    readers: dict[int, set[int]] = {r: set() for r in range(src_tp)}
    for dst_rank in range(dst_tp):
        for piece in plan_pulls(heads, src_tp, dst_tp, dst_rank):
            readers[piece.src_rank].add(dst_rank)
    for src_rank in range(src_tp):
        assert expected_pullers(heads, src_tp, dst_tp, src_rank) == readers[src_rank]


@given(layouts())
def test_every_head_held_by_prefill_is_the_union_of_all_ranks(layout: tuple[int, int, int]) -> None:
    heads, src_tp, _ = layout
    held = set()
    for rank in range(src_tp):
        held |= set(local_heads(heads, src_tp, rank))
    assert held == set(range(heads))


def test_guide_layout_prefill_tp8_to_decode_tp4() -> None:
    # 8 KV heads: each P rank holds 1, each D rank holds 2 = two P ranks merged.
    assert plan_pulls(8, 8, 4, 1) == [HeadSlice(2, 0, 0, 1), HeadSlice(3, 0, 1, 1)]
    assert expected_pullers(8, 8, 4, 3) == {1}


def test_decode_wider_than_prefill_splits_a_prefill_rank() -> None:
    # P tp 2 (4 heads each) -> D tp 8 (1 head each): P rank 1 serves D ranks 4..7.
    assert plan_pulls(8, 2, 8, 5) == [HeadSlice(1, 1, 0, 1)]
    assert expected_pullers(8, 2, 8, 1) == {4, 5, 6, 7}


def test_equal_tp_is_rank_to_rank_in_one_slice() -> None:
    assert plan_pulls(8, 4, 4, 2) == [HeadSlice(2, 0, 0, 2)]


def test_replicated_heads_spread_decode_ranks_over_replicas() -> None:
    # MLA-like: one latent head replicated on all 4 P ranks; D tp 2 reads from 2 different ranks.
    assert [plan_pulls(1, 4, 2, r)[0].src_rank for r in range(2)] == [0, 1]
    assert expected_pullers(1, 4, 2, 3) == frozenset()


def test_vllm_replication_rule() -> None:
    # 2 heads over tp 8: ranks 0-3 hold head 0, ranks 4-7 head 1.
    assert [local_heads(2, 8, r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(("heads", "tp"), [(6, 4), (0, 1), (4, 0), (3, 2)])
def test_unshardable_layouts_are_rejected(heads: int, tp: int) -> None:
    with pytest.raises(ValueError):
        local_heads(heads, tp, 0)


def test_rank_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError):
        local_heads(8, 4, 4)
    with pytest.raises(ValueError):
        expected_pullers(8, 4, 4, -1)


def test_rank_port_offsets_per_dp_and_tp_rank() -> None:
    assert rank_port(30000, 0, 4, 0) == 30000
    assert rank_port(30000, 0, 4, 3) == 30003
    assert rank_port(30100, 2, 4, 1) == 30109
    with pytest.raises(ConfigError, match="kv_port"):
        rank_port(65535, 0, 2, 1)


def test_parse_topology_reads_the_guides_section() -> None:
    extra = {"prefill": {"dp_size": 4, "tp_size": 8}, "decode": {"dp_size": 8, "tp_size": 4}}
    assert parse_topology(extra, "prefill") == Topology(4, 8)
    assert parse_topology(extra, "decode") == Topology(8, 4)
    assert parse_topology({}, "decode") is None
    assert parse_topology({"decode": {"tp_size": "2"}}, "decode") == Topology(1, 2)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"tp": 4}, "unknown key"),
        ({"tp_size": 0}, "positive"),
        ({"tp_size": "four"}, "integer"),
        ({"tp_size": True}, "integer"),
        ({"dp_size": 1.5}, "positive"),
        ([4, 8], "must be an object"),
    ],
)
def test_parse_topology_names_the_bad_key(section: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_topology({"decode": section}, "decode")
    assert '"decode"' in str(info.value)
