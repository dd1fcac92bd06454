"""The nodes of the prefix-aware policy (:mod:`kvpool.core.prefix_aware`), and the two
ways it takes victims from a sequence of them that need no queue: in order (orphans, the
current run) and, last, the nodes passed over for their children."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

import msgspec

__all__ = [
    "ORPHAN",
    "QUEUED",
    "RUN",
    "Fifo",
    "Node",
    "detach",
    "kid_keys",
    "new_node",
    "orphans_below",
    "take_in_order",
    "take_passed",
    "take_victims",
]

K = TypeVar("K", bound=Hashable)

QUEUED, RUN, ORPHAN = 0, 1, 2  # where a node of the policy sits


class Node(msgspec.Struct, Generic[K], gc=False, eq=False):
    """One cached block of the prefix-aware policy.

    A Struct built in C (one is made per insert) that the cycle collector does not track
    (``gc=False``), compared and hashed by identity (``eq=False``, as a plain object).
    Untracked is safe only because nodes make no cycles: a node refers up to its parent,
    and down or along a :class:`Fifo` only by key (``kids``, ``older``, ``newer``), so a
    policy dropped whole is freed by reference counts.  Tracked, the policy's nodes were
    a fifth of an index replay's time in collections.  One node per cached block: every
    field is master memory at millions of blocks."""

    key: K
    parent: Node[K] | None
    orphan: bool
    # The cached children's keys (:func:`kid_keys`): None, the one child's key (a chain's
    # usual case: a dict of one was 180 bytes a block), or a dict of two or more, not a
    # set, so that orphaned subtrees are queued in an order that does not depend on hashes.
    kids: K | dict[K, None] | None = None
    children: int = 0  # how many kids, kept apart because it is read on every choice
    reads: int = 0
    stamp: int = 0  # the policy's clock when the node was last placed in a queue
    cls: int = 0  # reuse class = queue index while queued
    where: int = RUN
    older: K | None = None  # the neighbours' keys in its Fifo, while in one
    newer: K | None = None


def kid_keys(node: Node[K]) -> Iterable[K]:
    """The keys of ``node``'s cached children, oldest first."""
    kids = node.kids
    if kids is None:
        return ()
    return kids if isinstance(kids, dict) else (kids,)


class Fifo(Generic[K]):
    """Nodes in the order they were appended, linked through the nodes themselves by key:
    two fields of a node where an OrderedDict entry was 90 bytes a block, with the same
    O(1) append, removal and head."""

    __slots__ = ("_nodes", "_size", "head", "tail")

    def __init__(self, nodes: dict[K, Node[K]]) -> None:
        self._nodes = nodes  # the policy's nodes: a node in the queue is among them
        self.head: Node[K] | None = None
        self.tail: Node[K] | None = None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Node[K]]:
        nodes, node = self._nodes, self.head
        while node is not None:
            yield node
            newer = node.newer
            node = None if newer is None else nodes[newer]

    def append(self, node: Node[K]) -> None:
        tail = self.tail
        node.newer = None
        if tail is None:
            node.older = None
            self.head = node
        else:
            node.older = tail.key
            tail.newer = node.key
        self.tail = node
        self._size += 1

    def remove(self, node: Node[K]) -> None:
        """Unlink ``node`` (its neighbours are still among the nodes, even when ``node``
        has just left them)."""
        nodes = self._nodes
        older, newer = node.older, node.newer
        if older is None:
            self.head = None if newer is None else nodes[newer]
        else:
            nodes[older].newer = newer
        if newer is None:
            self.tail = None if older is None else nodes[older]
        else:
            nodes[newer].older = older
        node.older = node.newer = None
        self._size -= 1


def new_node(nodes: dict[K, Node[K]], key: K, p: Node[K] | None) -> Node[K]:
    """A node for ``key`` entered in ``nodes``, linked under ``p`` (its cached parent) when
    there is one; an orphaned parent's child is an orphan too."""
    if p is None:
        node = nodes[key] = Node(key, None, False)
        return node
    node = nodes[key] = Node(key, p, p.orphan)
    kids = p.kids
    if kids is None:
        p.kids = key
    elif isinstance(kids, dict):
        kids[key] = None
    else:
        p.kids = {kids: None, key: None}
    p.children += 1
    return node


def detach(nodes: dict[K, Node[K]], node: Node[K]) -> list[Node[K]]:
    """Unlink a node that left (already out of ``nodes``) from its parent and children;
    its children, now roots without a parent, are returned for the caller to orphan."""
    roots: list[Node[K]] = []
    if node.children:
        for kid_key in kid_keys(node):
            kid = nodes[kid_key]
            kid.parent = None
            roots.append(kid)
    p = node.parent
    if p is not None:
        kids = p.kids
        if isinstance(kids, dict):
            del kids[node.key]
        else:
            assert kids == node.key, f"{node.key} is not a child of {p.key}"
            p.kids = None
        p.children -= 1
    return roots


def orphans_below(nodes: dict[K, Node[K]], root: Node[K]) -> list[Node[K]]:
    """``root`` and the nodes under it not yet orphans, marked orphan, deepest first: a
    subtree that lost its parent can be no prefix hit any more."""
    found: list[Node[K]] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node.orphan:
            continue
        node.orphan = True
        found.append(node)
        if node.children:
            stack.extend([nodes[k] for k in kid_keys(node)])
    found.reverse()  # children were found after their parents
    return found


def take_victims(
    count: int,
    can_evict: Callable[[K], bool],
    orphans: Iterable[Node[K]],
    queued: Iterable[Node[K]],
    run: list[Node[K]],
) -> list[K]:
    """Up to ``count`` (>= 1) evictable keys, descendants before ancestors: ``orphans`` in
    their order, then ``queued`` in the policy's order, then the current ``run`` deepest
    first (it holds the youngest blocks: only if needed), and last the nodes passed over
    for their children (:func:`take_passed`).  ``queued`` is read only as far as needed,
    so it may be a generator that walks the queues lazily."""
    out: list[K] = []
    chosen: dict[Node[K], int] = {}  # node -> how many of its children are in ``out``
    passed: list[Node[K]] = []  # evictable nodes passed over for their children
    take_in_order(orphans, count, can_evict, out, chosen, passed)
    if len(out) < count:
        take_in_order(queued, count, can_evict, out, chosen, passed)
    if len(out) < count and run:
        take_in_order(reversed(run), count, can_evict, out, chosen, passed)
    if len(out) < count and passed:
        take_passed(count, out, chosen, passed)
    return out


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
