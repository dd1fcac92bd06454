"""What the transfer connector's scheduler tells its workers each step (picklable data);
``remote_*`` fields describe the P side as D sees it, as in vLLM's P/D convention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GroupPull", "HoldJob", "RecvJob", "ReleaseJob", "TransferJobs"]


@dataclass(frozen=True, slots=True)
class HoldJob:
    """P: keep ``block_ids`` of a finished prefill request until its D ranks pulled them."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GroupPull:
    """A hybrid model's KV cache group ``group`` (its index): P's blocks
    ``remote_block_ids`` into D's ``local_block_ids``, block for block."""

    group: int
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RecvJob:
    """D: pull the prompt KV of ``request_id`` from P into ``local_block_ids``.

    ``remote_block_ids`` are P's blocks for the same token range, block for block.  A
    hybrid model's job names its KV cache groups' blocks in ``groups`` instead (then
    ``local_block_ids`` are all of them, for reporting, and ``remote_block_ids`` empty).
    """

    request_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    remote_request_id: str
    remote_host: str
    remote_port: int  # port of P's TP rank 0 of its DP engine; rank r listens on port + r
    remote_tp_size: int
    remote_engine_id: str
    groups: tuple[GroupPull, ...] = ()


@dataclass(frozen=True, slots=True)
class ReleaseJob:
    """D: tell P it will not pull ``remote_request_id`` (aborted, or computed locally)."""

    request_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int


@dataclass(slots=True)
class TransferJobs:
    """One step's jobs; empty most steps."""

    holds: list[HoldJob] = field(default_factory=list)
    recvs: list[RecvJob] = field(default_factory=list)
    releases: list[ReleaseJob] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.holds or self.recvs or self.releases)
