"""Book-keeping of the transfer connector's worker halves (pure: no I/O, no clock): P's
:class:`SendTracker` (which requests P holds for D, and when their blocks may be freed) and
D's :class:`RecvResults` (its pulls' outcomes, drained once per step).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["HeldRequest", "RecvResults", "RecvSnapshot", "SendTracker"]


@dataclass(slots=True)
class HeldRequest:
    """One finished prefill request whose blocks P keeps for its D ranks."""

    request_id: str
    block_ids: tuple[int, ...]
    expected: frozenset[int]
    deadline_ms: int
    done: set[int] = field(default_factory=set)
    bytes_sent: int = 0


# When a prefill request finishes, vLLM leaves its blocks to the connector
# (request_finished returned True) until a worker reports the request in
# finished_sending.  The tracker says when that is:
# - a request is *held* with its block ids, the set of D ranks expected to pull it, and a
#   deadline (hold_timeout_ms from now);
# - each expected D rank either pulls its heads or sends a release (it needed nothing);
# - when every expected rank is done, or the deadline passes (a D that never came), the
#   request is *finished*: reported once in finished_sending and forgotten, so a late
#   pull of it is refused instead of reading blocks vLLM has handed to someone else.
class SendTracker:
    """Which requests P holds for D, and when their blocks may be freed."""

    # How many released request ids to remember, so that a late pull is refused at once
    # instead of waiting for a hold that will never come.
    REMEMBER_RELEASED = 4096

    def __init__(self) -> None:
        self._held: dict[str, HeldRequest] = {}
        self._finished: set[str] = set()
        self._released: OrderedDict[str, None] = OrderedDict()
        self.num_completed = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self,
        request_id: str,
        block_ids: tuple[int, ...],
        expected: frozenset[int],
        now_ms: int,
        hold_timeout_ms: int,
    ) -> None:
        """Start holding; a request no D rank will read from this rank finishes at once."""
        if request_id in self._held:
            return
        if not expected:
            self._release(request_id)
            return
        self._held[request_id] = HeldRequest(
            request_id, block_ids, expected, now_ms + hold_timeout_ms
        )

    def get(self, request_id: str) -> HeldRequest | None:
        return self._held.get(request_id)

    def was_released(self, request_id: str) -> bool:
        """Held once and released since (pulled, expired): its blocks are not ours now."""
        return request_id in self._released or request_id in self._finished

    def _release(self, request_id: str) -> None:
        self._finished.add(request_id)
        self._released[request_id] = None
        while len(self._released) > self.REMEMBER_RELEASED:
            self._released.popitem(last=False)

    def add_sent(self, request_id: str, nbytes: int) -> None:
        """Bytes of a pull that is not a D rank's last (a hybrid model's group)."""
        held = self._held.get(request_id)
        if held is not None:
            held.bytes_sent += nbytes

    def mark_done(self, request_id: str, dst_rank: int, nbytes: int = 0) -> bool:
        """D rank ``dst_rank`` has its data (or released it); ``True`` if that freed the request."""
        held = self._held.get(request_id)
        if held is None:
            return False
        held.done.add(dst_rank)
        held.bytes_sent += nbytes
        if held.expected <= held.done:
            del self._held[request_id]
            self._release(request_id)
            self.num_completed += 1
            return True
        return False

    def expire(self, now_ms: int) -> list[str]:
        """Give up on requests whose D ranks did not all come before the deadline."""
        expired = [rid for rid, held in self._held.items() if now_ms >= held.deadline_ms]
        for rid in expired:
            del self._held[rid]
            self._release(rid)
        self.num_expired += len(expired)
        return expired

    @property
    def has_finished(self) -> bool:
        """Some request is ready for :meth:`take_finished`."""
        return bool(self._finished)

    def take_finished(self) -> set[str]:
        """Requests whose blocks vLLM may free now (each reported once)."""
        finished, self._finished = self._finished, set()
        return finished


@dataclass(frozen=True, slots=True)
class RecvSnapshot:
    finished: set[str]
    failed: set[str]
    failed_block_ids: set[int]


# Every load started must be reported exactly once in finished_recving; a failed one also
# in failed_recving and its blocks in get_block_ids_with_load_errors (vLLM's recompute
# policy needs both, or the request hangs).  Pull threads record outcomes; the worker
# drains snapshots each step.
class RecvResults:
    """Outcomes of D's pulls, drained once per engine step."""

    def __init__(self) -> None:
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._failed_blocks: set[int] = set()
        self.num_ok = 0
        self.num_failed = 0
        self.bytes_received = 0

    def succeeded(self, request_id: str, nbytes: int) -> None:
        self._finished.add(request_id)
        self.num_ok += 1
        self.bytes_received += nbytes

    def failed(self, request_id: str, block_ids: list[int]) -> None:
        """A failed load is finished too: vLLM then recomputes (or fails) the request."""
        self._finished.add(request_id)
        self._failed.add(request_id)
        self._failed_blocks.update(block_ids)
        self.num_failed += 1

    @property
    def has_finished(self) -> bool:
        return bool(self._finished)

    def take(self) -> RecvSnapshot:
        snapshot = RecvSnapshot(self._finished, self._failed, self._failed_blocks)
        self._finished, self._failed, self._failed_blocks = set(), set(), set()
        return snapshot
