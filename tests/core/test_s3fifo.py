"""S3-FIFO (``s3fifo``) and its prefix-tree variant (``s3fifo_tree``): the behaviour its
module docstring promises."""

from __future__ import annotations

import pytest

from kvpool.core.s3fifo import S3FIFOPolicy
from tests.core.policy_calls import always, chain, read


def test_parameters_are_validated() -> None:
    for bad in ({"small_ratio": 0.0}, {"small_ratio": 1.0}, {"ghost_ratio": -1.0}):
        with pytest.raises(ValueError):
            S3FIFOPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="promote_at"):
        S3FIFOPolicy(promote_at=0)


def test_a_block_never_read_leaves_the_small_fifo_before_an_older_read_one() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy()
    p.on_insert("read", None)
    p.on_insert("once", None)  # younger, but only written
    read(p, ["read"])
    assert p.choose_victims(1, always) == ["once"]
    assert p.in_main("read") and p.in_small("once")  # the read block moved on
    assert p.choose_victims(1, always) == ["once"]  # a second choice: same answer


def test_without_the_read_the_small_fifo_is_first_in_first_out() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy()
    p.on_insert("old", None)
    p.on_insert("new", None)
    assert p.choose_victims(1, always) == ["old"]


def test_a_block_dropped_from_the_small_fifo_and_written_again_goes_to_main() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy()
    p.on_insert("x", None)
    assert p.choose_victims(1, always) == ["x"]
    p.on_remove("x")  # evicted: its key is a ghost now
    p.on_insert("x", None)
    p.on_insert("fresh", None)
    assert p.in_main("x") and p.in_small("fresh")


def test_no_ghosts_no_promotion() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy(ghost_ratio=0.0)
    p.on_insert("x", None)
    p.on_remove("x")
    p.on_insert("x", None)
    assert p.in_small("x")


def test_in_the_main_fifo_a_block_read_more_often_lives_longer() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy()
    p.on_insert("twice", None)
    p.on_insert("once", None)
    read(p, ["twice", "twice", "once"])
    p.on_insert("new", None)
    assert p.choose_victims(1, always) == ["new"]  # the two read ones moved to main
    p.on_remove("new")
    # main: twice (2 reads), once (1): each head read since it came round goes back with
    # one read less, so "once" runs out first although "twice" is older
    assert p.choose_victims(1, always) == ["once"]
    assert p.in_main("twice") and p.in_main("once")


def test_pinned_heads_are_passed_and_stay() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy()
    for key in "abc":
        p.on_insert(key, None)
    assert p.choose_victims(2, lambda k: k != "a") == ["b", "c"]
    assert p.choose_victims(1, always) == ["a"]


def test_the_published_variant_ignores_parents() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy()
    chain(p, ["a", "b", "c"])
    assert p.choose_victims(1, always) == ["a"]  # the root first: FIFO order


def test_the_tree_variant_trims_a_chain_from_its_tail() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy(tree=True)
    assert p.name == "s3fifo_tree"
    chain(p, ["a", "b", "c"])
    p.on_insert("x", None)  # a new run: the chain is placed, deepest first
    assert p.choose_victims(3, always) == ["c", "b", "a"]
    assert p.choose_victims(1, always) == ["c"]


def test_the_tree_variant_keeps_a_parent_while_its_child_is_cached() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy(tree=True)
    p.on_insert("a", None)
    p.on_insert("x", None)
    read(p, ["a"])
    p.on_insert("b", "a")  # a later request extends a: b is younger than a
    p.on_insert("y", None)
    victims = p.choose_victims(4, always)
    assert victims.index("b") < victims.index("a")
    assert p.choose_victims(1, lambda k: k != "b")[0] != "a"


def test_the_tree_variant_offers_orphans_first() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy(tree=True)
    p.on_insert("x", None)
    chain(p, ["a", "b", "c"])
    p.on_insert("y", None)
    p.on_remove("a")  # removed by hand: b and c cannot be prefix hits any more
    assert p.choose_victims(2, always) == ["c", "b"]
