"""The index's values are frozen, equal by value, hashable and printable."""

from __future__ import annotations

import dataclasses

import msgspec
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


def field_names(value: object) -> list[str]:
    if isinstance(value, msgspec.Struct):
        return list(value.__struct_fields__)
    return [f.name for f in dataclasses.fields(value)]  # type: ignore[arg-type]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_values_are_frozen_equal_hashable_and_printable(value: object) -> None:
    names = field_names(value)
    copy = type(value)(*(getattr(value, name) for name in names))
    assert copy == value and hash(copy) == hash(value)
    with pytest.raises(AttributeError):  # FrozenInstanceError is one too
        setattr(value, names[0], None)
    assert getattr(value, names[0]) is not None
    assert repr(value).startswith(f"{type(value).__name__}({names[0]}=")


def test_values_differ_by_every_field() -> None:
    assert loc(0) != loc(8)
    assert Dropped("k", Tier.SSD, "evicted") != Dropped("k", Tier.SSD, "removed")
    assert Dropped("k", Tier.SSD, "evicted").client_id == ""  # the default still applies
    assert Extent(3, 4).end == 7
    assert Demote("k", loc(0), loc(8), 7) != Demote("k", loc(0), loc(8), 8)
