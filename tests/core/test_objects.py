"""The index's values keep the frozen-dataclass contract with their hand-written __init__."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.core.objects import Demote, Dropped, Location, ReadGrant, Reservation
from kvpool.core.registry import Tier
from kvpool.core.space import Extent


def loc(offset: int = 0) -> Location:
    return Location("s", "c", Tier.MEMORY, offset, 8)


VALUES = [
    Extent(3, 4),
    loc(),
    Reservation("k", loc(), 5),
    ReadGrant("k", loc(), 7, 9),
    Dropped("k", Tier.SSD, "evicted"),
    Demote("k", loc(0), loc(8), 7),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_values_are_frozen_equal_hashable_and_printable(value: object) -> None:
    fields = dataclasses.fields(value)  # type: ignore[arg-type]
    copy = type(value)(*(getattr(value, f.name) for f in fields))
    assert copy == value and hash(copy) == hash(value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, fields[0].name, None)
    assert repr(value).startswith(f"{type(value).__name__}({fields[0].name}=")
    assert dataclasses.asdict(value)  # type: ignore[call-overload]


def test_values_differ_by_every_field() -> None:
    assert loc(0) != loc(8)
    assert Dropped("k", Tier.SSD, "evicted") != Dropped("k", Tier.SSD, "removed")
    assert Dropped("k", Tier.SSD, "evicted").client_id == ""  # the default still applies
    assert Extent(3, 4).end == 7
