"""What eviction-policy tests share: small call helpers, and a model of what a policy is
told, with random call sequences to drive it (property tests)."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from kvpool.core.eviction import LRUPolicy, PrefixAwarePolicy, make_eviction_policy

__all__ = ["Model", "Op", "always", "chain", "ops_strategy", "read", "run_ops"]


def always(_: object) -> bool:
    return True


def chain(policy: LRUPolicy[str] | PrefixAwarePolicy[str], keys: list[str]) -> None:
    """Insert keys as one chain, root first (the order a request writes its blocks)."""
    parent: str | None = None
    for key in keys:
        policy.on_insert(key, parent)
        parent = key


def read(policy: LRUPolicy[str] | PrefixAwarePolicy[str], keys: list[str]) -> None:
    for key in keys:
        policy.on_access(key)


Op = tuple[str, int, int]
ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "insert", "access", "remove", "choose"]),
        st.integers(0, 11),
        st.integers(-1, 11),
    ),
    max_size=80,
)


class Model:
    """What the policies are told: present keys and the parent links they can know."""

    def __init__(self) -> None:
        self.present: set[int] = set()
        self.parent: dict[int, int | None] = {}

    def insert(self, key: int, parent: int | None) -> None:
        if key in self.present:
            return
        self.present.add(key)
        self.parent[key] = parent if parent in self.present else None

    def remove(self, key: int) -> None:
        self.present.discard(key)
        for k in self.present:
            if self.parent.get(k) == key:
                self.parent[k] = None

    def children(self, key: int) -> set[int]:
        return {k for k in self.present if self.parent.get(k) == key}


def run_ops(name: str, ops: list[Op], check: Callable[..., None]) -> None:
    policy = make_eviction_policy(name)
    model = Model()
    for op, key, arg in ops:
        if op == "insert":
            parent = arg if arg >= 0 and arg != key else None
            policy.on_insert(key, parent)
            model.insert(key, parent)
        elif op == "access":
            policy.on_access(key)
        elif op == "remove":
            policy.on_remove(key)
            model.remove(key)
        else:
            count = key if key < 8 else 1  # one victim is the index's common request
            pinned = {k for k in model.present if (k * 7 + arg) % 4 == 0}
            check(policy, model, count, pinned)
