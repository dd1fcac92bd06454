from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.eviction import (
    EVICTION_POLICIES,
    EVICTION_POLICY_ALIASES,
    LRUPolicy,
    PrefixAwarePolicy,
    canonical_eviction_policy,
    make_eviction_policy,
)
from tests.core.policy_calls import Model, Op, always, ops_strategy, run_ops


# ------------------------------------------------------------- names, aliases, make
def test_make_eviction_policy_knows_every_name_and_gives_fresh_instances() -> None:
    assert EVICTION_POLICIES == ("lru", "prefix_aware", "s3fifo", "s3fifo_tree", "arc", "arc_tree")
    for name in EVICTION_POLICIES:
        a, b = make_eviction_policy(name), make_eviction_policy(name)
        assert a.name == name and a is not b


def test_default_is_an_alias_of_prefix_aware() -> None:
    """``--eviction_policy default`` (the name before ``prefix_aware``) keeps working."""
    assert dict(EVICTION_POLICY_ALIASES) == {"default": "prefix_aware"}
    assert canonical_eviction_policy("default") == "prefix_aware"
    assert canonical_eviction_policy("lru") == "lru"
    policy = make_eviction_policy("default")
    assert isinstance(policy, PrefixAwarePolicy) and policy.name == "prefix_aware"


def test_make_eviction_policy_rejects_unknown_names_and_lists_the_choices() -> None:
    names = r"lru, prefix_aware, s3fifo, s3fifo_tree, arc, arc_tree, default \(= prefix_aware\)"
    with pytest.raises(ValueError, match=names):
        make_eviction_policy("lfu")


# --------------------------------------------------------------------------------- LRU
def test_lru_evicts_least_recently_used_and_reads_refresh() -> None:
    p: LRUPolicy[str] = LRUPolicy()
    for k in "abcd":
        p.on_insert(k, None)
    p.on_access("a")
    assert p.choose_victims(2, always) == ["b", "c"]
    p.on_remove("b")
    assert p.choose_victims(10, always) == ["c", "d", "a"]


def test_lru_skips_keys_that_cannot_be_evicted() -> None:
    p: LRUPolicy[str] = LRUPolicy()
    for k in "abc":
        p.on_insert(k, None)
    assert p.choose_victims(1, lambda k: k != "a") == ["b"]
    assert p.choose_victims(0, always) == []


@pytest.mark.parametrize("name", [*EVICTION_POLICIES, *EVICTION_POLICY_ALIASES])
def test_unknown_keys_and_repeated_inserts_are_harmless(name: str) -> None:
    p = make_eviction_policy(name)
    p.on_access("ghost")
    p.on_remove("ghost")
    p.on_insert("a", None)
    p.on_insert("a", None)
    p.on_remove("a")
    p.on_remove("a")
    assert p.choose_victims(5, always) == []


# ------------------------------------------------------------------ property tests
@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(EVICTION_POLICIES), ops=ops_strategy)
def test_choose_victims_contract(name: str, ops: list[Op]) -> None:
    def check(policy: LRUPolicy[int], model: Model, count: int, pinned: set[int]) -> None:
        def can(k: int) -> bool:
            return k not in pinned

        victims = policy.choose_victims(count, can)
        assert len(victims) == len(set(victims)), "distinct"
        assert len(victims) <= count
        assert set(victims) <= model.present, "only present keys"
        assert not set(victims) & pinned, "only evictable keys"
        evictable = len(model.present - pinned)
        assert len(victims) == min(count, evictable), "nothing evictable is held back"
        assert policy.choose_victims(count, can) == victims, "choosing changes nothing"

    run_ops(name, ops, check)
