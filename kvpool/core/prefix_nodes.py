"""The nodes of the prefix-aware policy (:mod:`kvpool.core.prefix_aware`), and the two
ways it takes victims from a sequence of them that need no queue: in order (orphans, the
current run) and, last, the nodes passed over for their children."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["ORPHAN", "QUEUED", "RUN", "Node", "take_in_order", "take_passed"]

K = TypeVar("K", bound=Hashable)

QUEUED, RUN, ORPHAN = 0, 1, 2  # where a node of the policy sits


class Node(Generic[K]):
    """One cached block of the prefix-aware policy."""

    __slots__ = ("children", "cls", "key", "kids", "orphan", "parent", "reads", "stamp", "where")

    def __init__(self, key: K, parent: Node[K] | None, orphan: bool) -> None:
        self.key = key
        self.parent = parent
        # cached children, created on the first one; a dict, not a set, so that orphaned
        # subtrees are queued in an order that does not depend on object addresses
        self.kids: dict[Node[K], None] | None = None
        self.children = 0  # len(kids), kept apart because it is read on every choice
        self.reads = 0
        self.stamp = 0  # the policy's clock when the node was last placed in a queue
        self.cls = 0  # reuse class = queue index while queued
        self.orphan = orphan
        self.where = RUN


def take_in_order(
    nodes: Iterable[Node[K]],
    count: int,
    can_evict: Callable[[K], bool],
    out: list[K],
    chosen: dict[Node[K], int],
    passed: list[Node[K]],
) -> None:
    """Take evictable ``nodes`` in their order, passing over those with children not yet
    chosen (into ``passed``), until ``out`` holds ``count`` keys."""
    for node in nodes:
        if not can_evict(node.key):
            continue
        if node.children and chosen.get(node, 0) < node.children:
            passed.append(node)
            continue
        out.append(node.key)
        p = node.parent
        if p is not None:
            chosen[p] = chosen.get(p, 0) + 1
        if len(out) >= count:
            return


def take_passed(
    count: int, out: list[K], chosen: dict[Node[K], int], passed: list[Node[K]]
) -> None:
    """Nothing else is left: take passed-over nodes, those whose children are all
    chosen first, then the rest (their children are pinned; better an orphan than a
    put failing with NoSpace while something is evictable)."""
    waiting = passed
    while waiting and len(out) < count:
        later: list[Node[K]] = []
        for node in waiting:
            if chosen.get(node, 0) >= node.children and len(out) < count:
                out.append(node.key)
                p = node.parent
                if p is not None:
                    chosen[p] = chosen.get(p, 0) + 1
            else:
                later.append(node)
        if len(later) == len(waiting):  # no progress: the guard cannot be met
            for node in later[: count - len(out)]:
                out.append(node.key)
            return
        waiting = later
