from __future__ import annotations

import pytest

from kvpool.core.registry import Registry, Tier
from kvpool.errors import PoolError, UnknownClient, UnknownSegment


def test_register_heartbeat_and_expiry() -> None:
    r = Registry(client_ttl_ms=1000)
    assert r.register("a", 0)
    assert not r.register("a", 10)  # a refresh, not new
    r.heartbeat("a", 900)
    assert r.expired(1899) == []
    assert r.expired(1900) == ["a"]


def test_heartbeat_of_unknown_client_asks_to_register() -> None:
    with pytest.raises(UnknownClient, match="register"):
        Registry(1000).heartbeat("ghost", 0)


def test_segments_belong_to_clients_and_leave_with_them() -> None:
    r = Registry(1000)
    r.register("a", 0)
    r.add_segment("a", "a/mem", 100, Tier.MEMORY)
    r.add_segment("a", "a/ssd", 1000, Tier.SSD)
    assert r.add_segment("a", "a/mem", 100, Tier.MEMORY) is r.segment("a/mem")
    with pytest.raises(PoolError):
        r.add_segment("a", "a/mem", 999, Tier.MEMORY)
    with pytest.raises(UnknownClient):
        r.add_segment("b", "b/mem", 100, Tier.MEMORY)
    assert [s.segment_id for s in r.tier_segments(Tier.SSD)] == ["a/ssd"]
    dropped = r.drop("a")
    assert {s.segment_id for s in dropped} == {"a/mem", "a/ssd"}
    with pytest.raises(UnknownSegment):
        r.segment("a/mem")
