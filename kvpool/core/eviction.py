"""Eviction policies: which READY objects of one tier to drop (or demote) first.

One :class:`EvictionPolicy` per tier, made by name (:func:`make_eviction_policy`);
``"default"`` stays an alias of ``"prefix_aware"`` so that older configs keep working.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar

from kvpool.core.arc import ARCPolicy
from kvpool.core.prefix_aware import PrefixAwarePolicy
from kvpool.core.s3fifo import S3FIFOPolicy

__all__ = [
    "EVICTION_POLICIES",
    "EVICTION_POLICY_ALIASES",
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixAwarePolicy",
    "S3FIFOPolicy",
    "canonical_eviction_policy",
    "make_eviction_policy",
]

K = TypeVar("K", bound=Hashable)


# The protocol:
#
# on_insert(key, parent)        the object became READY in this tier
# on_access(key)                a read hit (a lease was granted)
# on_remove(key)                the object left this tier (evicted, removed, demoted)
# choose_victims(count, can_evict) -> keys, best victim first; removes nothing
#
# A policy is pure: no clock (its only time is the order of the calls it sees), no I/O, no
# randomness.  Unknown keys in ``on_access`` / ``on_remove`` and a repeated ``on_insert`` are
# harmless, so the index never has to ask first.
#
# Invariants of every policy (tested by property tests over random call sequences):
# - ``choose_victims`` returns at most ``count`` distinct keys, each currently inserted (and
#   not removed since) and each with ``can_evict(key)`` True, and it returns
#   ``min(count, evictable keys)`` of them: nothing evictable is ever held back, so a put
#   fails with NoSpace only when nothing is evictable;
# - choosing changes nothing: two calls with no other call between give the same answer;
# - cost: LRU is O(1) per call and per victim; prefix-aware is O(1) per call plus
#   O(reuse classes) per victim, except that blocks passed over for their children (rare)
#   are walked past; S3-FIFO and ARC are O(1) per call and per victim, plus moves made
#   before a choice that reads (or, in the tree variants, cached children) paid for.
#
# S3-FIFO and ARC do lazy work when asked to choose (a head read since it came round
# moves on, as published); for them "choosing changes nothing" means that the second of
# two calls with no other call between gives the same answer.
class EvictionPolicy(Protocol[K]):
    """The eviction order of one tier; see the comment above."""

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


#: Each policy's name and how to make a fresh one.
_MAKERS: Mapping[str, Callable[[], EvictionPolicy[Any]]] = MappingProxyType(
    {
        LRUPolicy.name: LRUPolicy,
        PrefixAwarePolicy.name: PrefixAwarePolicy,
        "s3fifo": S3FIFOPolicy,
        "s3fifo_tree": lambda: S3FIFOPolicy(tree=True),
        "arc": ARCPolicy,
        "arc_tree": lambda: ARCPolicy(tree=True),
    }
)

EVICTION_POLICIES: tuple[str, ...] = tuple(_MAKERS)

#: Accepted names that are not a policy's own, and the policy each one means.
EVICTION_POLICY_ALIASES: Mapping[str, str] = MappingProxyType({"default": PrefixAwarePolicy.name})


def canonical_eviction_policy(name: str) -> str:
    """The policy a name (or alias) means; ValueError names the choices."""
    name = EVICTION_POLICY_ALIASES.get(name, name)
    if name not in EVICTION_POLICIES:
        choices = ", ".join(
            [*EVICTION_POLICIES, *(f"{a} (= {p})" for a, p in EVICTION_POLICY_ALIASES.items())]
        )
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {choices}")
    return name


def make_eviction_policy(name: str) -> EvictionPolicy[Any]:
    """A fresh policy by name or alias; ValueError names the choices."""
    return _MAKERS[canonical_eviction_policy(name)]()
