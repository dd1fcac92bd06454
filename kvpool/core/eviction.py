"""Eviction policies: which READY objects of one tier to drop (or demote) first.

Primitives (the :class:`EvictionPolicy` protocol; one policy instance per tier)::

    on_insert(key, parent)        the object became READY in this tier
    on_access(key)                a read hit (a lease was granted)
    on_remove(key)                the object left this tier (evicted, removed, demoted)
    choose_victims(count, can_evict) -> keys, best victim first; removes nothing

A policy is pure: no clock (its only time is the order of the calls it sees), no I/O, no
randomness.  Unknown keys in ``on_access`` / ``on_remove`` and a repeated ``on_insert`` are
harmless, so the index never has to ask first.

Invariants of every policy (tested by property tests over random call sequences):
- ``choose_victims`` returns at most ``count`` distinct keys, each currently inserted (and
  not removed since) and each with ``can_evict(key)`` True;
- it never mutates the policy: calling it twice without other calls gives the same answer;
- every call is amortised O(1) (LRU) or O(number of reuse classes) (default) per key
  touched or victim returned, so a replay runs at hundreds of thousands of blocks/s.

``"lru"`` — least recently inserted-or-read first: the baseline.

``"default"`` — kvpool's policy for prefix-chained KV blocks.  Why it looks the way it does:

1. *A child is worthless without its parent.*  A prefix lookup stops at the first missing
   block, so evicting a block silently wastes every cached descendant.  The policy
   therefore only ever offers **leaves** (blocks with no cached child in this tier) as
   victims; a chain is trimmed from its tail, and once its tail goes the parent becomes a
   leaf at the front of its queue, so a dead chain leaves as a unit.  Invariant: a block
   with cached children is never returned unless all of them come before it in the same
   answer.
2. *Orphans go first.*  If a block leaves while it still has cached descendants (removed
   by hand, its client expired, its children were leased while it was demoted), the whole
   subtree can no longer be a prefix hit here; those blocks are offered before anything
   else, leaves first.
3. *Most blocks are never read again, and reuse comes back late.*  In conversation
   traces a block is reused when its conversation returns for another turn, typically
   minutes later; a conversation that has already come back is more likely to come back
   again.  Frequency policies (segmented LRU, LFU) lose here because a never-read block
   must survive the long gap before it can prove itself.  So instead of segments of fixed
   size the policy keeps one LRU queue of leaves per *reuse class* (never read, read once,
   read twice or more) and evicts the queue head with the largest ``age * weight[class]``,
   where age counts calls since the block was last touched.  A block read before lives
   ``1 / weight`` times longer than a never-read one, whatever the cache size: the
   trade-off scales with capacity instead of being a fixed split.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "DEFAULT_WEIGHTS",
    "POLICY_NAMES",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixAwarePolicy",
    "make_policy",
]

K = TypeVar("K", bound=Hashable)

#: Age multiplier per reuse class (never read, read once, read twice or more).
DEFAULT_WEIGHTS: tuple[float, ...] = (1.0, 0.5, 0.3)


class EvictionPolicy(Protocol[K]):
    """The eviction order of one tier; see the module docstring."""

    name: str

    def on_insert(self, key: K, parent: K | None) -> None: ...

    def on_access(self, key: K) -> None: ...

    def on_remove(self, key: K) -> None: ...

    def choose_victims(self, count: int, can_evict: Callable[[K], bool]) -> list[K]: ...


class LRUPolicy(Generic[K]):
    """Least recently inserted-or-read first; O(1) per call."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_insert(self, key: K, parent: K | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: K) -> None:
        self._order.pop(key, None)

    def choose_victims(self, count: int, can_evict: Callable[[K], bool]) -> list[K]:
        out: list[K] = []
        if count <= 0:
            return out
        for key in self._order:
            if can_evict(key):
                out.append(key)
                if len(out) >= count:
                    break
        return out


class _Node(Generic[K]):
    """One cached block of the default policy."""

    __slots__ = ("children", "cls", "key", "kids", "orphan", "parent", "reads", "stamp")

    def __init__(self, key: K, parent: _Node[K] | None, stamp: int) -> None:
        self.key = key
        self.parent = parent
        self.kids: set[_Node[K]] | None = None  # cached children, created on first child
        self.children = 0  # len(kids), kept apart because it is read on every call
        self.reads = 0
        self.stamp = stamp  # call counter at the last insert or read
        self.cls = 0  # reuse class; the queue the node sits in while it is a leaf
        self.orphan = False


class PrefixAwarePolicy(Generic[K]):
    """kvpool's default policy: leaf-first, orphans first, age weighted by reuse class."""

    name = "default"

    def __init__(self, weights: Sequence[float] = DEFAULT_WEIGHTS) -> None:
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"weights must be a non-empty list of positive numbers: {weights}")
        self._weights = tuple(float(w) for w in weights)
        self._top = len(self._weights) - 1
        self._nodes: dict[K, _Node[K]] = {}
        # Leaves only.  Each queue is in touch order except for parents that became leaves
        # when their last child left: those go to the front (their chain is being dropped).
        self._queues: list[OrderedDict[K, _Node[K]]] = [OrderedDict() for _ in self._weights]
        self._orphans: OrderedDict[K, _Node[K]] = OrderedDict()
        self._clock = 0

    def __len__(self) -> int:
        return len(self._nodes)

    # ------------------------------------------------------------------------- calls
    def on_insert(self, key: K, parent: K | None) -> None:
        if key in self._nodes:
            self.on_access(key)
            return
        self._clock += 1
        p = self._nodes.get(parent) if parent is not None else None
        node = _Node(key, p, self._clock)
        self._nodes[key] = node
        if p is not None:
            if p.kids is None:
                p.kids = set()
            p.kids.add(node)
            p.children += 1
            if p.children == 1:  # p stops being a leaf
                self._leaf_queue(p).pop(p.key, None)
            node.orphan = p.orphan
        self._leaf_queue(node)[key] = node

    def on_access(self, key: K) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        self._clock += 1
        node.stamp = self._clock
        node.reads += 1
        if node.children == 0:
            queue = self._leaf_queue(node)
            del queue[key]
            node.cls = min(node.reads, self._top)
            self._leaf_queue(node)[key] = node
        else:
            node.cls = min(node.reads, self._top)

    def on_remove(self, key: K) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        if node.children == 0:
            self._leaf_queue(node).pop(key, None)
        else:
            assert node.kids is not None
            for kid in node.kids:
                kid.parent = None
                self._orphan_subtree(kid)
        p = node.parent
        if p is not None:
            assert p.kids is not None
            p.kids.discard(node)
            p.children -= 1
            if p.children == 0:  # p is a leaf again: front of its queue
                queue = self._leaf_queue(p)
                queue[p.key] = p
                queue.move_to_end(p.key, last=False)

    def choose_victims(self, count: int, can_evict: Callable[[K], bool]) -> list[K]:
        out: list[K] = []
        if count <= 0 or not self._nodes:
            return out
        # Parents whose every child is already in ``out`` become candidates in turn.
        taken: dict[_Node[K], int] = {}
        front: list[list[_Node[K]]] = [[] for _ in range(len(self._weights) + 1)]
        self._pick_orphans(count, can_evict, out, taken, front)
        if len(out) >= count:
            return out
        iters: list[Iterator[_Node[K]]] = [iter(q.values()) for q in self._queues]
        heads: list[_Node[K] | None] = [next(it, None) for it in iters]
        weights = self._weights
        clock = self._clock
        while len(out) < count:
            best = -1
            best_score = -1.0
            for c, w in enumerate(weights):
                cand = front[c][-1] if front[c] else heads[c]
                if cand is not None:
                    score = (clock - cand.stamp) * w
                    if score > best_score:
                        best, best_score = c, score
            if best < 0:
                break
            if front[best]:
                node = front[best].pop()
            else:
                head = heads[best]
                assert head is not None
                node = head
                heads[best] = next(iters[best], None)
            if can_evict(node.key):
                out.append(node.key)
                self._release_parent(node, taken, front)
        return out

    # ---------------------------------------------------------------------- internals
    def _leaf_queue(self, node: _Node[K]) -> OrderedDict[K, _Node[K]]:
        return self._orphans if node.orphan else self._queues[node.cls]

    def _orphan_subtree(self, root: _Node[K]) -> None:
        """Mark a subtree that lost its parent; its leaves move to the orphan queue."""
        stack = [root]
        while stack:
            node = stack.pop()
            if node.orphan:
                continue
            if node.children == 0:
                self._queues[node.cls].pop(node.key, None)
                self._orphans[node.key] = node
            node.orphan = True
            if node.kids:
                stack.extend(node.kids)

    def _pick_orphans(
        self,
        count: int,
        can_evict: Callable[[K], bool],
        out: list[K],
        taken: dict[_Node[K], int],
        front: list[list[_Node[K]]],
    ) -> None:
        orphan_front = front[-1]
        it = iter(self._orphans.values())
        while len(out) < count:
            node: _Node[K] | None = orphan_front.pop() if orphan_front else next(it, None)
            if node is None:
                return
            if can_evict(node.key):
                out.append(node.key)
                self._release_parent(node, taken, front)

    def _release_parent(
        self, node: _Node[K], taken: dict[_Node[K], int], front: list[list[_Node[K]]]
    ) -> None:
        p = node.parent
        if p is None:
            return
        n = taken.get(p, 0) + 1
        taken[p] = n
        if n == p.children:
            front[-1 if p.orphan else p.cls].append(p)


POLICY_NAMES: tuple[str, ...] = ("lru", "default")


def make_policy(name: str) -> EvictionPolicy[Any]:
    """A fresh policy by name; ValueError names the choices."""
    if name == "lru":
        return LRUPolicy()
    if name == "default":
        return PrefixAwarePolicy()
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
