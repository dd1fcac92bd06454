"""The pool at a glance: what ``kvpool status``, ``kvpool doctor`` and the status page show.

A plain JSON-able dict whose keys are a contract with those readers (and their tests).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvpool.core.objects import State
from kvpool.core.registry import Tier
from kvpool.master.metrics import counter_total

if TYPE_CHECKING:
    from kvpool.master.service import MasterService

__all__ = ["leadership_view", "pool_snapshot"]


def pool_snapshot(service: MasterService) -> dict[str, Any]:
    """The pool at a glance, JSON-able."""
    now = service.clock()
    idx = service.index
    tiers = {}
    for tier in Tier:
        capacity, used = idx.usage(tier)
        tiers[tier.value] = {"capacity": capacity, "used": used, "objects": idx.count(tier)}
    clients = [
        {
            "client_id": c.client_id,
            "address": c.address,
            "last_heartbeat_ms_ago": now - c.last_seen_ms,
            "segments": list(c.segment_ids),
        }
        for c in idx.registry.clients.values()
    ]
    return {
        "uptime_s": (now - service.started_ms) / 1000,
        "tiers": tiers,
        "segments": _segments(service),
        "objects": len(idx),
        "pending": idx.count(state=State.PENDING),
        "clients": clients,
        "active_leases": idx.active_leases(now),
        "rpc_connections": service.rpc_connections,
        "stats": {
            "evictions": idx.stats.evictions,
            # what kvpool_offloads_total / kvpool_offload_failures_total say: completed
            # copies, and failures (the index's own count also has attempts in flight)
            "offloads": counter_total(service.metrics.offloads),
            "demote_failures": counter_total(service.metrics.demote_failures),
            "put_failures_no_space": idx.stats.put_failures_no_space,
            "expired_leases": idx.stats.expired_leases,
            "revoked_writes": idx.stats.revoked_writes,
        },
        "lookups": service.metrics.lookup_counts(),
        "recent_errors": list(service.recent_errors),
        "config": service.config_view,
        "leadership": leadership_view(service),
    }


def leadership_view(service: MasterService) -> dict[str, Any]:
    """Role, epoch, leader and standbys, as ``kvpool status`` shows them."""
    who = service.leadership.who(time.monotonic())
    return {f: getattr(who, f) for f in who.__struct_fields__}


def _segments(service: MasterService) -> list[dict[str, Any]]:
    """Each memory segment, with how far its pages are faulted in ("warm": off,
    warming, warm, failed; or unknown when its owner does not say)."""
    out = []
    for seg in service.index.registry.segments.values():
        if seg.tier is not Tier.MEMORY:
            continue
        state, warmed = service.clients.warmth_of(seg.segment_id) or ("unknown", 0)
        endpoint = service.clients.endpoints.get(seg.segment_id)
        out.append(
            {
                "segment_id": seg.segment_id,
                "client_id": seg.client_id,
                # where its bytes are read (a client's warm() connects to it ahead)
                "data_address": endpoint.data_address if endpoint is not None else "",
                "shm_name": endpoint.shm_name if endpoint is not None else "",
                "capacity": seg.capacity,
                "used": seg.capacity - seg.space.free,
                "warm": state,
                "warmed_bytes": warmed,
            }
        )
    return out
