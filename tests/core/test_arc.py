"""ARC (``arc``) and its prefix-tree variant (``arc_tree``): the behaviour its module
docstring promises."""

from __future__ import annotations

from kvpool.core.arc import ARCPolicy
from tests.core.policy_calls import always, chain, read


def evict(p: ARCPolicy[str]) -> str:
    (victim,) = p.choose_victims(1, always)
    p.on_remove(victim)
    return victim


def test_a_read_moves_a_block_from_t1_to_t2() -> None:
    p: ARCPolicy[str] = ARCPolicy()
    p.on_insert("a", None)
    assert p.in_t1("a")
    read(p, ["a"])
    assert p.in_t2("a") and not p.in_t1("a")


def test_with_no_target_t1_goes_first_even_when_t2_is_older() -> None:
    p: ARCPolicy[str] = ARCPolicy()
    p.on_insert("read", None)
    read(p, ["read"])
    p.on_insert("new", None)
    assert p.target == 0
    assert p.choose_victims(1, always) == ["new"]


def test_a_ghost_of_t1_raises_the_target_and_comes_back_in_t2() -> None:
    p: ARCPolicy[str] = ARCPolicy()
    p.on_insert("a", None)
    p.on_insert("b", None)
    assert evict(p) == "a"  # T1's head; its key goes to B1
    p.on_insert("a", None)  # wanted again: T1 was too small
    assert p.target == 1
    assert p.in_t2("a")


def test_a_ghost_of_t2_lowers_the_target() -> None:
    p: ARCPolicy[str] = ARCPolicy()
    p.on_insert("a", None)
    p.on_insert("b", None)
    evict(p)
    p.on_insert("a", None)  # target 1, a in T2, b in T1
    assert evict(p) == "a"  # T1 holds no more than the target: T2's head goes, to B2
    p.on_insert("a", None)  # wanted again: T2 was too small
    assert p.target == 0
    assert p.in_t2("a")


def test_the_target_adapts_to_a_trace() -> None:
    """Blocks read once, soon after they were written: dropped from T1 too early at
    first, so B1 hits raise the target, up to its bound (the most blocks held)."""
    p: ARCPolicy[str] = ARCPolicy()
    cached: set[str] = set()
    for i in range(200):
        for key in (f"k{i}", f"k{i - 4}" if i >= 4 else f"z{i}"):
            if key in cached:
                p.on_access(key)
                continue
            if len(cached) >= 5:
                victim = evict(p)
                cached.discard(victim)
            p.on_insert(key, None)
            cached.add(key)
    assert p.target == 5


def test_ghosts_are_kept_to_the_most_blocks_held() -> None:
    p: ARCPolicy[str] = ARCPolicy()
    for key in "abc":
        p.on_insert(key, None)
    for _ in range(3):
        evict(p)
    for key in "defg":
        p.on_insert(key, None)
        evict(p)
    # only the last three keys dropped from T1 are remembered: "a" comes back as new
    p.on_insert("a", None)
    assert p.in_t1("a")
    p.on_insert("g", None)
    assert p.in_t2("g")


def test_the_published_variant_ignores_parents() -> None:
    p: ARCPolicy[str] = ARCPolicy()
    chain(p, ["a", "b", "c"])
    assert p.choose_victims(1, always) == ["a"]


def test_the_tree_variant_trims_a_chain_from_its_tail() -> None:
    p: ARCPolicy[str] = ARCPolicy(tree=True)
    assert p.name == "arc_tree"
    chain(p, ["a", "b", "c"])
    p.on_insert("x", None)
    assert p.choose_victims(3, always) == ["c", "b", "a"]


def test_the_tree_variant_moves_a_parent_past_its_younger_child() -> None:
    p: ARCPolicy[str] = ARCPolicy(tree=True)
    p.on_insert("a", None)
    p.on_insert("x", None)
    p.on_insert("b", "a")  # a's child, younger than x
    p.on_insert("y", None)
    assert p.choose_victims(1, always) == ["x"]
    assert p.choose_victims(1, always) == ["x"]  # the move made no second one
    p.on_remove("x")
    assert p.choose_victims(1, always) == ["b"]
