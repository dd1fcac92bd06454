from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.eviction import (
    DEFAULT_WEIGHTS,
    POLICY_NAMES,
    LRUPolicy,
    PrefixAwarePolicy,
    make_policy,
)


def always(_: object) -> bool:
    return True


def chain(policy: LRUPolicy[str] | PrefixAwarePolicy[str], keys: list[str]) -> None:
    """Insert keys as one chain, root first (the order a request writes its blocks)."""
    parent: str | None = None
    for key in keys:
        policy.on_insert(key, parent)
        parent = key


def read(policy: LRUPolicy[str] | PrefixAwarePolicy[str], keys: list[str]) -> None:
    for key in keys:
        policy.on_access(key)


# ------------------------------------------------------------------------ make_policy
def test_make_policy_knows_every_name_and_gives_fresh_instances() -> None:
    assert POLICY_NAMES == ("lru", "default")
    for name in POLICY_NAMES:
        a, b = make_policy(name), make_policy(name)
        assert a.name == name and a is not b


def test_make_policy_rejects_unknown_names_and_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="lru, default"):
        make_policy("lfu")


def test_default_weights_are_validated() -> None:
    with pytest.raises(ValueError):
        PrefixAwarePolicy([1.0])
    with pytest.raises(ValueError):
        PrefixAwarePolicy([1.0, 0.0])
    assert len(DEFAULT_WEIGHTS) >= 2


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


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_unknown_keys_and_repeated_inserts_are_harmless(name: str) -> None:
    p = make_policy(name)
    p.on_access("ghost")
    p.on_remove("ghost")
    p.on_insert("a", None)
    p.on_insert("a", None)
    p.on_remove("a")
    p.on_remove("a")
    assert p.choose_victims(5, always) == []


# ----------------------------------------------------------------------------- default
def test_default_trims_a_chain_from_its_tail() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["a", "b", "c"])
    p.on_insert("x", None)  # a new run: the chain is placed, deepest first
    assert p.choose_victims(3, always) == ["c", "b", "a"]


def test_default_never_offers_a_block_whose_child_is_still_cached() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["a", "b"])
    p.on_insert("x", None)
    read(p, ["x"])  # x is read: it should outlive a and b if the tree allowed it
    # b is pinned: a stays (its child is cached) while another victim exists.
    assert p.choose_victims(1, lambda k: k != "b") == ["x"]


def test_default_passes_over_an_older_parent_whose_child_came_later() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    p.on_insert("a", None)
    p.on_insert("x", None)
    p.on_insert("b", "a")  # a later request extends a: a is now older than its child
    p.on_insert("y", None)
    assert p.choose_victims(1, always) == ["x"]
    victims = p.choose_victims(4, always)
    assert set(victims) == {"a", "b", "x", "y"} and victims.index("b") < victims.index("a")


def test_default_takes_a_parent_of_a_pinned_child_rather_than_nothing() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["a", "b"])
    p.on_insert("x", None)
    # Only a is evictable: better an orphan than a put failing with NoSpace.
    assert p.choose_victims(1, lambda k: k == "a") == ["a"]


def test_default_offers_orphans_before_anything_else() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    p.on_insert("old", None)
    chain(p, ["a", "b", "c"])
    p.on_insert("y", None)
    p.on_remove("a")  # removed by hand: b and c can never be a prefix hit again
    assert p.choose_victims(2, always) == ["c", "b"]
    assert p.choose_victims(4, always)[2:] == ["old", "y"]


def test_default_offers_orphaned_siblings_in_the_order_they_came() -> None:
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


def test_default_gives_read_blocks_a_longer_life_than_never_read_ones() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    p.on_insert("hot", None)
    read(p, ["hot"])
    read(p, ["hot"])  # hot: read twice, placed first (oldest)
    chain(p, ["n1", "n2"])  # never read, younger
    p.on_insert("z", None)
    # LRU would take hot first; the default takes the never-read chain's tail first.
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


def test_default_a_block_written_again_after_eviction_lives_like_a_read_one() -> None:
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


def test_default_ghost_lists_remember_one_to_two_times_ghost_factor_blocks() -> None:
    # one block held at most, factor 2: generations of 2 keys, {a, b} then {c, d}, and
    # {e} growing: a is forgotten (new again, the oldest never-read block), c is not
    assert forgotten_block_order(ghost_factor=2.0) == ["a", "f1"]
    # factor 3: {a, b, c} and {d, e}: a is remembered and outlives f1
    assert forgotten_block_order(ghost_factor=3.0) == ["f1", "a"]


def test_default_ghost_factor_is_validated() -> None:
    with pytest.raises(ValueError, match="ghost_factor"):
        PrefixAwarePolicy(ghost_factor=-1.0)


def test_default_a_never_read_leaf_goes_before_an_older_inner_block() -> None:
    p: PrefixAwarePolicy[str] = PrefixAwarePolicy()
    chain(p, ["r", "s"])  # r inner, s the never-read leaf at the end of the chain
    p.on_insert("q", None)
    chain(p, ["u", "v"])
    p.on_insert("w", None)
    # s is placed before q and u, v; removing it makes r a leaf again.
    victims = p.choose_victims(6, always)
    assert victims.index("s") < victims.index("r")
    assert set(victims) == {"r", "s", "q", "u", "v", "w"}


def test_default_keeps_a_shared_root_while_any_branch_is_cached() -> None:
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
Op = tuple[str, int, int]
ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "insert", "access", "remove", "choose"]),
        st.integers(0, 11),
        st.integers(-1, 11),
    ),
    max_size=80,
)


class Model:
    """What the policies are told: present keys and the parent links they can know."""

    def __init__(self) -> None:
        self.present: set[int] = set()
        self.parent: dict[int, int | None] = {}

    def insert(self, key: int, parent: int | None) -> None:
        if key in self.present:
            return
        self.present.add(key)
        self.parent[key] = parent if parent in self.present else None

    def remove(self, key: int) -> None:
        self.present.discard(key)
        for k in self.present:
            if self.parent.get(k) == key:
                self.parent[k] = None

    def children(self, key: int) -> set[int]:
        return {k for k in self.present if self.parent.get(k) == key}


def run_ops(name: str, ops: list[Op], check: Callable[..., None]) -> None:
    policy = make_policy(name)
    model = Model()
    for op, key, arg in ops:
        if op == "insert":
            parent = arg if arg >= 0 and arg != key else None
            policy.on_insert(key, parent)
            model.insert(key, parent)
        elif op == "access":
            policy.on_access(key)
        elif op == "remove":
            policy.on_remove(key)
            model.remove(key)
        else:
            count = key if key < 8 else 1  # one victim is the index's common request
            pinned = {k for k in model.present if (k * 7 + arg) % 4 == 0}
            check(policy, model, count, pinned)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(POLICY_NAMES), ops=ops_strategy)
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


@settings(max_examples=300, deadline=None)
@given(ops=ops_strategy)
def test_default_chooses_children_before_their_parents(ops: list[Op]) -> None:
    def check(policy: PrefixAwarePolicy[int], model: Model, count: int, _: set[int]) -> None:
        victims = policy.choose_victims(count, always)
        position = {k: i for i, k in enumerate(victims)}
        for key, i in position.items():
            for child in model.children(key):
                assert child in position and position[child] < i, (key, child, victims)

    run_ops("default", ops, check)
