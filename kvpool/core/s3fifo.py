"""S3-FIFO (Yang et al., SOSP '23) as an eviction policy: ``"s3fifo"`` as published, and
``"s3fifo_tree"`` on the prefix tree (:class:`~kvpool.core.queue_policy.QueuePolicy`).
A small FIFO takes new blocks and drops those not read again quickly; a main FIFO with
second chances keeps the rest; a block in the small one's ghost list goes straight to the
main one when written again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from itertools import chain
from typing import TypeVar

from kvpool.core.prefix_nodes import QUEUED, Node
from kvpool.core.queue_policy import QueuePolicy, two_generation_add

__all__ = ["FREQ_CAP", "GHOST_RATIO", "PROMOTE_AT", "SMALL_RATIO", "S3FIFOPolicy"]

K = TypeVar("K", bound=Hashable)

SMALL_RATIO = 0.1  # the small FIFO's share of the blocks held (the paper's 10 %)
GHOST_RATIO = 0.9  # ghosts remembered: 1 to 2 times this multiple of the most blocks held
FREQ_CAP = 3  # reads counted per block (two bits, as published)
PROMOTE_AT = 1  # reads that move a block at the small FIFO's head to the main one

_SMALL, _MAIN = 0, 1  # Node.cls: the FIFO a queued node is in


class S3FIFOPolicy(QueuePolicy[K]):
    """Small FIFO, main FIFO with second chances, ghost list.

    - A new block joins the small FIFO, or the main one when its key is a ghost (it was
      dropped from the small FIFO not long ago and is wanted again).
    - A read adds one to the block's count (at most ``FREQ_CAP``) and moves nothing.
    - A victim is taken from the small FIFO while it holds ``SMALL_RATIO`` of the blocks
      (or the main one is empty): its head moves to the main FIFO if it was read
      ``PROMOTE_AT`` times or more (in the tree variant, also if it has cached
      children), else it is the victim and its key becomes a ghost.  From the main FIFO:
      a head read since it last came round goes back to the tail with its count less one
      (in the tree variant a head with cached children also goes back, count unchanged,
      and a main FIFO of parents only gives way to the small one), else it is the
      victim.  Those moves are made before a choice (``_normalize``); an immediate
      second choice finds nothing more to move and gives the same answer.
    - When more than one victim is asked, or the head is pinned, the rest follow in
      queue order (small then main, or main then small), without second chances.

    Cost: O(1) per call and per victim, plus the moves: each second chance is paid for
    by a read; in the tree variant parents passed over cost one move each per turn.
    """

    name = "s3fifo"

    def __init__(
        self,
        tree: bool = False,
        small_ratio: float = SMALL_RATIO,
        ghost_ratio: float = GHOST_RATIO,
        promote_at: int = PROMOTE_AT,
    ) -> None:
        if not 0 < small_ratio < 1:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        if ghost_ratio < 0:
            raise ValueError(f"ghost_ratio must be >= 0, got {ghost_ratio}")
        if not 1 <= promote_at <= FREQ_CAP:
            raise ValueError(f"promote_at must be in 1..{FREQ_CAP}, got {promote_at}")
        super().__init__(tree)
        if tree:
            self.name = "s3fifo_tree"
        self._small_ratio = small_ratio
        self._ghost_ratio = ghost_ratio
        self._promote_at = promote_at
        self._small: OrderedDict[K, Node[K]] = OrderedDict()
        self._main: OrderedDict[K, Node[K]] = OrderedDict()
        self._ghosts: set[K] = set()
        self._old_ghosts: set[K] = set()

    def in_small(self, key: K) -> bool:
        """Whether ``key`` is queued in the small FIFO (for tests)."""
        return key in self._small

    def in_main(self, key: K) -> bool:
        """Whether ``key`` is queued in the main FIFO (for tests)."""
        return key in self._main

    # ---------------------------------------------------------------- the subclass hooks
    def _admit(self, node: Node[K]) -> None:
        key = node.key
        if key in self._ghosts or key in self._old_ghosts:
            self._ghosts.discard(key)
            self._old_ghosts.discard(key)
            node.cls = _MAIN
        else:
            node.cls = _SMALL

    def _place(self, node: Node[K]) -> None:
        node.where = QUEUED
        (self._main if node.cls else self._small)[node.key] = node

    def _hit(self, node: Node[K]) -> None:
        if node.reads < FREQ_CAP:
            node.reads += 1

    def _unplace(self, node: Node[K], left: bool) -> None:
        key = node.key
        if node.cls:
            del self._main[key]
        else:
            del self._small[key]
            if left:
                self._ghost(key)

    def _unplace_run(self, node: Node[K]) -> None:
        self._ghost(node.key)

    def _from_small(self) -> bool:
        small, main = self._small, self._main
        return bool(small) and (
            len(small) >= self._small_ratio * len(self._nodes)
            or not main
            or (self._tree and self._all_parents(_MAIN, main))
        )

    def _normalize(self) -> None:
        small, main = self._small, self._main
        promote_at = self._promote_at
        while True:
            if self._from_small():
                head = next(iter(small.values()))
                if head.reads >= promote_at or head.children:
                    del small[head.key]
                    self._moved(head, _MAIN)
                    main[head.key] = head
                    continue
                return
            if not main:
                return
            head = next(iter(main.values()))
            if head.reads:
                head.reads -= 1
                main.move_to_end(head.key)
                continue
            if head.children and not self._all_parents(_MAIN, main):
                main.move_to_end(head.key)  # a leaf is in there: it comes round first
                continue
            return

    def _first(self) -> Node[K] | None:
        if self._from_small():
            return next(iter(self._small.values()))
        if self._main:
            return next(iter(self._main.values()))
        return None

    def _order(self) -> Iterable[Node[K]]:
        small, main = self._small.values(), self._main.values()
        return chain(small, main) if self._from_small() else chain(main, small)

    # ---------------------------------------------------------------------- internals
    def _ghost(self, key: K) -> None:
        if self._ghost_ratio:
            self._ghosts, self._old_ghosts = two_generation_add(
                self._ghosts, self._old_ghosts, key, self._ghost_ratio * self._most
            )
