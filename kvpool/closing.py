"""``with obj:`` closes it: the one context-manager shape of kvpool's resources.

Each resource (client, connection, segment, server) has one method that gives back what it
owns; :class:`Closing` makes that method the ``with`` statement's exit, written once.
"""

from __future__ import annotations

from typing import Self

__all__ = ["Closing", "Serving"]


class Closing:
    """Mixin: ``__enter__`` returns the object, ``__exit__`` calls :meth:`close`."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Serving(Closing):
    """Mixin for servers: ``with server:`` starts it, and closes it on the way out."""

    def start(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self
