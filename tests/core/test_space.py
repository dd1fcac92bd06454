from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.space import Extent, ExtentAllocator


def test_allocate_until_full_then_none() -> None:
    a = ExtentAllocator(100)
    assert a.allocate(60) == Extent(0, 60)
    assert a.allocate(40) == Extent(60, 40)
    assert a.allocate(1) is None
    assert a.used == 100 and a.free == 0
    a.check()


def test_release_coalesces_with_both_neighbours() -> None:
    a = ExtentAllocator(30)
    x, y, z = a.allocate(10), a.allocate(10), a.allocate(10)
    assert x and y and z
    a.release(x)
    a.release(z)
    assert len(a.free_extents()) == 2
    a.release(y)
    assert a.free_extents() == [Extent(0, 30)]
    a.check()


def test_exact_size_hole_is_reused() -> None:
    a = ExtentAllocator(100)
    blocks = [a.allocate(10) for _ in range(10)]
    assert all(blocks)
    a.release(Extent(50, 10))
    assert a.allocate(10) == Extent(50, 10)


def test_fragmented_space_cannot_hold_a_large_object() -> None:
    a = ExtentAllocator(30)
    x, _, z = a.allocate(10), a.allocate(10), a.allocate(10)
    assert x and z
    a.release(x)
    a.release(z)
    assert a.free == 20
    assert not a.can_allocate(20)
    assert a.allocate(20) is None


def test_release_of_unknown_extent_is_refused() -> None:
    a = ExtentAllocator(10)
    with pytest.raises(ValueError):
        a.release(Extent(0, 5))
    with pytest.raises(ValueError):
        a.allocate(0)


def test_take_marks_a_specific_free_extent_live() -> None:
    a = ExtentAllocator(100)
    assert a.take(Extent(40, 10))
    assert not a.take(Extent(45, 10))  # overlaps
    assert not a.take(Extent(95, 10))  # past the end
    assert a.free_extents() == [Extent(0, 40), Extent(50, 50)]
    a.check()


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=80))
def test_invariants_hold_over_random_allocations(ops: list[tuple[bool, int]]) -> None:
    a = ExtentAllocator(200)
    live: list[Extent] = []
    for release, n in ops:
        if release and live:
            a.release(live.pop(n % len(live)))
        else:
            got = a.allocate(n)
            if got is not None:
                live.append(got)
        a.check()
        spans = sorted((e.offset, e.end) for e in live)
        assert all(prev[1] <= nxt[0] for prev, nxt in itertools.pairwise(spans))
        assert a.used == sum(e.length for e in live)
