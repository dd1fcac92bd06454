"""What S3-FIFO and ARC share (:mod:`kvpool.core.queue_policy`): the prefix rule of their
tree variants, and the index's invariants with each of them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings

from kvpool.core.index import ObjectIndex
from kvpool.core.objects import IndexConfig
from tests.core.policy_calls import Model, Op, always, ops_strategy, run_ops


@pytest.mark.parametrize("name", ["s3fifo_tree", "arc_tree"])
@settings(max_examples=300, deadline=None)
@given(ops=ops_strategy)
def test_the_tree_variant_chooses_children_before_their_parents(name: str, ops: list[Op]) -> None:
    def check(policy: Any, model: Model, count: int, _: set[int]) -> None:
        policy.check()  # the kept parent counts
        victims = policy.choose_victims(count, always)
        policy.check()
        position = {k: i for i, k in enumerate(victims)}
        for key, i in position.items():
            for child in model.children(key):
                assert child in position and position[child] < i, (key, child, victims)

    run_ops(name, ops, check)


@pytest.mark.parametrize("name", ["s3fifo", "s3fifo_tree", "arc", "arc_tree"])
def test_the_index_keeps_its_invariants_with_the_policy(name: str) -> None:
    idx = ObjectIndex(IndexConfig(policy=name))
    idx.register_client("c", 0)
    idx.add_segment("c", "c/mem", 40)  # ten blocks of 4 bytes
    for turn in range(30):
        keys = [f"t{turn % 7}-{j}" for j in range(turn % 5 + 2)]
        h = idx.prefix_lookup(keys)
        for k in keys[:h]:
            idx.get(k, f"r{turn}", turn)
        parent = keys[h - 1] if h else None
        for k in keys[h:]:
            res, _ = idx.put_start(k, 4, f"r{turn}", turn, parent)
            if res is not None:
                idx.put_end(k, f"r{turn}", turn)
            parent = k
        idx.release_owner(f"r{turn}")
        idx.check()
    assert idx.stats.evictions > 0 and len(idx) == 10
