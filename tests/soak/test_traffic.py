"""The soak's own checker: it must catch a wrong byte, or the soak proves nothing."""

from __future__ import annotations

import random

from tests.soak.traffic import Traffic, value_of


def traffic() -> Traffic:
    t = Traffic(client=None, name="c", rng=random.Random(0))  # type: ignore[arg-type]
    t.valid = {"c-k1": {3, 5}, "c-k2": {4}}
    return t


def test_a_miss_or_an_acknowledged_version_passes() -> None:
    t = traffic()
    t.check("c-k1", None)
    t.check("c-k1", value_of("c-k1", 5, 4096))
    t.check("c-k1", value_of("c-k1", 3, 100))
    assert t.result.wrong == [] and t.result.reads == 3 and t.result.misses == 1


def test_another_keys_value_an_unknown_version_or_a_changed_byte_is_wrong() -> None:
    t = traffic()
    t.check("c-k1", value_of("c-k2", 4, 4096))  # another key's object
    t.check("c-k1", value_of("c-k1", 4, 4096))  # a version never acknowledged for it
    flipped = bytearray(value_of("c-k1", 5, 4096))
    flipped[2000] ^= 1
    t.check("c-k1", bytes(flipped))
    t.check("c-k1", b"\xff\xfe junk")
    assert len(t.result.wrong) == 4
