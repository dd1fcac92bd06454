"""A list whose items are closed when its ``with`` block ends: the fixture of a test that
opens several workers, clients or servers and must give every one of them back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

__all__ = ["closed_at_end"]


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


@contextmanager
def closed_at_end(kind: type[C]) -> Iterator[list[C]]:
    """``with closed_at_end(TransferWorker) as made:`` closes what the test put in ``made``
    (``kind`` only names the type of its items)."""
    made: list[C] = []
    yield made
    for item in made:
        item.close()
