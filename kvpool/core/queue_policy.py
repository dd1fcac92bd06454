"""What the queue-based policies (s3fifo, arc) share: the node table and, in their prefix-tree
variants, parent links, runs placed deepest-first, orphans first, and a block offered only
after all its cached children.  A subclass says where a node goes, what a hit does, what a
node's leaving leaves behind (ghosts), and its order of victims.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

from kvpool.core.prefix_nodes import (
    ORPHAN,
    QUEUED,
    RUN,
    Node,
    detach,
    kid_keys,
    new_node,
    orphans_below,
    take_victims,
)

__all__ = ["QueuePolicy", "rotate_parents", "two_generation_add"]

K = TypeVar("K", bound=Hashable)


class QueuePolicy(Generic[K]):
    """The node table and the prefix rule of a queue-based policy.

    ``tree=False``: parents are ignored and every insert is placed at once (the policy
    as published).  ``tree=True``: a run of inserts that walks down one chain (a request
    writing its new blocks) is held apart and placed deepest-first when it ends, so a FIFO
    or LRU order trims chains from the tail; a node with cached children is passed over
    until they are chosen; a node that leaves with cached children orphans its subtree,
    which is offered before anything else (no prefix lookup can reach it).

    Subclasses implement ``_place`` (a node enters its queues), ``_hit`` (a read),
    ``_unplace`` (a queued node leaves its queue: remember it as a ghost or not), ``_normalize``
    (lazy work done before a choice, which must leave the answer of an immediate second
    choice unchanged: that is what "choosing changes nothing" means for these policies),
    ``_first`` (the victim after ``_normalize``, or None) and ``_order`` (every queued node,
    best victim first, for the general path).
    """

    name = ""

    def __init__(self, tree: bool) -> None:
        self._tree = tree
        self._nodes: dict[K, Node[K]] = {}
        self._run: list[Node[K]] = []
        self._orphans: OrderedDict[K, Node[K]] = OrderedDict()
        self._most = 0  # the most blocks held at once: the scale of queues and ghosts
        # Queued nodes with cached children, per queue (Node.cls): a queue made only of
        # parents is seen at once instead of by a whole turn of it on every choice (the
        # tree variants' shared prompt blocks made that 40 % of a replay's time).
        self._parents = [0, 0]

    def __len__(self) -> int:
        return len(self._nodes)

    # ------------------------------------------------------------------------- calls
    def on_insert(self, key: K, parent: K | None) -> None:
        nodes = self._nodes
        if key in nodes:
            self.on_access(key)
            return
        p = nodes.get(parent) if self._tree and parent is not None else None
        node = new_node(nodes, key, p)
        if p is not None and p.children == 1 and p.where == QUEUED:
            self._parents[p.cls] += 1
        if len(nodes) > self._most:
            self._most = len(nodes)
        self._admit(node)
        if not self._tree:
            self._place(node)
            return
        run = self._run
        if run and p is not run[-1]:
            self._place_run()
        run.append(node)

    def on_access(self, key: K) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self._hit(node)

    def on_remove(self, key: K) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        where = node.where
        if where == QUEUED:
            self._dequeue(node, True)
        elif where == RUN:
            self._run.remove(node)
            self._unplace_run(node)
        else:
            del self._orphans[key]
        for root in detach(self._nodes, node):
            self._orphan_subtree(root)
        p = node.parent
        if p is not None and not p.children and p.where == QUEUED:
            self._parents[p.cls] -= 1

    def choose_victims(self, count: int, can_evict: Callable[[K], bool]) -> list[K]:
        if count <= 0:
            return []
        self._normalize()
        if not self._orphans:
            first = self._first()
            if count == 1 and first is not None and not first.children and can_evict(first.key):
                return [first.key]
        return take_victims(count, can_evict, self._orphans.values(), self._order(), self._run)

    # --------------------------------------------------------------- for subclasses
    def _admit(self, node: Node[K]) -> None:
        """A new node, before it is placed (or held in the run): e.g. a ghost check."""

    def _place(self, node: Node[K]) -> None:
        raise NotImplementedError

    def _hit(self, node: Node[K]) -> None:
        raise NotImplementedError

    def _unplace(self, node: Node[K], left: bool) -> None:
        """A queued node leaves its queue: out of the policy (``left``, so perhaps a
        ghost) or into the orphan queue."""
        raise NotImplementedError

    def _unplace_run(self, node: Node[K]) -> None:
        """A node of the current run left (rare: only when nothing else was evictable)."""

    def _normalize(self) -> None:
        """Lazy work before a choice (none by default)."""

    def _first(self) -> Node[K] | None:
        raise NotImplementedError

    def _order(self) -> Iterable[Node[K]]:
        raise NotImplementedError

    def _moved(self, node: Node[K], cls: int) -> None:
        """A subclass moved ``node`` to queue ``cls`` (its parent counts follow)."""
        if node.children:
            self._parents[node.cls] -= 1
            self._parents[cls] += 1
        node.cls = cls

    def _all_parents(self, cls: int, queue: OrderedDict[K, Node[K]]) -> bool:
        """Whether every node of ``queue`` (a nonempty one, ``cls``) has cached children."""
        return self._parents[cls] >= len(queue)

    def check(self) -> None:
        """Assert the kept parent counts against a scan (used by tests)."""
        counts = [0, 0]
        for node in self._nodes.values():
            if node.where == QUEUED and node.children:
                counts[node.cls] += 1
            assert node.children == len(list(kid_keys(node))), node.key
        assert counts == self._parents, (counts, self._parents)

    # ---------------------------------------------------------------------- internals
    def _dequeue(self, node: Node[K], left: bool) -> None:
        if node.children:
            self._parents[node.cls] -= 1
        self._unplace(node, left)

    def _place_run(self) -> None:
        for node in reversed(self._run):
            if node.orphan:
                node.where = ORPHAN
                self._orphans[node.key] = node
            else:
                self._place(node)
                if node.children:
                    self._parents[node.cls] += 1
        self._run.clear()

    def _orphan_subtree(self, root: Node[K]) -> None:
        """A subtree lost its parent: no block in it can be a prefix hit here any more, so
        all of it moves to the orphan queue, deepest first."""
        for node in orphans_below(self._nodes, root):
            if node.where == QUEUED:
                self._dequeue(node, False)
                node.where = ORPHAN
                self._orphans[node.key] = node


def rotate_parents(queue: OrderedDict[K, Node[K]]) -> Node[K] | None:
    """Move heads with cached children to the tail until the head has none; the head, or
    None when the queue is empty or all of it are parents (then a whole turn was made,
    which leaves the order as it was, so a second call changes nothing)."""
    for _ in range(len(queue)):
        head = next(iter(queue.values()))
        if not head.children:
            return head
        queue.move_to_end(head.key)
    return None


def two_generation_add(young: set[K], old: set[K], key: K, limit: float) -> tuple[set[K], set[K]]:
    """Remember ``key`` in the young generation of a ghost list; when it holds ``limit``
    keys it becomes the old one and the old one is forgotten, so the list remembers the
    last ``limit`` to ``2 * limit`` keys for the cost of a set add."""
    young.add(key)
    if len(young) >= limit:
        return set(), young
    return young, old
