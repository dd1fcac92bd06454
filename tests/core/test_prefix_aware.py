"""The prefix-aware eviction policy (``prefix_aware``, alias ``default``): the behaviour
its module docstring promises."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from kvpool.core.eviction import LRUPolicy
from kvpool.core.prefix_aware import READ_WEIGHT_RANGE, REUSE_WEIGHTS, PrefixAwarePolicy
from tests.core.policy_calls import Model, Op, always, chain, ops_strategy, read, run_ops


def test_reuse_weights_are_validated() -> None:
    with pytest.raises(ValueError):
        PrefixAwarePolicy([1.0])
    with pytest.raises(ValueError):
        PrefixAwarePolicy([1.0, 0.0])
    assert len(REUSE_WEIGHTS) >= 2


def test_prefix_aware_trims_a_chain_from_its_tail() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["a", "b", "c"])
    p.on_insert("x", None)  # a new run: the chain is placed, deepest first
    assert p.choose_victims(3, always) == ["c", "b", "a"]


def test_prefix_aware_never_offers_a_block_whose_child_is_still_cached() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["a", "b"])
    p.on_insert("x", None)
    read(p, ["x"])  # x is read: it should outlive a and b if the tree allowed it
    # b is pinned: a stays (its child is cached) while another victim exists.
    assert p.choose_victims(1, lambda k: k != "b") == ["x"]


def test_prefix_aware_passes_over_an_older_parent_whose_child_came_later() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    p.on_insert("a", None)
    p.on_insert("x", None)
    p.on_insert("b", "a")  # a later request extends a: a is now older than its child
    p.on_insert("y", None)
    assert p.choose_victims(1, always) == ["x"]
    victims = p.choose_victims(4, always)
    assert set(victims) == {"a", "b", "x", "y"} and victims.index("b") < victims.index("a")


def test_prefix_aware_takes_a_parent_of_a_pinned_child_rather_than_nothing() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["a", "b"])
    p.on_insert("x", None)
    # Only a is evictable: better an orphan than a put failing with NoSpace.
    assert p.choose_victims(1, lambda k: k == "a") == ["a"]


def test_prefix_aware_offers_orphans_before_anything_else() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    p.on_insert("old", None)
    chain(p, ["a", "b", "c"])
    p.on_insert("y", None)
    p.on_remove("a")  # removed by hand: b and c can never be a prefix hit again
    assert p.choose_victims(2, always) == ["c", "b"]
    assert p.choose_victims(4, always)[2:] == ["old", "y"]


def test_prefix_aware_offers_orphaned_siblings_in_the_order_they_came() -> None:
    """Not in the order of their addresses (a set of nodes once decided it), so that two
    masters told the same calls evict the same blocks."""
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    p.on_insert("root", None)
    kids = [f"k{i}" for i in range(40)]
    for k in kids:
        p.on_insert(k, "root")
    p.on_insert("z", None)  # places the last kid
    p.on_remove("root")
    assert p.choose_victims(40, always) == kids


def test_prefix_aware_gives_read_blocks_a_longer_life_than_never_read_ones() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    p.on_insert("hot", None)
    read(p, ["hot"])
    read(p, ["hot"])  # hot: read twice, placed first (oldest)
    chain(p, ["n1", "n2"])  # never read, younger
    p.on_insert("z", None)
    # LRU would take hot first; prefix-aware takes the never-read chain's tail first.
    assert p.choose_victims(1, always) == ["n2"]
    lru: LRUPolicy[str] = LRUPolicy()
    lru.on_insert("hot", None)
    read(lru, ["hot", "hot"])
    chain(lru, ["n1", "n2"])
    assert lru.choose_victims(1, always) == ["hot"]


def remembered_block_order(ghost_factor: float) -> list[str]:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy(ghost_factor=ghost_factor)
    p.on_insert("a", None)
    p.on_insert("x", None)
    p.on_remove("a")  # evicted
    p.on_insert("a", None)  # written again: its conversation came back too late
    for k in ["b", "y1", "y2", "y3", "y4"]:  # b is as new as a, never read
        p.on_insert(k, None)
    return p.choose_victims(3, always)


def test_prefix_aware_a_block_written_again_after_eviction_lives_like_a_read_one() -> None:
    assert remembered_block_order(ghost_factor=2.0) == ["x", "b", "y1"]
    # without the ghost list, a is a never-read block older than b: it goes first
    assert remembered_block_order(ghost_factor=0.0) == ["x", "a", "b"]


def forgotten_block_order(ghost_factor: float) -> list[str]:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy(ghost_factor=ghost_factor)
    for k in ["a", "b", "c", "d", "e"]:  # one block held at a time
        p.on_insert(k, None)
        p.on_remove(k)
    for k in ["a", "c", "f1", "f2", "f3"]:
        p.on_insert(k, None)
    return p.choose_victims(2, always)


def test_prefix_aware_ghost_lists_remember_one_to_two_times_ghost_factor_blocks() -> None:
    # one block held at most, factor 2: generations of 2 keys, {a, b} then {c, d}, and
    # {e} growing: a is forgotten (new again, the oldest never-read block), c is not
    assert forgotten_block_order(ghost_factor=2.0) == ["a", "f1"]
    # factor 3: {a, b, c} and {d, e}: a is remembered and outlives f1
    assert forgotten_block_order(ghost_factor=3.0) == ["f1", "a"]


def test_prefix_aware_ghost_factor_is_validated() -> None:
    with pytest.raises(ValueError, match="ghost_factor"):
        PrefixAwarePolicy(ghost_factor=-1.0)


def test_prefix_aware_a_never_read_leaf_goes_before_an_older_inner_block() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["r", "s"])  # r inner, s the never-read leaf at the end of the chain
    p.on_insert("q", None)
    chain(p, ["u", "v"])
    p.on_insert("w", None)
    # s is placed before q and u, v; removing it makes r a leaf again.
    victims = p.choose_victims(6, always)
    assert victims.index("s") < victims.index("r")
    assert set(victims) == {"r", "s", "q", "u", "v", "w"}


def test_prefix_aware_keeps_a_shared_root_while_any_branch_is_cached() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    p.on_insert("root", None)
    for branch in ("a", "b", "c"):
        if branch != "a":
            read(p, ["root"])  # each request reads the shared root, then writes its own
        p.on_insert(f"{branch}1", "root")
        p.on_insert(f"{branch}2", f"{branch}1")
    p.on_insert("z", None)
    victims = p.choose_victims(7, always)
    assert victims.index("root") > max(victims.index(f"{b}1") for b in "abc")


def test_choose_victims_changes_nothing() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["a", "b", "c"])
    chain(p, ["d", "e"])
    read(p, ["d"])
    first = p.choose_victims(3, always)
    assert p.choose_victims(3, always) == first
    assert len(p) == 5


def test_a_key_in_the_current_run_is_offered_only_when_nothing_else_is() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["a", "b"])  # still the current run: the youngest blocks
    assert p.choose_victims(1, always) == ["b"]
    p.on_insert("x", None)  # places a, b; x is the run now
    assert p.choose_victims(1, always) == ["b"]


# ------------------------------------------------------------------ property tests
@settings(max_examples=300, deadline=None)
@given(ops=ops_strategy)
def test_prefix_aware_chooses_children_before_their_parents(ops: list[Op]) -> None:
    def check(policy: PrefixAwarePolicy[int], model: Model, count: int, _: set[int]) -> None:
        victims = policy.choose_victims(count, always)
        position = {k: i for i, k in enumerate(victims)}
        for key, i in position.items():
            for child in model.children(key):
                assert child in position and position[child] < i, (key, child, victims)

    run_ops("prefix_aware", ops, check)


def replay(policy: PrefixAwarePolicy[str], requests: list[list[str]], capacity: int) -> None:
    """Requests as chains of keys against ``capacity`` blocks: leading cached keys are
    read, the rest written, one victim at a time (the index's calls)."""
    cached: set[str] = set()
    for keys in requests:
        h = 0
        while h < len(keys) and keys[h] in cached:
            h += 1
        for k in keys[:h]:
            policy.on_access(k)
        for j in range(h, len(keys)):
            if len(cached) >= capacity:
                (victim,) = policy.choose_victims(1, lambda k, hit=keys[:h]: k not in hit)
                cached.discard(victim)
                policy.on_remove(victim)
            cached.add(keys[j])
            policy.on_insert(keys[j], keys[j - 1] if j else None)


def read_once_trace() -> list[list[str]]:
    """Each chain's root is read once, five requests after it was written, then never."""
    out: list[list[str]] = []
    for i in range(400):
        out.append([f"p{i}", f"q{i}"])
        if i >= 5:
            out.append([f"p{i - 5}"])
    return out


def read_often_trace() -> list[list[str]]:
    """A hot block read by every request, between one-shot chains never read."""
    return [["hot"]] + [k for i in range(400) for k in (["hot"], [f"u{i}", f"v{i}"])]


def test_the_read_weight_rises_when_read_blocks_are_not_read_again() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    replay(p, read_once_trace(), 30)
    assert p.weights[-1] == READ_WEIGHT_RANGE[1]
    assert p.weights[:-1] == REUSE_WEIGHTS[:-1]  # only the read class's weight moves


def test_the_read_weight_falls_when_read_blocks_are_read_again() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    replay(p, read_often_trace(), 30)
    assert p.weights[-1] == READ_WEIGHT_RANGE[0]


def test_fixed_weights_stay_without_adaptation() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy(adaptive=False)
    replay(p, read_once_trace(), 30)
    assert p.weights == REUSE_WEIGHTS


def test_a_dropped_policy_is_freed_without_the_cycle_collector() -> None:
    """Nodes are not tracked by the GC, so they must make no cycles: a policy with
    chains, reads and orphaned subtrees, dropped, leaves no memory behind."""
    import gc
    import tracemalloc

    def build() -> PrefixAwarePolicy[str]:
        p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
        for c in range(300):
            parent = None
            for i in range(10):
                p.on_insert(f"{c}-{i}", parent)
                parent = f"{c}-{i}"
            p.on_access(f"{c}-0")
        for c in range(0, 300, 3):
            p.on_remove(f"{c}-4")  # orphans the subtree under it
        return p

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        p = build()
        held = tracemalloc.get_traced_memory()[0] - base
        del p
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        if enabled:
            gc.enable()
    assert held > 100_000 and left < held / 20, (held, left)
