"""The prefix-aware eviction policy (``"prefix_aware"``, kvpool's default; alias ``"default"``).

Orphans first, descendants before ancestors, age weighted by reuse class, and a ghost list
of evicted keys; :class:`PrefixAwarePolicy` says why, with the measurements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

from kvpool.core.prefix_nodes import (
    ORPHAN,
    QUEUED,
    RUN,
    Fifo,
    Node,
    detach,
    new_node,
    orphans_below,
    take_victims,
)

__all__ = [
    "END_WEIGHT_RANGE",
    "GHOST_FACTOR",
    "READ_WEIGHT_RANGE",
    "REUSE_WEIGHTS",
    "REWEIGH_DECAY",
    "REWEIGH_FACTOR",
    "REWEIGH_MIN",
    "PrefixAwarePolicy",
]

K = TypeVar("K", bound=Hashable)

#: Starting age multiplier per reuse class: a never-read block at the end of its chain, any
#: other never-read block, a block read at least once.  Life is proportional to 1 / weight.
REUSE_WEIGHTS: tuple[float, ...] = (8.0, 1.0, 0.35)

#: Re-weighting (5. in the class docstring): the ranges of the chain-end and read weights;
#: every REWEIGH_FACTOR x the most blocks held (>= REWEIGH_MIN) placed blocks, then decay.
END_WEIGHT_RANGE = (1.0, 8.0)
READ_WEIGHT_RANGE = (0.05, 1.0)
REWEIGH_FACTOR = 0.1
REWEIGH_MIN = 500
REWEIGH_DECAY = 0.98

#: How many evicted keys the policy remembers: between one and two times this multiple of
#: the most blocks it has held (see 4. in the class docstring).
GHOST_FACTOR = 1.0


class PrefixAwarePolicy(Generic[K]):
    """kvpool's default eviction policy: orphans first, descendants before ancestors, and age
    weighted by reuse class.  Why it looks the way it does (measured on the Mooncake
    conversation trace in docs/benchmarks.md):

    1. *A child is worthless without its parent.*  A prefix lookup stops at the first missing
       block, so evicting a block wastes every cached descendant; LRU does exactly that, since
       a request touches its chain root first, leaving the root the oldest.  This policy
       evicts **descendants before ancestors**: a run of calls that walks down one chain (a
       request reading its prefix, then writing its new blocks) is held apart and placed in
       the queues deepest-first when the run ends, so a chain is trimmed from its tail.  A
       block whose cached children are not all chosen before it is passed over.  Invariant:
       when every key is evictable, each key in an answer comes after all its cached
       children.  Only when nothing else is evictable is a parent of pinned children offered
       (an orphan is better than a failed put).  When concurrent requests interleave their
       calls, runs are cut short and a chain may be placed root-first; the answers stay
       right (parents are passed over) but a choice then walks past those parents.
    2. *Orphans go first.*  A block that leaves while it still has cached descendants (removed
       by hand, its client expired) makes its whole subtree unreachable by prefix lookups;
       the subtree is offered before anything else, deepest first.
    3. *Most blocks are never read again, reuse comes back late, and a never-read block at
       the end of its chain is the least likely of all to be read.*  In the conversation trace
       76% of blocks are used once; a block is reused when its conversation returns for
       another turn, minutes later; the last block of a request (where the next turn's prompt
       diverges) is almost never reused.  Frequency policies (segmented LRU, LFU) do worse
       than LRU there because a new block must survive the long gap before it can prove
       itself.  So instead of segments of fixed size the policy keeps one LRU queue per
       *reuse class* and evicts the queue head with the largest ``age * weight[class]`` (age
       counts placed blocks since the block was last touched): classes are a never-read block
       at the end of its chain (weight 8), any other never-read block (1) and a block read at
       least once (0.35).  A block lives about ``1 / weight`` times as long as a never-read
       one whatever the cache size, so the trade-off scales with capacity instead of being a
       fixed split.
    4. *A block written again after it was evicted was evicted too early.*  The policy
       remembers the keys of the blocks that left it (ghosts, as in ARC: the last L to 2L
       keys, L = ``GHOST_FACTOR`` times the most blocks it has held, kept as two generations
       of sets); a block inserted while its key is remembered counts as read once (its
       conversation came back after the block had gone), so it joins the read class.  In the
       trace this is the strongest online signal found: +4.3 % hit ratio at 10,000 blocks,
       +13 % at 2,000 and 5,000, +2.5 % at 20,000 over the same weights without it.  Cost:
       up to 2L remembered keys, a set entry each.
    5. *How much longer a read block is worth keeping depends on the trace and the size.*  The
       weights of the read class and of never-read chain ends follow the trace: the policy
       counts, per class, the hits on queued blocks and the ages at which its blocks were hit
       or left (hits per unit of age: the class's hit density), and every tenth of the most
       blocks held sets each of the two weights to ``weight[1] * density[1] /
       density[class]`` within its range (read 0.05-1, chain end 1-8), the counts then
       decaying by 2 %.  Fixed weights tuned on the conversation trace lost to LRU on traces
       where every block's future is alike (conversations that come back soon: 0.986 x LRU)
       or where chain ends are read again (a loop over a working set); following the
       densities, the policy is at or above LRU on all of them, +30 % / +5 % over the fixed
       weights at 2,000 / 5,000 blocks of the conversation trace and within 0.6 % of them at
       10,000 / 20,000 (docs/benchmarks.md, "the next policy").  ``adaptive=False`` keeps
       the weights fixed.

    Ideas measured and dropped (docs/benchmarks.md, "Trace replay" sections, has the numbers):
    block depth or chain length as value, more reuse classes, LHD-style sampled hit densities,
    a conversation's turn count carried into its new blocks, random admission; with ghosts, a
    class of their own, longer or shorter lives for a returning conversation's new blocks, an
    exact FIFO of ghosts, fewer or more ghosts; ARC-style steps of the read weight per ghost
    hit, and density windows shorter than the one above.
    """

    name = "prefix_aware"

    def __init__(
        self,
        weights: Sequence[float] = REUSE_WEIGHTS,
        ghost_factor: float = GHOST_FACTOR,
        adaptive: bool = True,
    ) -> None:
        if len(weights) < 2 or any(w <= 0 for w in weights):
            raise ValueError(f"weights must be two or more positive numbers, got {weights}")
        if ghost_factor < 0:
            raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
        self._ghost_factor = ghost_factor
        # Keys that left, in two generations: when the young one holds ``_ghost_limit``
        # keys it becomes the old one and the old one is forgotten.  Two sets remember
        # the last L to 2L keys for the cost of a set add, where an exact FIFO of 2L keys
        # (an OrderedDict) cost 15 % of the policy's time.
        self._ghosts: set[K] = set()
        self._old_ghosts: set[K] = set()
        self._most = 0  # the most blocks held at once: the ghost lists' scale
        self._ghost_limit = 0.0  # L = _most * ghost_factor
        self._weights = [float(w) for w in weights]
        # Hit density per class (5. in the class docstring): reads of queued blocks, and
        # the ages they were read or left at, decayed at each re-weighting.
        self._adaptive = adaptive
        self._hits = [0.0] * len(self._weights)
        self._lives = [0.0] * len(self._weights)
        self._reweigh_at = REWEIGH_MIN
        self._top = len(self._weights) - 1
        self._nodes: dict[K, Node[K]] = {}
        # One queue per reuse class, oldest first.  A run of touches that walks down one
        # chain (root ... leaf, the order a request reads and writes its prefix) is held
        # apart in ``_run`` and placed deepest-first when it ends, so within a request the
        # tail is older than the head and LRU order trims chains from the tail.
        nodes = self._nodes
        self._queues: list[Fifo[K]] = [Fifo(nodes) for _ in self._weights]
        self._orphans: Fifo[K] = Fifo(nodes)
        self._run: list[Node[K]] = []
        self._clock = 0
        # (class, weight, queue) for the one-victim path, which scans every class; made
        # again when the weights change (rarely), so the path reads no list per class
        self._classes = self._class_table()

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def weights(self) -> tuple[float, ...]:
        """The reuse classes' weights now (the read class's follows its hit density)."""
        return tuple(self._weights)

    # ------------------------------------------------------------------------- calls
    def on_insert(self, key: K, parent: K | None) -> None:
        nodes = self._nodes
        if key in nodes:
            self.on_access(key)
            return
        p = None if parent is None else nodes.get(parent)
        node = new_node(nodes, key, p)
        if key in self._ghosts or key in self._old_ghosts:
            self._ghosts.discard(key)
            self._old_ghosts.discard(key)
            node.reads = 1  # it was here before: its conversation came back too late
        if len(nodes) > self._most:
            self._most = len(nodes)
            self._ghost_limit = self._most * self._ghost_factor
        run = self._run
        if run and p is not run[-1]:
            self._place_run()
        run.append(node)

    def on_access(self, key: K) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        node.reads += 1
        where = node.where
        if where == RUN:
            return  # already among the youngest; it is placed when the run ends
        if where == QUEUED:  # (_unqueue, inline)
            c = node.cls
            self._hits[c] += 1.0
            self._lives[c] += self._clock - node.stamp
            self._queues[c].remove(node)
        else:
            self._orphans.remove(node)
        node.where = RUN
        run = self._run
        if run and node.parent is not run[-1]:
            self._place_run()
        run.append(node)

    def on_remove(self, key: K) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        where = node.where
        if where == QUEUED:  # the usual case: an evicted victim (_unqueue, inline)
            c = node.cls
            self._lives[c] += self._clock - node.stamp
            self._queues[c].remove(node)
        elif where == RUN:
            self._run.remove(node)
        else:
            self._orphans.remove(node)
        for root in detach(self._nodes, node):
            self._orphan_subtree(root)
        if self._ghost_factor:
            ghosts = self._ghosts
            ghosts.add(key)
            if len(ghosts) >= self._ghost_limit:
                self._old_ghosts = ghosts
                self._ghosts = set()

    def choose_victims(self, count: int, can_evict: Callable[[K], bool]) -> list[K]:
        if count == 1 and not self._orphans:
            # The common case (one block's room), without the bookkeeping of the general
            # path; falls through when the best head is pinned or has children.
            clock = self._clock
            best: Node[K] | None = None
            best_score = -1.0
            for weight, queue in self._classes:
                head = queue.head
                if head is None:
                    continue
                score = (clock - head.stamp) * weight
                if score > best_score:
                    best, best_score = head, score
            if best is not None and not best.children and can_evict(best.key):
                return [best.key]
        if count <= 0:
            return []
        return take_victims(count, can_evict, self._orphans, self._weighted_order(), self._run)

    # ---------------------------------------------------------------------- internals
    def _place_run(self) -> None:
        clock = self._clock
        top = self._top
        queues = self._queues
        for node in reversed(self._run):
            clock += 1
            node.stamp = clock
            if node.orphan:
                node.where = ORPHAN
                self._orphans.append(node)
            else:
                node.where = QUEUED
                reads = node.reads
                # never-read: 0 at the end of its chain, else 1; read n times: n + 1
                c = (reads + 1 if reads < top else top) if reads else (1 if node.children else 0)
                node.cls = c
                queues[c].append(node)
        self._clock = clock
        self._run.clear()
        if clock >= self._reweigh_at and self._adaptive:
            self._reweigh()

    def _reweigh(self) -> None:
        """Set the weights of the never-read chain ends and of the read class to
        ``weight[1] * density[1] / density[class]`` (density: hits per unit of age spent
        in the class), each within its range, then decay the counts, so the weights
        follow the trace (5. in the class docstring)."""
        hits, lives, weights = self._hits, self._lives, self._weights
        densities = [
            # hits at age 0 (read before anything else was placed): density infinite
            h / n if n else (math.inf if h else 0.0)
            for h, n in zip(hits, lives, strict=True)
        ]
        inner = densities[1]
        for c, (lo, hi) in ((0, END_WEIGHT_RANGE), (self._top, READ_WEIGHT_RANGE)):
            d = densities[c]
            if not (inner or d):
                continue  # no evidence yet: keep the weight
            w = weights[1] if d == inner else hi if d == 0 else weights[1] * inner / d
            weights[c] = lo if w < lo else hi if w > hi else w
        for counts in (hits, lives):
            for c in range(len(counts)):
                counts[c] *= REWEIGH_DECAY
        self._reweigh_at = self._clock + max(REWEIGH_MIN, int(REWEIGH_FACTOR * self._most))
        self._classes = self._class_table()

    def _class_table(self) -> tuple[tuple[float, Fifo[K]], ...]:
        return tuple(zip(self._weights, self._queues, strict=True))

    def _orphan_subtree(self, root: Node[K]) -> None:
        """A subtree lost its parent: no block in it can be a prefix hit here any more, so
        all of it moves to the orphan queue, deepest first."""
        for node in orphans_below(self._nodes, root):
            if node.where == QUEUED:
                self._queues[node.cls].remove(node)
                node.where = ORPHAN
                self._orphans.append(node)

    def _weighted_order(self) -> Iterator[Node[K]]:
        """The queued nodes in the order they are offered: repeatedly the queue head with
        the largest ``age * weight``.  A node whose children are still cached is passed
        over by the taker, not moved: its descendants go first.  Runs are placed
        deepest-first, so that is rare.  A head is replaced by the next of its queue only
        when the taker asks for another."""
        nodes = self._nodes
        weights = self._weights
        clock = self._clock
        heads = [queue.head for queue in self._queues]
        while True:
            best = -1
            best_score = -1.0
            for c, head in enumerate(heads):
                if head is not None:
                    score = (clock - head.stamp) * weights[c]
                    if score > best_score:
                        best, best_score = c, score
            if best < 0:
                return
            node = heads[best]
            assert node is not None
            yield node
            heads[best] = None if node.newer is None else nodes[node.newer]
