"""``with obj:`` closes it: the one context-manager shape of kvpool's resources.

Clients, connections, segments, servers and test processes each own something that must
be given back (a socket, a mapping, a thread, a child process) and each has one method that
gives it back.  :class:`Closing` turns that method into the ``with`` statement's exit, so
the shape is written once.
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
