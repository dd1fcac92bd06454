"""ARC (Megiddo and Modha, FAST '03) as an eviction policy: ``"arc"`` as published, and
``"arc_tree"`` on the prefix tree (:class:`~kvpool.core.queue_policy.QueuePolicy`).
Two LRU lists (blocks read once, read again), a ghost list of the keys each dropped, and a
target size of the first list that ghost hits move; after vLLM's ``policies/arc.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from itertools import chain
from typing import TypeVar

from kvpool.core.prefix_nodes import QUEUED, Node
from kvpool.core.queue_policy import QueuePolicy, rotate_parents

__all__ = ["ARCPolicy"]

K = TypeVar("K", bound=Hashable)

_T1, _T2 = 0, 1  # Node.cls: the list a queued node is in


class ARCPolicy(QueuePolicy[K]):
    """T1 (written, not read since), T2 (read at least once), ghosts B1 and B2, target p.

    - A new block joins T1's tail; a block whose key is in B1 or B2 (dropped not long ago,
      wanted again) joins T2 instead, and moves p: a B1 hit raises it by
      ``max(1, |B2| / |B1|)`` (recency was worth more), a B2 hit lowers it by
      ``max(1, |B1| / |B2|)``; p stays within 0 and the most blocks held (c).
    - A read moves a block to T2's tail (from T1, or within T2).
    - The victim is T1's head while T1 holds more than p blocks (or T2 is empty), else
      T2's; its key joins B1 or B2, each kept to the last c keys.  In the tree variant a
      head with cached children is first moved to its list's tail, and a list of parents
      only gives way to the other one.
    - More victims, or past a pinned head, follow in list order (that list, then the
      other).

    Where vLLM's policy knows the cache's capacity, this one takes c as the most blocks
    it has held at once (the capacity, once the pool has filled).  Cost: O(1) per call and
    per victim; a ghost hit is one dict lookup more.
    """

    name = "arc"

    def __init__(self, tree: bool = False) -> None:
        super().__init__(tree)
        if tree:
            self.name = "arc_tree"
        self._t1: OrderedDict[K, Node[K]] = OrderedDict()
        self._t2: OrderedDict[K, Node[K]] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()
        self._p = 0.0

    @property
    def target(self) -> float:
        """p: the size T1 is steered to."""
        return self._p

    def in_t1(self, key: K) -> bool:
        """Whether ``key`` is in T1 (for tests)."""
        return key in self._t1

    def in_t2(self, key: K) -> bool:
        """Whether ``key`` is in T2 (for tests)."""
        return key in self._t2

    # ---------------------------------------------------------------- the subclass hooks
    def _admit(self, node: Node[K]) -> None:
        key = node.key
        b1, b2 = self._b1, self._b2
        if key in b1:
            self._p = min(self._p + max(1.0, len(b2) / len(b1)), float(self._most))
            del b1[key]
            node.cls = _T2
        elif key in b2:
            self._p = max(self._p - max(1.0, len(b1) / len(b2)), 0.0)
            del b2[key]
            node.cls = _T2
        else:
            node.cls = _T1

    def _place(self, node: Node[K]) -> None:
        node.where = QUEUED
        if node.reads:
            node.cls = _T2
        (self._t2 if node.cls else self._t1)[node.key] = node

    def _hit(self, node: Node[K]) -> None:
        node.reads += 1
        if node.where != QUEUED:
            return  # RUN: placed in T2 when its run ends (it was read); ORPHAN: no matter
        key = node.key
        if node.cls:
            self._t2.move_to_end(key)
        else:
            del self._t1[key]
            self._moved(node, _T2)
            self._t2[key] = node

    def _unplace(self, node: Node[K], left: bool) -> None:
        key = node.key
        if node.cls:
            del self._t2[key]
            ghosts = self._b2
        else:
            del self._t1[key]
            ghosts = self._b1
        if left:
            ghosts[key] = None
            if len(ghosts) > self._most:
                ghosts.popitem(last=False)

    def _unplace_run(self, node: Node[K]) -> None:
        ghosts = self._b2 if node.reads or node.cls else self._b1
        ghosts[node.key] = None
        if len(ghosts) > self._most:
            ghosts.popitem(last=False)

    def _from_t1(self) -> bool:
        t1, t2 = self._t1, self._t2
        if not t1:
            return False
        if not t2:
            return True
        first = len(t1) > self._p
        if self._tree:  # a list of parents only gives way to the other one
            if first and self._all_parents(_T1, t1):
                return self._all_parents(_T2, t2)
            if not first and self._all_parents(_T2, t2):
                return not self._all_parents(_T1, t1)
        return first

    def _normalize(self) -> None:
        if self._tree:
            t1 = self._from_t1()
            queue = self._t1 if t1 else self._t2
            if queue and not self._all_parents(_T1 if t1 else _T2, queue):
                rotate_parents(queue)

    def _first(self) -> Node[K] | None:
        queue = self._t1 if self._from_t1() else self._t2
        return next(iter(queue.values())) if queue else None

    def _order(self) -> Iterable[Node[K]]:
        t1, t2 = self._t1.values(), self._t2.values()
        return chain(t1, t2) if self._from_t1() else chain(t2, t1)
